"""CPU schedule for the Strassen matmul kernels ``legalize/strassen_matmul.py`` writes (+ epilogue).

The stages are found by their ``tvm_fusion.strassen`` block annotations:

* ``weight`` (the 7 sums of B's blocks): written straight into the micro-kernel's packed layout
  ``[j / vt, p, r, vt]`` (a task's 7 weight panels are one contiguous stream) and, for a
  constant weight (``layout_free_buffers``), marked a layout-rewrite preproc, so
  ``SplitLayoutRewritePreproc`` + ``FoldConstant`` compute it at compile time; otherwise a
  parallel stage (correct, slower);
* ``input`` (the 7 sums of A's blocks): a root stage, parallel over rows, the 7 sums unrolled,
  vectorized along the reduction;
* ``output`` (C's four blocks) with ``view`` inlined into it: tiled into parallel tasks of ``rt``
  rows x ``vt`` columns of each of the four blocks. Each task first computes its 7 product
  tiles (``gemm``: per product a register micro-kernel of rt x vt accumulators over the
  reduction, stored to a 7 x rt x vt buffer that stays in L1), then the four blocks' tiles
  from them (unrolled: the selection of the block sums folds), each followed by the fused
  epilogue (bias, activation, residual add) on that tile.

Tunable decision (:mod:`.knobs`): ``plan``, the micro-kernel cost model's n-th best (vt, rt)
(Winograd's: the same register GEMM, rt rows broadcast, vt columns of packed weight vectors).
"""

from __future__ import annotations

from tvm import s_tir, tirx

from ..legalize.strassen_matmul import SIGNATURE, STAGE
from ._util import (
    LAYOUT_REWRITE_PREPROC,
    elementwise_epilogue,
    int_extent,
    layout_free_params,
    logger,
    reverse_compute_within,
    safe_rule,
    stage_blocks,
    try_primitive,
    vector_lanes,
)
from .fallback import schedule_nest
from .knobs import Knobs
from .row_stage import schedule_leftover_stage, schedule_row_prologue
from .staged import (
    StagedKernelRule,
    drop_unit_dims,
    inline_chain,
    iterate_as_output,
    read_index,
    static_domain,
)
from .winograd import micro_kernel_plans

MAX_PLAN_CHOICES = 8
STAGES = {"weight", "input", "gemm", "output", "view"}

_WARNED: set[str] = set()


class Strassen(StagedKernelRule):
    """The Strassen matmul schedule (see module docstring); declines anything else."""

    STAGE = STAGE
    SIGNATURE = SIGNATURE

    def declined(self, func, target, signature: str):
        _warn_declined(signature)
        self.last_knobs = None  # the plain schedule has no decision to tune
        return _plain_schedule(func, target, self.prepack)

    @safe_rule
    def _schedule(self, sch, stages, func, target, tunable):
        if set(stages) != STAGES:
            return None
        knobs = self.last_knobs = Knobs(self.knobs, tunable)
        gemm = stages["gemm"]
        extents = [int_extent(sch, lp) for lp in sch.get_loops(gemm)]
        if None in extents:
            return None
        _, m, n, _ = extents
        plans = micro_kernel_plans(n, m, 1, target)
        if not plans:
            return None
        vt, rt, cost = plans[knobs.choose(sch, "plan", min(len(plans), MAX_PLAN_CHOICES))]
        logger.debug(
            "Strassen %s: vt %d rt %d cost %.2f", sch.get(gemm).annotations.get(SIGNATURE), vt, rt, cost
        )
        lanes = vector_lanes(target, "float32")

        # C's blocks (``output``, iterating over (.., block row, row, block column, column)) write
        # the kernel's result: the view is inlined into them (its inverse index is affine)
        anchor = stages["output"]
        dims = static_domain(sch, stages["view"])
        before = [sch.get(b) for b in sch.get_child_blocks(sch.get_sblock("root"))]
        sch.reverse_compute_inline(stages["view"])
        # the fused epilogue: inlined into its last block but for a value two blocks read (GELU's
        # x), all computed per tile right after C's blocks (reading them plainly, r = qr·m + i)
        epilogue = elementwise_epilogue(sch, anchor) if sch.get_consumers(anchor) else []
        if epilogue is None or not all(drop_unit_dims(sch, blk, dims) for blk in epilogue[:-1]):
            return None
        if epilogue and not (
            drop_unit_dims(sch, epilogue[-1], dims) or iterate_as_output(sch, epilogue, dims)
        ):
            return None
        chain = {sch.get(b).name_hint for b in epilogue}
        prologue = [
            st.name_hint for st in before if STAGE not in st.annotations and st.name_hint not in chain
        ]
        after = [*inline_chain(sch, epilogue), *epilogue[-1:]]

        # ---- weight sums: packed [j / vt, p, r, vt] (a task's 7 panels one contiguous stream), ---
        # at compile time when the weight is a constant
        weight_blk = stages["weight"]
        sch.transform_layout(
            gemm,
            ("read", read_index(sch, gemm, sch.get(weight_blk).writes[0].source)),
            tirx.IndexMap.from_func(lambda p, r, j: [j // vt, p, r, j % vt], ndim=3),
        )
        _schedule_weight_sums(sch, weight_blk, func, lanes, self.prepack)

        # ---- tasks: rt rows x vt columns of C's four blocks (+ epilogue) -------------------------
        *lead, q_row, i, q_col, j = sch.get_loops(anchor)
        i_o, i_i = sch.split(i, factors=[None, rt])
        j_o, j_i = sch.split(j, factors=[None, vt])
        # column blocks outermost: a thread's consecutive tasks share the weight panels (7 x
        # depth/2 x vt), which then stay in L2 across the row tiles
        sch.reorder(*lead, j_o, i_o, q_row, q_col, i_i, j_i)
        task = sch.fuse(*lead, j_o, i_o)
        sch.parallel(task)
        sch.unroll(q_row)
        sch.unroll(q_col)  # the block sums' selection folds
        _vectorize_tile_row(sch, anchor, vt, lanes)
        for blk in after:  # per block tile: its rows are one box of the result (not so the task's)
            # (checked: a view of the same rank, [S, 768] as [12 S, 64], may not cover its domain)
            if not reverse_compute_within(sch, blk, None, q_col, preserve_unit_loops=True):
                return None
            _vectorize_tile_row(sch, blk, vt, lanes)

        # ---- the 7 products under the task: a register micro-kernel each -----------------------
        sch.compute_at(gemm, task, preserve_unit_loops=True)
        p_l, i_l, j_l, r_l = sch.get_loops(gemm)[-4:]
        j_m = None
        if vt > lanes and vt % lanes == 0:
            j_m, j_l = sch.split(j_l, factors=[None, lanes])
        sch.reorder(p_l, r_l, i_l, *([j_m] if j_m is not None else []), j_l)
        # accumulators of one product in registers; the task's 7 x rt x vt products in L1
        acc = sch.cache_write(gemm, 0, "local")
        sch.reverse_compute_at(acc, p_l, preserve_unit_loops=True)
        try_primitive(sch.vectorize, sch.split(sch.get_loops(acc)[-1], factors=[None, lanes])[1])
        sch.unroll(i_l)
        if j_m is not None:
            sch.unroll(j_m)
        sch.vectorize(j_l)
        init = sch.decompose_reduction(gemm, r_l)
        try_primitive(sch.vectorize, sch.get_loops(init)[-1])

        _schedule_block_sums(sch, stages["input"], lanes)  # A's block sums
        # ---- a prologue fused in front (layer_norm -> matmul): parallel rows, as Contraction's ----
        handled = set()
        for prod in sch.get_producers(stages["input"]):
            handled |= schedule_row_prologue(sch, prod, target)
        for name in prologue:
            if name not in handled:
                schedule_leftover_stage(sch, sch.get_sblock(name), target)
        return sch


def _warn_declined(signature: str) -> None:
    """Say so (once per shape and process) when a kernel the Strassen legalization wrote is not
    one this rule can schedule: it then gets :func:`_plain_schedule` (correct, about 2x slower
    than the plain GEMM: the products go to memory)."""
    if signature not in _WARNED:
        _WARNED.add(signature)
        logger.warning(
            "Strassen matmul %s: the Strassen schedule does not apply to its fused kernel, which will "
            "run slowly; build with strassen=False and report the model",
            signature,
        )


def _vectorize_tile_row(sch, block, vt: int, lanes: int) -> None:
    """Vectorize the innermost loop of a tile (``vt`` columns), in SIMD-register pieces."""
    inner = sch.get_loops(block)[-1]
    if int_extent(sch, inner) == vt and vt > lanes and vt % lanes == 0:
        pieces, inner = sch.split(inner, factors=[None, lanes])
        sch.unroll(pieces)
    try_primitive(sch.vectorize, inner)


def _schedule_block_sums(sch, block, lanes: int) -> None:
    """A stage of block sums ``[p, a, b]`` (A's or B's): parallel over ``a``, the 7 sums unrolled
    (their selection folds), vectorized along ``b``. (Parallel and vectorized with ``p`` a loop,
    the selection between the sums crashed at run time in this TVM.)"""
    p_l, a_l, b_l = sch.get_loops(block)
    sch.reorder(a_l, p_l, b_l)
    sch.parallel(a_l)
    sch.unroll(p_l)
    if int_extent(sch, b_l) % lanes == 0:
        sch.vectorize(sch.split(b_l, factors=[None, lanes])[1])


def _schedule_weight_sums(sch, block, func, lanes: int, prepack: bool) -> None:
    """B's block sums: a compile-time layout-rewrite preproc when B is a constant weight (and
    packing is on), else a run-time stage of block sums."""
    if prepack and sch.get(block).reads[0].source in layout_free_params(func):
        sch.annotate(block, LAYOUT_REWRITE_PREPROC, True)
    else:
        _schedule_block_sums(sch, block, lanes)


def _plain_schedule(func, target, prepack: bool = True):
    """A correct, plainer schedule for a Strassen kernel the rule could not take: the weight sums
    at compile time where the weight is constant, the block sums as above, the products a
    parallel register-tiled GEMM stored whole, every other stage by ``ParallelFallback``'s loop
    nests. (Left to the rules after this one, the block sums were scheduled parallel and
    vectorized with the product index a loop, which crashed at run time in this TVM, and the
    products stayed a serial nest: GPT-2's 3072 -> 768 linear took 147 ms instead of 3.)"""
    sch = s_tir.Schedule(func)
    stages = stage_blocks(sch, STAGE)
    lanes = vector_lanes(target, "float32")
    if "weight" in stages:
        _schedule_weight_sums(sch, stages["weight"], func, lanes, prepack)
    if "input" in stages:
        _schedule_block_sums(sch, stages["input"], lanes)
    if "gemm" in stages:
        try_primitive(_schedule_products, sch, stages["gemm"], lanes)
    for blk in sch.get_child_blocks(sch.get_sblock("root")):
        if sch.get(blk).annotations.get(STAGE) not in ("weight", "input", "gemm"):
            try_primitive(schedule_nest, sch, blk, target)
    return sch


def _schedule_products(sch, gemm, lanes: int) -> None:
    """The 7 products as one parallel GEMM: tiles of 4 rows x 2 vectors (8 accumulators)."""
    p_l, i_l, j_l, r_l = sch.get_loops(gemm)
    rows = max(d for d in (1, 2, 4) if int_extent(sch, i_l) % d == 0)
    vt = next((v for v in (2 * lanes, lanes) if int_extent(sch, j_l) % v == 0), None)
    if vt is None:
        return
    i_o, i_i = sch.split(i_l, factors=[None, rows])
    j_o, j_m, j_v = sch.split(j_l, factors=[None, vt // lanes, lanes])
    sch.reorder(p_l, i_o, j_o, r_l, i_i, j_m, j_v)
    task = sch.fuse(p_l, i_o, j_o)
    sch.parallel(task)
    acc = sch.cache_write(gemm, 0, "local")
    sch.reverse_compute_at(acc, task)
    try_primitive(sch.vectorize, sch.get_loops(acc)[-1])
    sch.unroll(i_i)
    sch.unroll(j_m)
    sch.vectorize(j_v)
    init = sch.decompose_reduction(gemm, r_l)
    try_primitive(sch.vectorize, sch.get_loops(init)[-1])

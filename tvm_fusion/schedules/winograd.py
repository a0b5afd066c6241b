"""CPU schedule for the Winograd conv kernels ``legalize/winograd_conv.py`` writes (+ epilogue).

The stages are found by their ``tvm_fusion.winograd`` block annotations (FuseTIR keeps them):

* ``weight`` (U = G g Gᵀ): when the weight is a constant (``layout_free_buffers``) the block is
  marked a layout-rewrite preproc and written straight into the GEMM's packed panel layout
  ``[e, ν, k / vt, c, vt]``; ``SplitLayoutRewritePreproc`` + ``FoldConstant`` then compute it at
  compile time, so the kernel reads the transformed weight as an argument. Otherwise it runs as a
  parallel stage (correct, slower).
* ``pad`` (polyphase zero padding) and ``input`` (V = Bᵀ d B): root stages; the input transform
  parallel over rows of tiles of a channel, the α² transform points unrolled (their coefficient
  selection folds to constants) and vectorized along the tiles of a row (contiguous loads); for
  F(4), its row pass ``input_rows`` (d B) computed inside each task.
* ``gemm`` (α² GEMMs over input channels): one parallel loop over (image, tile row, tile-column
  block, output-channel block); inside, per transform point, the channel loop around a register
  micro-kernel: ``rt`` tile columns (broadcast V, contiguous in memory) × ``vt`` output channels
  (vector loads of the packed U), accumulators in registers.
* ``output`` (Y = Aᵀ M A) + the fused epilogue (bias, residual, relu, clip, SiLU's ``x * sigmoid(x)``
  and any other elementwise DAG with one result): inlined into one
  block computed right after each task's GEMM tiles (``reverse_compute_at``), so the α² × tile
  intermediate stays in a small per-task buffer, never in memory at full size; output channels
  vectorized, the m×m positions of a tile unrolled (their coefficients fold). A value that feeds
  two blocks (SiLU's ``x``) is a stage of its own, one output row of a tile at a time, so that
  the output transform is not copied into each use (which cost LLVM 15 s per conv).

Tunable decisions (:mod:`.knobs`): ``plan``, the cost model's n-th best micro-kernel (vt, rt);
``order``, channel blocks or tiles outermost in the parallel task loop; ``blocks``, how many
micro-kernel tile blocks one task covers (the weight slice is reused from L1 across them).
"""

from __future__ import annotations

import math

from tvm import tirx
from tvm.target import Target

from ..legalize.winograd_conv import SIGNATURE, STAGE, TILE
from ._util import (
    LAYOUT_REWRITE_PREPROC,
    divisors_upto,
    int_extent,
    layout_free_params,
    logger,
    num_cores,
    num_vector_registers,
    safe_rule,
    schedule_injective_block,
    try_primitive,
    vector_lanes,
)
from .contraction_plan import FMA_IN_FLIGHT, TILE_OVERHEAD_CYCLES
from .knobs import Knobs
from .staged import StagedKernelRule, inline_epilogue, read_index

MAX_ROWS = 8
MAX_PLAN_CHOICES = 12
TASK_TILE_BYTES = 96 << 10  # a task's α² accumulator tiles (written once, read by the output)
MIN_TASKS_PER_CORE = 4
MIN_PADDED_GAIN = 0.9  # GEMM tile columns padded only for a 10 % cheaper micro-kernel (gemm_tile_columns)


_WARNED: set[str] = set()


def _warn_declined(signature: str) -> None:
    """Say so (once per conv shape) when a kernel the Winograd legalization wrote is not one this
    rule can schedule (an epilogue it cannot take, a symbolic size): the next rules compute it
    correctly, but with the weight transform at every call, ~25x slower (EfficientNetV2's SiLU
    epilogue was such a case until the rule took DAG epilogues). Once per process: a second model
    with the same declined conv shape is not reported again."""
    if signature not in _WARNED:
        _WARNED.add(signature)
        logger.warning(
            "Winograd conv %s: the Winograd schedule does not apply to its fused kernel, which will run "
            "slowly; build with conv_algorithms='direct' and report the model",
            signature,
        )


def micro_kernel_plans(channels_out: int, tile_cols: int, tasks_outer: int, target: Target) -> list:
    """``(vt, rt, cost)`` micro-kernels, best first: vt output channels (whole vectors) × rt tile
    columns; cost = cycles per channel step over the FMA-bound minimum, times the cores' load
    imbalance (a model as Contraction's: two FMA pipes, 8 FMAs in flight, broadcasts are loads)."""
    lanes = vector_lanes(target, "float32")
    regs = num_vector_registers(target)
    cores = num_cores(target)
    vts = [mult * lanes for mult in (1, 2, 3, 4) if channels_out % (mult * lanes) == 0]
    if not vts:
        vts = [d for d in divisors_upto(channels_out, lanes) if d >= 2][-1:] or [1]
    plans = []
    for vt in vts:
        nvec = math.ceil(vt / lanes)
        for rt in divisors_upto(tile_cols, MAX_ROWS):
            acc = rt * nvec
            if acc + nvec + 1 > regs:
                continue
            loads = nvec + rt
            cycles = max(acc, loads, FMA_IN_FLIGHT) / 2
            cost = cycles / (acc / 2)
            tasks = tasks_outer * (tile_cols // rt) * (channels_out // vt)
            cost *= math.ceil(tasks / cores) * cores / tasks
            plans.append((vt, rt, round(cost, 3)))
    plans.sort(key=lambda p: (p[2], -p[0] * p[1], -p[1]))
    return plans


def gemm_tile_columns(
    tile_cols: int, max_cols: int, channels_in: int, channels_out: int, tile_rows: int, target: Target
) -> int:
    """How many tile columns per row the GEMM computes: ``tile_cols`` (the real ones), or more, up
    to ``max_cols`` (the input transform's columns, rounded up to whole vectors: computed anyway),
    when a wider micro-kernel row tile then pays for the extra columns. The micro-kernel's ``rt``
    divides the GEMM's columns: 37 tiles (147 pixels in F(4), inception_v3's stem) allowed one
    tile per micro-kernel, and that conv ran 1.3x slower in F(4) than in F(2). Each width is
    priced by its best plan with the per-tile cost ``micro_kernel_plans`` leaves out (the
    reduction is only ``channels_in`` steps long, so a tile's set-up and write-back weigh), times
    the extra columns, and the cheapest taken if ``MIN_PADDED_GAIN`` cheaper than the real
    count. So the choice is the cost model's and depends on the target's vectors and cores: on
    2 AVX-512 cores 37 becomes 40 (5 tiles x 64 channels) and 17 becomes 18, while 14, 9 or 18
    stay (squeezenet's 14 tiles as 15 would be 7 % cheaper: measured the same). The extra columns
    read the zero-padded input and are never read back."""
    lanes = vector_lanes(target, "float32")

    def priced(cols: int) -> float:
        plans = micro_kernel_plans(channels_out, cols, tile_rows, target)
        if not plans:
            return math.inf
        vt, rt, cost = plans[0]
        acc = rt * math.ceil(vt / lanes)
        fma_cycles = channels_in * acc / 2  # the tile's FMAs at peak
        tile_cycles = cost * fma_cycles + TILE_OVERHEAD_CYCLES + acc  # + set-up, a store per accumulator
        return tile_cycles / fma_cycles * cols / tile_cols

    costs = {cols: priced(cols) for cols in range(tile_cols, max(tile_cols, max_cols) + 1)}
    best = min(costs, key=costs.get)
    return best if costs[best] < MIN_PADDED_GAIN * costs[tile_cols] else tile_cols


class Winograd(StagedKernelRule):
    """The Winograd conv schedule (see module docstring); declines anything else."""

    STAGE = STAGE
    SIGNATURE = SIGNATURE

    def declined(self, func, target, signature: str):
        _warn_declined(signature)
        return None

    @safe_rule
    def _schedule(self, sch, stages, func, target, tunable):
        """The schedule of a Winograd kernel (module docstring), or None where it cannot apply."""
        if set(stages) - {"input_rows"} != {"weight", "pad", "input", "gemm", "output"}:
            return None
        knobs = self.last_knobs = Knobs(self.knobs, tunable)
        m = int(sch.get(stages["gemm"]).annotations[TILE])
        gemm = stages["gemm"]
        extents = [int_extent(sch, lp) for lp in sch.get_loops(gemm)]
        if None in extents[:3] + extents[4:]:  # only the batch (loop 3) may be symbolic
            return None
        alpha, _, k_ext, b_ext, ty_ext, tx_ext, _ = extents
        b_ext = b_ext or 1  # a symbolic batch (generic entry): planned as one image, an outer loop
        plans = micro_kernel_plans(k_ext, tx_ext, b_ext * ty_ext, target)
        vt, rt, cost = plans[knobs.choose(sch, "plan", min(len(plans), MAX_PLAN_CHOICES))]
        # tile blocks per task: the transformed-weight slice of one transform point (C x vt)
        # then stays in L1 across them (one block: it streams from L2 for every rt tiles)
        blocks = _blocks_per_task(alpha, k_ext, b_ext * ty_ext, tx_ext, vt, rt, target)
        tb = blocks[knobs.choose(sch, "blocks", len(blocks))]
        logger.debug("Winograd F(%d): vt %d rt %d cost %.2f", m, vt, rt, cost)
        lanes = vector_lanes(target, "float32")

        # ---- the epilogue chain: one block reading M (output transform inlined) -------------
        output = stages["output"]
        inlined = inline_epilogue(sch, output)
        if inlined is None:
            return None
        final, kept = inlined
        # ---- weight transform: compile-time preproc (constant weight) or a parallel stage -----
        weight_blk = stages["weight"]
        weight_param = sch.get(weight_blk).reads[0].source
        u_buf_index = read_index(sch, gemm, sch.get(weight_blk).writes[0].source)
        # U panel [e, nu, k / vt, c, vt]: the micro-kernel's vector loads walk it contiguously
        sch.transform_layout(
            gemm,
            ("read", u_buf_index),
            tirx.IndexMap.from_func(lambda e, nu, c, k: [e, nu, k // vt, c, k % vt], ndim=4),
        )
        # V [e, nu, b, ty, c, tx]: a tile row's channels one after the other, so the micro-kernel's
        # broadcasts (rt tiles of one channel, then the next channel) stream through memory
        sch.transform_layout(
            gemm,
            ("read", 1 - u_buf_index),
            tirx.IndexMap.from_func(lambda e, nu, c, b, ty, tx: [e, nu, b, ty, c, tx], ndim=6),
        )
        if self.prepack and weight_param in layout_free_params(func):
            sch.annotate(weight_blk, LAYOUT_REWRITE_PREPROC, True)
        else:
            schedule_injective_block(sch, weight_blk, target)

        # ---- tasks: the output (+ epilogue) block tiled by (b, tile row, tile-column block,
        # channel block); the GEMM tiles each task reads are computed inside it ---------------
        b_o, k_o, h_o, w_o = sch.get_loops(final)
        k_o, k_i = sch.split(k_o, factors=[None, vt])
        ty, h_i = sch.split(h_o, factors=[None, m])
        tx_o, w_i = sch.split(w_o, factors=[None, tb * rt * m])
        w_t, w_j = sch.split(w_i, factors=[None, m])
        k_v = None
        if vt > lanes and vt % lanes == 0:
            k_i, k_v = sch.split(k_i, factors=[None, lanes])
        # task order: channel blocks outermost (default): the threads' consecutive tasks share one
        # transformed-weight panel (α² x C x vt, up to MBs), which then stays in L2 across them;
        # or tiles outermost: consecutive tasks share the transformed input of their tiles
        outer = [k_o, b_o, ty, tx_o] if knobs.choose(sch, "order", 2) == 0 else [b_o, ty, tx_o, k_o]
        sch.reorder(*outer, *([k_i] if k_v is not None else []), h_i, w_t, w_j, k_v or k_i)
        par = sch.fuse(*outer)
        sch.parallel(par)
        sch.unroll(h_i)
        sch.unroll(w_j)
        try_primitive(sch.vectorize, k_v or k_i)
        for blk in reversed(kept):  # one output row of a tile (m columns x the channel vector) at a time
            sch.compute_at(blk, w_t, preserve_unit_loops=True)
            *_, k_s, _h_s, w_s = sch.get_loops(blk)
            sch.reorder(w_s, k_s)
            sch.unroll(w_s)
            try_primitive(sch.vectorize, k_s)
        sch.compute_at(gemm, par, preserve_unit_loops=True)

        # ---- GEMM under the task: e, nu / c / rt x vt micro-kernel -----------------------------
        g_loops = sch.get_loops(gemm)[1:]
        e_l, nu_l, gk, gb, gty, gtx, rc_l = g_loops
        gtb, gtx = sch.split(gtx, factors=[None, rt])
        sch.reorder(e_l, nu_l, gb, gty, gtb, rc_l, gtx, gk)
        g_m = None
        if vt > lanes and vt % lanes == 0:
            g_m, gk = sch.split(gk, factors=[None, lanes])
            sch.unroll(g_m)
        sch.unroll(gtx)
        sch.vectorize(gk)
        # M tile: [e, nu, b, ty, tx, k] (output channels last: contiguous vector accumulators)
        sch.transform_layout(
            gemm,
            ("write", 0),
            tirx.IndexMap.from_func(lambda e, nu, k, b, ty, tx: [e, nu, b, ty, tx, k], ndim=6),
        )
        sch.set_scope(gemm, 0, "local")
        init = sch.decompose_reduction(gemm, rc_l)
        try_primitive(sch.vectorize, sch.get_loops(init)[-1])

        # ---- input transform and pad: parallel root stages ---------------------------------
        self._schedule_input(sch, stages["input"], stages.get("input_rows"), target)
        schedule_injective_block(sch, stages["pad"], target)
        return sch

    @staticmethod
    def _schedule_input(sch, blk, rows_blk, target):
        """(e, nu, c, b, ty, tx) -> parallel(b, ty, c) / tx vector / e, nu unrolled; a row pass
        (d B, F(4)) computed per task and vector of tiles, into a small buffer that stays in L1.
        Channels innermost in the task order: consecutive tasks write adjacent rows of V
        ([e, nu, b, ty, c, tx]); channel-major, each task's α² stores were C·tiles apart, a
        multiple of 4 KiB once the tiles are whole vectors, all in one L1 set (128->32 14x14
        F(2) with 8 tiles: 0.088 vs 0.068 ms)."""
        e_l, nu_l, c_l, b_l, ty_l, tx_l = sch.get_loops(blk)
        sch.reorder(b_l, ty_l, c_l, tx_l, e_l, nu_l)
        par = sch.fuse(b_l, ty_l, c_l)
        sch.parallel(par)
        sch.unroll(e_l)
        sch.unroll(nu_l)
        lanes = vector_lanes(target, "float32")
        tx_x = int_extent(sch, tx_l)
        cands = [d for d in divisors_upto(tx_x, lanes) if d >= 2]
        # whole 256/512-bit vectors first (24 tiles: 3 x 8 lanes, not 2 x 12 = 8 + 4)
        cands.sort(key=lambda d: (d % 8 == 0, d))
        at = par
        if cands:
            tx_o, tx_i = sch.split(tx_l, factors=[None, cands[-1]])
            sch.reorder(tx_o, e_l, nu_l, tx_i)
            try_primitive(sch.vectorize, tx_i)
            at = tx_o
        if rows_blk is None:
            return
        sch.compute_at(rows_blk, at)
        # the row pass's loops under the task: i, nu and, unless the row is one tile, tx
        outer = [sch.get(lp) for lp in sch.get_loops(blk)]
        depth = next(i for i, lp in enumerate(outer) if lp.same_as(sch.get(at))) + 1
        i_l, n_l, *r_tx = sch.get_loops(rows_blk)[depth:]
        sch.unroll(i_l)
        sch.unroll(n_l)
        for loop in r_tx:
            try_primitive(sch.vectorize, loop)


def _blocks_per_task(alpha, channels_out, rows, tile_cols, vt, rt, target) -> list[int]:
    """Choices of tile blocks (of rt tiles) per task, the model's first: as many as keep the
    task's α² accumulator tiles within ``TASK_TILE_BYTES`` and leave ``MIN_TASKS_PER_CORE`` tasks
    per core; then one block."""
    per_row = tile_cols // rt
    tasks_per_block = rows * (channels_out // vt)
    fits = [
        tb
        for tb in divisors_upto(per_row, per_row)
        if alpha * alpha * tb * rt * vt * 4 <= TASK_TILE_BYTES
        and tasks_per_block * (per_row // tb) >= MIN_TASKS_PER_CORE * num_cores(target)
    ]
    best = fits[-1] if fits else 1
    return [best] + ([1] if best != 1 else [])

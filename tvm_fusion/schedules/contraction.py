"""Register-tiled CPU schedule for one reduction block with injective prologue/epilogue.

Covers what FuseTIR makes of dense / matmul / batch_matmul / conv2d (NCHW, NCHWc, NHWC, depthwise)
/ pooling + bias / activation / residual add. The block is recognised by its iteration structure
(spatial iters S, reduction iters R, one output indexed by S), never by name, so the same rule
handles any layout a layout pass produces.

Schedule (classic CPU GEMM micro-kernel, chosen by a small cost model over the access patterns):

* pick a *vector* spatial iter ``v`` (SIMD lanes) and a *row* spatial iter ``r`` (register rows)
  so that per reduction step the micro-kernel does ``rows x vt/lanes`` FMAs on accumulators held
  in registers, loading as little as possible: operands contiguous along ``v`` are vector loads
  (misaligned ones when the window slides with a reduction iter, as a conv input along W),
  operands invariant along ``v`` are broadcasts; operands strided along ``v`` are gathers (very
  expensive) unless they are layout-free (constant weights), which we pack. The model counts
  cycles per tile (``contraction_plan.rank_plans``); on NCHW convs it puts the lanes on output
  channels (packed weight vectors, broadcast inputs), as NCHWc kernels do; tuning measures its
  runner-up plans;
* loops: ``parallel(fused outer spatial) / reduction loops / unroll(rows) / vectorize(vt)``;
  when one tile's slice of the weight panel (its whole reduction) is larger than half of L1, the
  first reduction loop is cache-blocked: ``parallel(tiles the panel moves with) / chunk / other
  tiles / rest of the reduction / micro-kernel``, so a chunk of the panel stays in L1 across the
  other tiles (``contraction_plan.cache_block_plan``; 14x14x256 3x3 conv: 1.75 -> 1.29 ms, BERT
  FFN GEMMs -5% when they were blocked; where it is worth it: that function's docstring);
* the accumulator tile lives in a ``local`` buffer (laid out ``[.., rows, vt]``), initialised per
  tile (decompose_reduction), and the epilogue is computed right after the tile
  (``reverse_compute_at``), so the intermediate never goes to memory;
* constant weights (``layout_free_buffers``, see ``relax.transform.AttachAttrLayoutFreeBuffers``)
  are packed into ``[outer tiles.., other dims.., row_i, v_i]`` by a cache-read block annotated as a
  layout-rewrite preproc; ``relax.transform.SplitLayoutRewritePreproc`` + ``FoldConstant`` turn that
  into a new constant at compile time;
* injective producers (pad, transpose) stay separate root stages, scheduled parallel+vectorized
  (inlining a pad would put a branch in the micro-kernel; inlining a transpose would make the
  operand strided again); a small conv's pad is instead computed inside each parallel task, for
  the rows that task reads, the task running all output-channel tiles of its rows
  (``_task_local_plan``: one fork-join less, ~1.5 us on these machines, and the rows stay in L1);
* reduction prologues (the policy's ``layer_norm -> matmul``, or a user's ``softmax -> matmul``):
  when the only other reduction blocks are row reductions that feed the contraction's inputs,
  the materialized input and its reductions become one root stage (``row_stage``), parallel
  over rows (every block of a row computed under the row loop, sums vectorized by an rfactor over
  SIMD lanes), and the GEMM gets the micro-kernel as usual. Two contractions in one PrimFunc
  (attention) decline.
"""

from __future__ import annotations

import dataclasses
import math

import tvm
from tvm import tirx
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.target import Target

from . import contraction_plan  # its constants read at call time: a tweak there reaches this rule too
from ._util import (
    LAYOUT_REWRITE_PREPROC,
    CpuRule,
    access_class,
    bare_var_dim,
    divisors_upto,
    get_sblock_realize,
    int_extent,
    is_one,
    layout_free_params,
    logger,
    num_cores,
    operand_reads,
    reachable_blocks,
    reverse_compute_within,
    safe_rule,
    schedule_injective_block,
    try_primitive,
    uses_var,
    vector_lanes,
)
from .contraction_plan import (
    L1_BYTES,
    MAX_ROWS,
    cache_block_plan,
    charge_blocked_imbalance,
    imbalance,
    out_dim_of,
    outer_tile_vars,
    padded_weights,
    rank_plans,
    single_threaded,
    tile_counts,
    tile_slots,
)
from .knobs import Knobs
from .plane import flatten_plane, inline_plain_copies, piece_bounds
from .row_stage import reads_varying_with_reduction, schedule_leftover_stage, schedule_row_prologue

WHOLE_VECTOR_EPILOGUE = True  # a tile's epilogue vectorizes a whole-vector loop (_schedule_tile_epilogue)
MAX_PLAN_CHOICES = 32  # micro-kernel plans the tuner may pick from (the model's best first)
MAX_EPILOGUE_UNROLL = 64  # copies of an epilogue body per tile (64 = 4 vectors x 16 rows, the largest tile)
SHORT_TILE_FMAS = 1024  # below: accumulate in the global intermediate (see apply)
RAGGED_GLOBAL_ACC = True  # a ragged row tile accumulates in the intermediate (see apply)
MAX_PIECE_COPIES = 32  # unrolled copies of a reduction loop over a fused concat's pieces
CACHE_BLOCKING = True  # the reduction cache-blocked where the plan module says so (cache_block_plan)
BLOCKED_TASK_BALANCE = True  # plans re-ranked by their blocked tasks' balance (charge_blocked_imbalance)
# A conv's padded input computed inside each parallel task, for the rows that task reads, instead
# of as a parallel stage of its own: one fork-join less (~1.5 us here) and the rows stay in L1
# (the ResNet-style example's 16-channel 32x32 3x3 conv: 28 -> 24.5 us). The tasks then run every
# output-channel tile of their rows, so each reads the whole weight: only for weights that stay in
# L1 from task to task (AlexNet's 11x11 stem, 93 KiB, ran 0.70 -> 0.78 ms from L2).
TASK_LOCAL_INPUTS = True
TASK_LOCAL_WEIGHT_BYTES = L1_BYTES
MAX_COPY_VECTOR = 64  # a copied row up to this many elements is one vectorized loop


class Contraction(CpuRule):
    """Register-tiled, parallel, vectorized schedule for a single reduction block + epilogue.

    Its decisions are tunable (:mod:`.knobs`): ``plan`` (the cost model's n-th best micro-kernel:
    vector and row iters, their tiles; at most ``MAX_PLAN_CHOICES``), ``block`` (the model's cache
    blocking of the reduction, none, or a chunk for half / twice the L1 budget), ``inputs`` (a small
    conv's pad inside each task or a stage of its own) and ``acc`` (accumulator tile in a local
    buffer or in the intermediate). ``knobs`` forces decisions
    (``{"plan": 2}``); the tuner searches them, since the model is a guess. ``last_knobs`` holds the
    decisions of the last ``apply`` (how many choices each had).
    """

    def __init__(self, prepack: bool = True, max_rows: int = MAX_ROWS, knobs: dict[str, int] | None = None):
        self.prepack = prepack
        self.max_rows = max_rows
        self.knobs = dict(knobs or {})
        self.last_knobs: Knobs | None = None

    @safe_rule
    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool):
        opened = self.normalized(func, target)
        if opened is None:
            return None
        sch, infos = opened
        knobs = self.last_knobs = Knobs(self.knobs, tunable)
        found = _main_block(sch, infos)
        if found is None:
            return None
        main_info, n_reductions = found
        layout_free = layout_free_params(func) if self.prepack else set()
        plan = self._choose_plan(sch, knobs, main_info, layout_free, target)
        if plan is None:
            return None
        padded = {}  # the constant weights pad_einsum padded: their copies become the packing
        if plan[0].dom % plan[1]:
            main_info, plan, padded = _pad_to_whole_vectors(sch, main_info, plan, layout_free)
        main = main_info.block_rv
        planned = sch.get(main)  # the block as planned: its operands before packing
        self._inline_around(sch, main)
        if self.prepack:  # before tiling: the index map is written on block vars
            self._pack_weights(sch, main, layout_free, *plan, padded)
        tiling = _tile(sch, knobs, main_info, planned, plan, layout_free, target)
        acc_consumer = _place_accumulator(sch, knobs, func, main_info, planned, plan, tiling)
        init = _finish_micro_kernel(sch, main, tiling)
        if tiling.blocking is None:
            self._schedule_tile_epilogue(
                sch, acc_consumer, target, sch.get(main).writes[0].source, tiling.fused
            )
        else:  # the epilogue covers the task's whole region: vectorized, not unrolled
            schedule_injective_block(sch, acc_consumer, target, parallel=False)

        handled = {sch.get(b).name_hint for b in (main, init, acc_consumer)}
        for name in tiling.task_producers:
            _compute_in_task(sch, sch.get_sblock(name), tiling.task_loop)
            handled.add(name)
        _schedule_root_stages(sch, main, n_reductions > 1, handled, target)
        return sch

    def _choose_plan(self, sch, knobs, main_info, layout_free, target):
        """``(vector iter, vector tile, row iter, row tile)``: the cost model's ranked plans, the
        ``plan`` knob picking among them (the best first); None when there is none."""
        stmt = sch.get(main_info.block_rv)
        out_buf, reads = stmt.writes[0].source, operand_reads(stmt)
        plans = rank_plans(main_info, stmt, reads, layout_free, target, str(out_buf.dtype), self.max_rows)
        if not plans:
            return None
        if CACHE_BLOCKING and BLOCKED_TASK_BALANCE:
            plans = charge_blocked_imbalance(plans, main_info, reads, layout_free, target)
        v_it, vt, row_it, rt, cost = plans[knobs.choose(sch, "plan", min(len(plans), MAX_PLAN_CHOICES))]
        logger.debug(
            "Contraction %s: vector %s/%d row %s/%d cost %.2f",
            stmt.name_hint,
            v_it.var,
            vt,
            None if row_it is None else row_it.var,
            rt,
            cost,
        )
        return v_it, vt, row_it, rt

    # ------------------------------------------------------------------------------------------

    @staticmethod
    def _inline_around(sch, main):
        """compute_inline every injective block except main's direct producers, to a fixpoint."""
        main_name = sch.get(main).name_hint
        changed = True
        while changed:
            changed = False
            root = sch.get_sblock("root") if _has_root(sch) else None
            if root is None:
                return
            for blk in sch.get_child_blocks(root):
                st = sch.get(blk)
                if st.name_hint == main_name:
                    continue
                if not all(it.iter_type == tirx.IterVar.DataPar for it in st.iter_vars):
                    continue
                cons = [sch.get(c).name_hint for c in sch.get_consumers(blk)]
                if main_name in cons:
                    continue
                if try_primitive(sch.compute_inline, blk):
                    changed = True
                    break

    @staticmethod
    def _pack_weights(sch, main, layout_free, v_it, vt, row_it, rt, padded=None):
        """Pack each constant weight into the micro-kernel's access order by a cache-read block
        annotated as a layout-rewrite preproc; a weight ``pad_einsum`` padded (``padded``: its
        padded copy -> the copying block) is packed by that block itself, padding included."""
        padded = padded or {}
        stmt = sch.get(main)
        out_buf = stmt.writes[0].source
        reads = list(stmt.reads)
        for idx, region in enumerate(reads):
            buf = region.source
            pad_block = padded.get(buf)
            if buf.same_as(out_buf) or (buf not in layout_free and pad_block is None):
                continue
            # dims of this buffer indexed exactly by the vector / row iter, blocked by their tile
            blocked = []  # (dim, tile, is_vector)
            for which, it, tile in ((0, v_it, vt), (1, row_it, rt)):
                if it is None or tile <= 1:
                    continue
                d = bare_var_dim(region, it.var)
                if d is None or int(buf.shape[d]) != it.dom or it.dom % tile != 0:
                    continue
                blocked.append((d, tile, which))
            if not blocked or (
                len(blocked) == 1
                and blocked[0][0] == len(buf.shape) - 1
                and int(buf.shape[-1]) == blocked[0][1]
            ):
                if pad_block is not None:  # no packing to gain, but the padding folds all the same
                    sch.annotate(pad_block, LAYOUT_REWRITE_PREPROC, True)
                continue  # nothing to gain
            ndim = len(buf.shape)
            vec = [b for b in blocked if b[2] == 0]
            row = [b for b in blocked if b[2] == 1]
            # outer tile dims in loop order (vector tile's outer loop first), then the other dims,
            # then the row and vector inner dims (the micro-kernel's access order)
            outer_order = vec + row
            blocked_dims = {b[0] for b in blocked}

            index_map = _make_pack_map(outer_order, blocked_dims, row, vec, ndim)
            cached = pad_block if pad_block is not None else sch.cache_read(main, idx, "global")
            sch.transform_layout(
                main,
                ("read", idx),
                tirx.IndexMap.from_func(index_map, ndim=ndim, index_dtype=_idx_dtype(stmt)),
            )
            sch.annotate(cached, LAYOUT_REWRITE_PREPROC, True)

    @staticmethod
    def _schedule_tile_epilogue(sch, block, target, acc, tile_loop):
        """Vectorize the tile's epilogue (its loops inside ``tile_loop``) and unroll its outer loops,
        at most ``MAX_EPILOGUE_UNROLL`` copies of the body (a tile's worth of vectors: more only
        makes LLVM slow, as a broadcast epilogue over a whole plane did, ~1,800 copies). The
        vectorized loop is one without the ragged tile's bounds check, and, when the innermost one
        is not a whole vector, the loop along the accumulator tile ``acc``'s vector dim (its last)."""
        loops = sch.get_loops(block)
        tile = [sch.get(lp).same_as(sch.get(tile_loop)) for lp in loops]
        loops = loops[tile.index(True) + 1 :] if any(tile) else loops[1:]
        exts = [int_extent(sch, lp) for lp in loops]
        nontrivial = [(lp, e) for lp, e in zip(loops, exts) if e is not None and e > 1]
        if not nontrivial:
            return
        inner, ext = nontrivial[-1]
        # A ragged row tile's bounds check on the innermost loop would make its vectorized loop
        # scalar (a transposing NCHW conv epilogue over a 111-wide plane in tiles of 8: one
        # scalar load, max and store per element); vectorize a loop the check leaves alone.
        predicate = get_sblock_realize(sch, block).predicate
        if uses_var(predicate, sch.get(inner).loop_var):
            free = [
                i
                for i, (lp, e) in enumerate(nontrivial[:-1])
                if e >= 4 and not uses_var(predicate, sch.get(lp).loop_var)
            ]
            if free:
                nontrivial = _move_innermost(sch, nontrivial, free[-1])
                inner, ext = nontrivial[-1]
        lanes = vector_lanes(target)
        if ext % lanes and WHOLE_VECTOR_EPILOGUE:
            # a transposed tile (channel lanes, 7 plane rows of NCHW): vectorized along the 7 rows
            # every store gathers one lane from each of 7 accumulator rows, and LLVM spills the tile
            # (64->384 1x1 conv at 14x14: 2-3x slower, bimodal); along the channels the tile is
            # read as the micro-kernel wrote it and stored with a stride (the plan model's scatter)
            acc_vector = _acc_vector_binding(sch, block, acc)
            whole = [
                i
                for i, (lp, e) in enumerate(nontrivial[:-1])
                if e % lanes == 0
                and acc_vector is not None
                and uses_var(acc_vector, sch.get(lp).loop_var)
                and not uses_var(predicate, sch.get(lp).loop_var)
            ]
            if whole:
                nontrivial = _move_innermost(sch, nontrivial, whole[-1])
                inner, ext = nontrivial[-1]
        outer = [lp for lp, _ in nontrivial[:-1]]
        if ext % lanes == 0:
            # one SIMD register per vector op, as the micro-kernel wrote the tile: a wider read
            # of a 16-lane-written tile (<48 x float>) makes LLVM spill the whole tile once it
            # is an alloca (StackAllocateLoopBuffers: 621 spills, a K=384 GEMM 7x slower)
            width = lanes if ext > lanes else None
        elif ext <= 4 * lanes:
            width = None  # one vector of the whole (ragged) extent
        else:
            width = max([d for d in divisors_upto(ext, lanes) if d >= 4] or [1])
        if width is None:
            try_primitive(sch.vectorize, inner)
        elif width > 1:
            inner_o, inner = sch.split(inner, factors=[None, width])
            try_primitive(sch.vectorize, inner)
            outer.append(inner_o)
        copies = 1
        for lp in reversed(outer):  # innermost first: they hold the tile's registers
            copies *= int_extent(sch, lp) or MAX_EPILOGUE_UNROLL + 1
            if copies > MAX_EPILOGUE_UNROLL:
                break
            try_primitive(sch.unroll, lp)


def _main_block(sch, infos):
    """``(contraction's block info, number of reduction blocks)``, or None when the function is
    not one contraction with an injective prologue / epilogue (or a row-reduction prologue)."""
    reductions = [b for b in infos if not b.is_injective()]
    # pointwise convs: inline the input copy (and a concat in front), then GEMM over the
    # flattened H*W plane (plane.py)
    if len(reductions) == 1 and inline_plain_copies(sch, reductions[0].block_rv, MAX_PIECE_COPIES):
        reductions = [b for b in normalize_prim_func(sch) if not b.is_injective()]
    if len(reductions) == 1 and flatten_plane(sch, reductions[0]):
        reductions = [b for b in normalize_prim_func(sch) if not b.is_injective()]
    if len(reductions) == 1:
        main_info = reductions[0]
    else:
        # layer_norm / rms_norm / softmax fused in front of a GEMM: the row reductions become their
        # own parallel stage (see schedule_row_prologue), the GEMM gets the micro-kernel
        main_info = _prologue_contraction(sch, reductions)
        if main_info is None:
            return None
    kinds = main_info.dom_kind()
    if set(kinds) - {"S", "R"} or "R" not in kinds or "S" not in kinds:
        return None
    if any(not isinstance(it.dom, int) for it in main_info.iters if it.kind == "R"):
        return None  # a symbolic reduction goes to the fallback
    # symbolic spatial iters (a dynamic batch / sequence length) stay outer loops of the
    # tile: the micro-kernel's vector and row iters are chosen among the static ones
    stmt = sch.get(main_info.block_rv)
    if stmt.init is None or len(stmt.writes) != 1 or not operand_reads(stmt):
        return None
    return main_info, len(reductions)


def _pad_to_whole_vectors(sch, main_info, plan, layout_free):
    """``pad_einsum`` the vector iter to whole vector tiles (see ``contraction_plan.rank_plans``):
    the block info and the plan on its new iters, and the constant weights it padded (padded copy
    -> copying block: their copies become the packing)."""
    v_it, vt, row_it, rt = plan
    main = main_info.block_rv
    name = sch.get(main).name_hint
    v_pos = main_info.iters.index(v_it)
    row_pos = None if row_it is None else main_info.iters.index(row_it)
    sch.pad_einsum(main, [vt if i == v_pos else 1 for i in range(len(main_info.iters))])
    main_info = next(b for b in normalize_prim_func(sch) if b.name == name)
    plan = (main_info.iters[v_pos], vt, None if row_pos is None else main_info.iters[row_pos], rt)
    return main_info, plan, padded_weights(sch, main_info.block_rv, layout_free)


@dataclasses.dataclass(frozen=True)
class _Tiling:
    """The loops ``_tile`` made around the micro-kernel."""

    fused: object  # the loop over tiles (parallel unless small): accumulators and epilogue live in it
    init_at: object  # the loop the accumulator init goes in front of
    row_i: object | None  # the register rows (unrolled)
    v_m: object | None  # one SIMD register each, when the vector tile is wider (unrolled)
    v_i: object  # the SIMD lanes (vectorized)
    piece_loops: tuple  # over a fused concat's pieces (unrolled)
    lanes: int  # SIMD lanes of the output dtype
    blocking: tuple[int, int] | None  # (parallel loops, reduction chunk) when cache-blocked
    task_loop: object | None  # the parallel task loop that computes a small conv's pads
    task_producers: tuple[str, ...]  # those pads


def _tile(sch, knobs, main_info, planned, plan, layout_free, target) -> _Tiling:
    """Split the vector and row iters into the micro-kernel's tile and order the loops: outer
    tiles (fused, parallel), reduction, rows, vectors. The reduction is cache-blocked where the
    plan model says so (knob ``block``), else a small conv's pads may be computed in each task
    (knob ``inputs``)."""
    v_it, vt, row_it, rt = plan
    small = single_threaded([int_extent(sch, it.loop_rv) for it in main_info.iters])
    s_iters = [it for it in main_info.iters if it.kind == "S"]
    r_loops, piece_loops, piece_step = _split_at_pieces(sch, main_info)
    v_o, v_i = sch.split(v_it.loop_rv, factors=[None, vt])
    row_o = row_i = None
    if row_it is not None:
        row_o, row_i = sch.split(row_it.loop_rv, factors=[None, rt])
    # spatial outer loops in original order, with the vector tile's outer loop taking the first
    # of the two slots: the weight panel of one vector tile is then reused across all rows.
    slots = tile_slots(main_info, v_it, row_it)
    outer = []
    for i, it in enumerate(s_iters):
        if i in slots:
            outer.append(v_o if i == slots[0] else row_o)
        else:
            outer.append(it.loop_rv)
    out_buf, reads = planned.writes[0].source, operand_reads(planned)
    lanes = vector_lanes(target, str(out_buf.dtype))
    v_m = None
    if vt > lanes and vt % lanes == 0:
        # one SIMD register per vector op: LLVM turns wider (e.g. <24 x float>) accumulators
        # into shuffles and spills
        v_m, v_i = sch.split(v_i, factors=[None, lanes])
    inner = ([row_i] if row_i is not None else []) + ([v_m] if v_m is not None else []) + [v_i]
    blocking = None
    if CACHE_BLOCKING and not small:
        options = _blocking_options(main_info, reads, layout_free, v_it, vt, row_it, rt, slots, target)
        blocking = options[knobs.choose(sch, "block", len(options))]
        if blocking is not None and piece_step is not None and piece_step % blocking[1]:
            # chunks must not straddle the pieces: the largest divisor of their step below it
            chunk = divisors_upto(piece_step, blocking[1])[-1]
            blocking = (blocking[0], chunk) if chunk >= contraction_plan.MIN_CHUNK_STEPS else None
    task_local = None
    if blocking is None and not small:
        task_local = _task_local_plan(sch, main_info, planned, v_it, row_it, rt, vt, slots, target)
        if task_local is not None and knobs.choose(sch, "inputs", 2):
            task_local = None
    task_loop, producers = None, ()
    if task_local is not None:
        producers, n_par, order = task_local
        ordered = [outer[i] for i in order]
        sch.reorder(*ordered, *r_loops, *inner)
        task_loop = sch.fuse(*ordered[:n_par]) if n_par > 1 else ordered[0]
        rest = ordered[n_par:]
        fused = sch.fuse(*rest) if len(rest) > 1 else rest[0]
        init_at = r_loops[0]
        sch.parallel(task_loop)
    elif blocking is None:
        sch.reorder(*outer, *r_loops, *inner)
        fused = sch.fuse(*outer)
        init_at = r_loops[0]
    else:
        n_par, chunk = blocking
        logger.debug("Contraction %s: %d parallel loops, reduction chunk %d", planned.name_hint, n_par, chunk)
        # (the loop over a fused concat's pieces, if any, outside the chunks)
        pieces = r_loops[:1] if piece_step is not None else []
        first, rest = r_loops[len(pieces)], r_loops[len(pieces) + 1 :]
        k_o, k_i = sch.split(first, factors=[None, chunk])
        sch.reorder(*outer[:n_par], *pieces, k_o, *outer[n_par:], k_i, *rest, *inner)
        fused = sch.fuse(*outer[:n_par]) if n_par > 1 else outer[0]
        init_at = pieces[0] if pieces else k_o
    fused_extent = int_extent(sch, fused)
    if task_loop is None and (fused_extent is None or fused_extent > 1) and not small:
        sch.parallel(fused)
    return _Tiling(
        fused, init_at, row_i, v_m, v_i, tuple(piece_loops), lanes, blocking, task_loop, tuple(producers)
    )


def _place_accumulator(sch, knobs, func, main_info, planned, plan, tiling: _Tiling):
    """Keep the accumulator tile in registers with the epilogue right after the tile (knob
    ``acc``: a local tile or the intermediate), laid out ``[.., rows, vt]``; the block that
    consumes the accumulators (the epilogue, else a write-back)."""
    v_it, vt, row_it, rt = plan
    main = main_info.block_rv
    consumers = sch.get_consumers(main)
    epilogue = None
    if len(consumers) == 1 and not _writes_param(sch, main, func) and not _expands(sch, main, consumers[0]):
        epilogue = consumers[0]
        if not reverse_compute_within(sch, epilogue, main, tiling.fused):
            epilogue = None
    if tiling.blocking is not None:
        acc_scope = "global"  # the whole task's accumulators, persisting across chunks
    else:
        acc_scope = _accumulator_scopes(main_info, row_it, rt, vt, tiling.lanes)[knobs.choose(sch, "acc", 2)]
    if epilogue is not None:
        if acc_scope == "local":
            sch.set_scope(main, 0, "local")
        acc_consumer = epilogue
    else:
        acc_consumer = sch.cache_write(main, 0, acc_scope)
        sch.reverse_compute_at(acc_consumer, tiling.fused)
    # accumulator layout [.., rows, vt]: v's output dim last, so the micro-kernel's
    # vectorized accesses to it are contiguous (and LLVM keeps it in registers)
    v_dim = out_dim_of(planned.writes[0], v_it.var)
    ndim = len(planned.writes[0].region)
    if v_dim is not None and v_dim != ndim - 1:
        perm = [d for d in range(ndim) if d != v_dim] + [v_dim]
        sch.transform_layout(
            main,
            ("write", 0),
            tirx.IndexMap.from_func(
                lambda *i: [i[d] for d in perm], ndim=ndim, index_dtype=_idx_dtype(planned)
            ),
        )
    return acc_consumer


def _finish_micro_kernel(sch, main, tiling: _Tiling):
    """Unroll the register rows, the vectors and a concat's pieces, vectorize the lanes and split
    off the accumulator init (vectorized); the init block."""
    for loop in (tiling.row_i, tiling.v_m, *tiling.piece_loops):
        if loop is not None:
            sch.unroll(loop)
    sch.vectorize(tiling.v_i)
    init = sch.decompose_reduction(main, tiling.init_at)
    try_primitive(sch.vectorize, sch.get_loops(init)[-1])
    return init


def _blocking_options(main_info, reads, layout_free, v_it, vt, row_it, rt, slots, target) -> list:
    """The ``block`` knob's choices: the model's cache blocking of the reduction at the default
    panel budget (first: the untuned choice), none, then at half and twice the budget; each
    distinct choice once."""
    panel = contraction_plan.PANEL_BYTES
    options = []
    for budget in (panel, 0, panel // 2, panel * 2):
        option = (
            cache_block_plan(main_info, reads, layout_free, v_it, vt, row_it, rt, slots, target, budget)
            if budget
            else None
        )
        if option not in options:
            options.append(option)
    return options


def _accumulator_scopes(main_info, row_it, rt: int, vt: int, lanes: int) -> list[str]:
    """The ``acc`` knob's choices for an unblocked tile, the untuned one first.

    This TVM allocates every "local" buffer through TVMBackendAllocWorkspace (no stack alloca),
    once per tile. For long reductions that is noise and the "local" tile is the best register
    tile (LLVM promotes it); for short ones (depthwise 3x3, 1x1 convs with few input channels) the
    allocation costs more than the tile's FMAs, so the accumulator stays in the (compacted)
    global intermediate and LLVM keeps it in registers via LICM. A ragged last tile puts its
    bounds check on every accumulator update, and LLVM then keeps a "local" tile in memory
    (squeezenet's 128->16 1x1 conv over 55x55 in tiles of 8: 2.2x slower than accumulating in the
    intermediate), so it counts as short."""
    r_total = math.prod(it.dom for it in main_info.iters if it.kind == "R")
    tile_fmas = rt * math.ceil(vt / lanes) * r_total
    ragged = RAGGED_GLOBAL_ACC and row_it is not None and row_it.dom % rt != 0
    short = tile_fmas < SHORT_TILE_FMAS or ragged
    return ["global", "local"] if short else ["local", "global"]


def _schedule_root_stages(sch, main, has_prologue: bool, handled: set, target) -> None:
    """The stages at root that the micro-kernel's steps did not take (``handled``): the row
    prologue (layer_norm / rms_norm / softmax rows feeding the GEMM) when there is one, then pads,
    transposes and unfusable leftovers; packing blocks are left for the layout-rewrite pass."""
    handled = set(handled)
    if has_prologue:
        for prod in sch.get_producers(main):
            if sch.get(prod).annotations.get(LAYOUT_REWRITE_PREPROC) is not None:
                continue
            handled |= schedule_row_prologue(sch, prod, target)
    root = sch.get_sblock("root") if _has_root(sch) else None
    for blk in sch.get_child_blocks(root) if root is not None else []:
        name = sch.get(blk).name_hint
        if name in handled or sch.get(blk).annotations.get(LAYOUT_REWRITE_PREPROC) is not None:
            continue
        schedule_leftover_stage(sch, blk, target)


def _split_at_pieces(sch, main_info) -> tuple[list, list, int | None]:
    """The reduction loops, the loops over the pieces of a concat fused in front, and the step
    of the first reduction iter's pieces (None where that iter is not split).

    An inlined concat (``plane.inline_plain_copies``) reads its pieces through an
    ``if_then_else`` on the reduction index: a branch on every load of the micro-kernel, and
    LLVM then keeps the accumulators in memory (SqueezeNet's 512 -> 1000 conv, its two 256-channel
    pieces read in place: 1.83 ms, against 0.83 with the pieces apart). A reduction iter whose
    pieces start at multiples of ``g`` (the gcd of the bounds) is split into ``K / g`` steps of
    ``g``; unrolled, each copy of the ``g``-loop lies in one piece, and lowering folds its
    condition away. Only up to ``MAX_PIECE_COPIES`` copies (code size). The caller keeps cache
    blocking's chunks inside one piece (a divisor of the first iter's step).
    """
    r_loops, piece_loops, first_step = [], [], None
    block = sch.get(main_info.block_rv)
    for it in main_info.iters:
        if it.kind != "R":
            continue
        bounds = [b for b in piece_bounds(block, it.var) if isinstance(it.dom, int) and 0 < b < it.dom]
        step = math.gcd(it.dom, *bounds) if bounds else it.dom
        if bounds and it.dom // step <= MAX_PIECE_COPIES:
            piece, rest = sch.split(it.loop_rv, factors=[it.dom // step, step])
            if not r_loops:
                first_step = step
            r_loops += [piece, rest]
            piece_loops.append(piece)
        else:
            r_loops.append(it.loop_rv)
    return r_loops, piece_loops, first_step


def _move_innermost(sch, loops, i):
    """Reorder so that ``loops[i]`` (a ``(loop, extent)``) runs innermost, the loops after it keeping
    their order; the new order, or ``loops`` unchanged when the reorder is not valid."""
    moved, after = loops[i], loops[i + 1 :]
    if try_primitive(sch.reorder, *[lp for lp, _ in after], moved[0]):
        return loops[:i] + after + [moved]
    return loops


def _acc_vector_binding(sch, block, acc):
    """The loop expression ``block`` indexes the last dim of buffer ``acc`` with (the micro-kernel's
    vector dim, see apply), or None when it does not read ``acc`` by a plain block var."""
    stmt = sch.get(block)
    read = next((r for r in stmt.reads if r.source.same_as(acc)), None)
    if read is None:
        return None
    last = read.region[-1].min
    realize = get_sblock_realize(sch, block)
    return next((v for iv, v in zip(stmt.iter_vars, realize.iter_values) if last.same_as(iv.var)), None)


def _task_local_plan(sch, main_info, stmt, v_it, row_it, rt, vt, slots, target):
    """``(producer names, n_par, order)`` when the conv's padded inputs may be computed inside each
    parallel task (see ``TASK_LOCAL_INPUTS``), else None. Eligible: spatial root stages that read
    only kernel inputs and feed only the conv, write their own point, and that the conv reads
    through a sliding window (an index mixing an output and a reduction iter: a pad, not a
    GEMM's padded operand). ``order`` permutes the outer tile loops so that those the copies'
    reads depend on come first (``n_par`` of them, fused into the parallel task loop) and the ones
    they do not (output-channel tiles) run inside each task."""
    if not TASK_LOCAL_INPUTS:
        return None
    main = main_info.block_rv
    producers = []
    for prod in sch.get_producers(main):
        block = sch.get(prod)
        if block.annotations.get(LAYOUT_REWRITE_PREPROC) is not None:
            continue
        spatial = all(iv.iter_type == tirx.IterVar.DataPar for iv in block.iter_vars)
        only_main = [sch.get(c).name_hint for c in sch.get_consumers(prod)] == [stmt.name_hint]
        if not (spatial and only_main and _writes_own_point(block)) or sch.get_producers(prod):
            return None  # not a plain copy of a kernel input (a layer_norm prologue, say)
        producers.append(block)
    copied = {b.writes[0].source for b in producers}
    reads = [r for r in stmt.reads if r.source in copied]
    if not reads or len(copied) != len(producers):
        return None
    if not all(_is_affine(rng.min) and is_one(rng.extent) for r in reads for rng in r.region):
        return None
    s_iters = [it for it in main_info.iters if it.kind == "S"]
    if not all(isinstance(it.dom, int) for it in s_iters):
        return None
    s_vars = [it.var for it in s_iters]
    r_vars = [it.var for it in main_info.iters if it.kind == "R"]
    if not any(
        any(uses_var(rng.min, v) for v in s_vars) and any(uses_var(rng.min, v) for v in r_vars)
        for r in reads
        for rng in r.region
    ):
        return None  # no sliding window
    # every other operand (the weight, packed or not) is streamed whole by each task
    out_buf = stmt.writes[0].source
    others = [r.source for r in stmt.reads if r.source not in copied and not r.source.same_as(out_buf)]
    if any(not all(isinstance(d, tirx.IntImm) for d in b.shape) for b in others):
        return None
    weight_bytes = sum(
        math.prod(int(d) for d in b.shape) * tvm.DataType(str(b.dtype)).bits // 8 for b in others
    )
    if weight_bytes > TASK_LOCAL_WEIGHT_BYTES:
        return None
    outer_vars = outer_tile_vars(main_info, v_it, row_it, slots)
    dependent = [any(access_class(r, var) != "invariant" for r in reads) for var in outer_vars]
    order = [i for i, d in enumerate(dependent) if d] + [i for i, d in enumerate(dependent) if not d]
    n_par = sum(dependent)
    exts = tile_counts(main_info, v_it, vt, row_it, rt, slots)
    if n_par == 0 or n_par == len(order):
        return None  # nothing to move into the tasks (or every tile its own task: no saving)
    if (
        imbalance(math.prod(exts[i] for i in order[:n_par]), num_cores(target))
        > contraction_plan.MAX_IMBALANCE
    ):
        return None
    return [b.name_hint for b in producers], n_par, order


def _writes_own_point(block) -> bool:
    """Whether ``block`` writes the point its iter vars name, each index a distinct bare var (a
    pad's ``[v0, v1, v2]``). ``compute_at`` infers the region a task needs through that map; for a
    flattened write (``[v1 * 28 + v2]``, plane.py's strided subsample) it inferred a box that
    missed part of a tile spanning two rows (wrong results, seen on ResNet-18's downsample)."""
    if len(block.writes) != 1:
        return False
    own = [iv.var for iv in block.iter_vars]
    named = []  # which iter var each non-constant index is
    for rng in block.writes[0].region:
        if isinstance(rng.min, tirx.IntImm) and is_one(rng.extent):
            continue
        hits = [k for k, var in enumerate(own) if rng.min.same_as(var)]
        if not hits:
            return False
        named.append(hits[0])
    return len(set(named)) == len(named)


def _is_affine(expr) -> bool:
    """Whether ``expr`` is a sum of vars times constants plus a constant (no division, no modulo)."""
    if isinstance(expr, tirx.Var | tirx.IntImm):
        return True
    if isinstance(expr, tirx.Add | tirx.Sub):
        return _is_affine(expr.a) and _is_affine(expr.b)
    if isinstance(expr, tirx.Mul):
        return (isinstance(expr.a, tirx.IntImm) and _is_affine(expr.b)) or (
            isinstance(expr.b, tirx.IntImm) and _is_affine(expr.a)
        )
    return False


def _compute_in_task(sch, block, task_loop) -> None:
    """The copy stage ``block`` computed per task (``compute_at`` the task loop: its buffer is then
    allocated per task), its innermost loop vectorized whole (LLVM splits an odd extent: a padded
    row of 34 is 2 x 16 + 2 with AVX-512, 4 x 8 + 2 with AVX2)."""
    sch.compute_at(block, task_loop)
    inner = sch.get_loops(block)[-1]
    ext = int_extent(sch, inner)
    if ext is not None and 1 < ext <= MAX_COPY_VECTOR and not sch.get(inner).same_as(sch.get(task_loop)):
        try_primitive(sch.vectorize, inner)


def _prologue_contraction(sch, reductions):
    """The one contraction among several reduction blocks, if every other reduction is a row
    reduction (one operand moving along its reduction axes: sum / max / variance) that only feeds
    the contraction's inputs (layer_norm or rms_norm -> GEMM, softmax -> GEMM). Otherwise None.

    Two contractions (attention's QK^T -> softmax -> PV) are declined: the row stage would run
    the first GEMM scalar."""
    contractions = [b for b in reductions if len(reads_varying_with_reduction(sch.get(b.block_rv))) >= 2]
    if len(contractions) != 1:
        return None
    main_info = contractions[0]
    up = {sch.get(b).name_hint for b in reachable_blocks(sch, main_info.block_rv, sch.get_producers)}
    for info in reductions:
        if info is main_info:
            continue
        stmt = sch.get(info.block_rv)
        if stmt.name_hint not in up or len(reads_varying_with_reduction(stmt)) != 1:
            return None
        kinds = info.dom_kind()
        if not kinds.startswith("S") or "S" in kinds.lstrip("S"):
            return None  # rows (leading spatial) then reduction axes only
        if any(not isinstance(d, int) for d in info.dom()):
            return None
    return main_info


def _make_pack_map(outer_order, blocked_dims, row, vec, ndim):
    def index_map(*ix):
        res = [ix[d] // t for d, t, _ in outer_order]
        res += [ix[d] for d in range(ndim) if d not in blocked_dims]
        res += [ix[d] % t for d, t, _ in row]
        res += [ix[d] % t for d, t, _ in vec]
        return res

    return index_map


def _expands(sch, main, consumer) -> bool:
    """Whether the consumer computes more elements than the contraction (a broadcast epilogue,
    such as squeeze-excitation's ``x * sigmoid(conv(..))`` over C x H x W). Computed per tile it
    would repeat a whole plane per tile, serial within the tile; it runs as its own parallel stage."""
    main_static, main_symbolic = _points(
        it.dom.extent for it in sch.get(main).iter_vars if it.iter_type == tirx.IterVar.DataPar
    )
    static, symbolic = _points(it.dom.extent for it in sch.get(consumer).iter_vars)
    return symbolic != main_symbolic or static > main_static


def _points(extents) -> tuple[int, list[str]]:
    """(product of the static extents, names of the symbolic ones; other expressions as text)."""
    static, symbolic = 1, []
    for ext in extents:
        if isinstance(ext, tirx.IntImm):
            static *= int(ext)
        else:
            symbolic.append(str(ext))
    return static, sorted(symbolic)


def _writes_param(sch, block, func) -> bool:
    buf = sch.get(block).writes[0].source
    return any(buf.same_as(b) for b in func.params)


def _idx_dtype(stmt) -> str:
    for it in stmt.iter_vars:
        return str(it.var.ty.dtype)
    return "int64"


def _has_root(sch) -> bool:
    try:
        sch.get_sblock("root")
        return True
    except Exception:  # pylint: disable=broad-except
        return False

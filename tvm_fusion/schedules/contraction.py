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
  cycles per tile (``_plans``); on NCHW convs it puts the lanes on output channels (packed weight
  vectors, broadcast inputs), as NCHWc kernels do; tuning measures its runner-up plans;
* loops: ``parallel(fused outer spatial) / reduction loops / unroll(rows) / vectorize(vt)``;
  when one tile's slice of the weight panel (its whole reduction) is larger than half of L1, the
  first reduction loop is cache-blocked: ``parallel(tiles the panel moves with) / chunk / other
  tiles / rest of the reduction / micro-kernel``, so a chunk of the panel stays in L1 across the
  other tiles (``_cache_block_plan``; 14x14x256 3x3 conv: 1.75 -> 1.29 ms, BERT FFN GEMMs -5%);
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
  the materialized input and its reductions become one root stage, parallel over rows (every
  block of a row computed under the row loop, sums vectorized by an rfactor over SIMD lanes), and
  the GEMM gets the micro-kernel as usual. Two contractions in one PrimFunc (attention) decline.
"""

from __future__ import annotations

import math

import tvm
from tvm import tirx
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.sym import detect_linear_equation
from tvm.target import Target

from ._util import (
    LAYOUT_REWRITE_PREPROC,
    CpuRule,
    access_class,
    bare_var_dim,
    divisors_upto,
    get_sblock_realize,
    group_width,
    int_extent,
    is_one,
    last_dim_stride,
    linear_coeff,
    logger,
    num_cores,
    num_vector_registers,
    reachable_blocks,
    reverse_compute_within,
    safe_rule,
    schedule_injective_block,
    try_primitive,
    uses_var,
    vector_bits,
    vector_lanes,
)
from .fallback import schedule_nest
from .knobs import Knobs
from .plane import flatten_plane, inline_plain_copies, piece_bounds

GATHER_PENALTY = 10.0  # a strided operand along the vector axis: one load per lane
PACK_PENALTY = 0.05  # packing a constant weight costs nothing at run time: only a tie-breaker
SLIDING_LOAD_COST = 3.0  # a contiguous window sliding with a reduction iter (w + kw): misaligned, split lines
FMA_IN_FLIGHT = 8  # FMA latency (4 cycles) x FMA pipes (2): fewer accumulators leave pipes idle
TILE_OVERHEAD_CYCLES = 100  # per tile: loop, accumulator init, pointer set-up (fitted on 1x1 convs)
SHORT_STRIDE_PENALTY = 0.5  # per unit of stride: `stride` vector loads and shuffles per vector
ODD_VECTOR_PENALTY = 3.0  # vector axis extent not a multiple of the SIMD width
# With AVX-512 (float32) a partial vector computes in one register, its loads and stores masked
# or split by LLVM, so a divisor above half a register is offered without ODD_VECTOR_PENALTY: a
# 14x14 plane as rows of 14 lanes (80->480 1x1 conv: 0.18 -> 0.08 ms against channel lanes and
# their transposing write-back).
MASKED_ODD_VECTORS = True
# A masked odd vector with up to this many idle lanes costs as a whole one; with more, its cost is
# per useful lane (all its idle lanes charged): 13-lane rows of a 13x13 plane lose to channel
# lanes (SqueezeNet's 512->1000 conv: 0.96 vs 0.84 ms), 14-lane rows of a 14x14 plane mostly
# win (docs/performance.md).
FREE_IDLE_LANES = 2
WHOLE_VECTOR_EPILOGUE = True  # a tile's epilogue vectorizes a whole-vector loop (_schedule_tile_epilogue)
MAX_ROWS = 8
MAX_PLAN_CHOICES = 32  # micro-kernel plans the tuner may pick from (the model's best first)
RAGGED_ROWS = True
RAGGED_PENALTY = 0.05  # the last tile's bounds check on every row
PAD_PENALTY = 0.1  # zero-padded operand copies, and the cropping of the padded result
# A constant weight along a padded vector iter is padded by its packing, at compile time
# (_padded_weights): FocalNet's 384 -> 771 linear in 3-lane vectors 2.42 ms, padded to 800 0.58
PAD_PACKED_WEIGHTS = True
MAX_EPILOGUE_UNROLL = 64  # copies of an epilogue body per tile (64 = 4 vectors x 16 rows, the largest tile)
SHORT_TILE_FMAS = 1024  # below: accumulate in the global intermediate (see apply)
RAGGED_GLOBAL_ACC = True  # a ragged row tile accumulates in the intermediate (see apply)
CACHE_LINE_BYTES = 64
MAX_PIECE_COPIES = 32  # unrolled copies of a reduction loop over a fused concat's pieces
WRITE_LINE_CYCLES = 8  # per cache line a tile's write-back touches (fitted on whole convnets, see _plans)
# Cache blocking of the reduction (see _cache_block_plan). L1D is 32 KiB on every x86 core this
# targets (znver2-4, Skylake..Sapphire Rapids have 32-48 KiB); half of it holds the panel chunk,
# the rest is for the row operand's lines and the accumulator tile's spills.
CACHE_BLOCKING = True
L1_BYTES = 32 << 10
PANEL_BYTES = L1_BYTES // 2
MIN_CHUNK_STEPS = 32  # reduction steps per chunk: the accumulators reload once per chunk
MIN_TILE_REUSE = 4  # tiles per parallel task that share one panel chunk
MAX_IMBALANCE = 1.1  # parallel tasks over cores: 7 tasks on 2 cores leave 12% of the machine idle
MAX_BLOCKED_IMBALANCE = 1.5  # beyond this, blocking is given up for parallelism (see _cache_block_plan)
BLOCKED_TASK_BALANCE = True  # plans ranked by their blocked tasks' balance (_charge_blocked_imbalance)
# Below this many multiply-adds a kernel runs single-threaded: waking the thread pool costs ~7 us
# on these machines, more than the work (a 1x32x10 classifier GEMM: 7.6 us parallel, 0.04 us not).
PARALLEL_MIN_MACS = 1 << 16
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
        reductions = [b for b in infos if not b.is_injective()]
        # pointwise convs: inline the input copy (and a concat in front), then GEMM over the
        # flattened H*W plane (plane.py)
        if len(reductions) == 1 and inline_plain_copies(sch, reductions[0].block_rv, MAX_PIECE_COPIES):
            infos = normalize_prim_func(sch)
            reductions = [b for b in infos if not b.is_injective()]
        if len(reductions) == 1 and flatten_plane(sch, reductions[0]):
            infos = normalize_prim_func(sch)
            reductions = [b for b in infos if not b.is_injective()]
        if len(reductions) == 1:
            main_info = reductions[0]
        else:
            # layer_norm / softmax fused in front of a GEMM: the row reductions become their
            # own parallel stage (see _schedule_row_prologue), the GEMM gets the micro-kernel
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
        main = main_info.block_rv
        stmt = sch.get(main)
        if stmt.init is None or len(stmt.writes) != 1:
            return None
        out_buf = stmt.writes[0].source
        reads = [r for r in stmt.reads if not r.source.same_as(out_buf)]
        if not reads:
            return None
        layout_free = _layout_free_buffers(func) if self.prepack else set()

        plans = self._plans(main_info, stmt, reads, layout_free, target, str(out_buf.dtype))
        if not plans:
            return None
        if CACHE_BLOCKING and BLOCKED_TASK_BALANCE:
            plans = _charge_blocked_imbalance(plans, main_info, reads, layout_free, target)
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

        # ---- pad the vector iter to whole vectors (see _plans) -----------------------------------
        padded = {}  # the constant weights pad_einsum padded: their copies become the packing
        if v_it.dom % vt:
            v_pos = main_info.iters.index(v_it)
            row_pos = None if row_it is None else main_info.iters.index(row_it)
            sch.pad_einsum(main, [vt if i == v_pos else 1 for i in range(len(main_info.iters))])
            main_info = next(b for b in normalize_prim_func(sch) if b.name == stmt.name_hint)
            main = main_info.block_rv
            stmt = sch.get(main)
            out_buf = stmt.writes[0].source
            reads = [r for r in stmt.reads if not r.source.same_as(out_buf)]
            v_it = main_info.iters[v_pos]
            row_it = None if row_pos is None else main_info.iters[row_pos]
            padded = _padded_weights(sch, main, layout_free)

        # ---- inline everything that is not a direct producer of the main block -------------------
        self._inline_around(sch, main)

        # ---- pack constant weights (before tiling: the index map is written on block vars) ------
        if self.prepack:
            self._pack_weights(sch, main, layout_free, v_it, vt, row_it, rt, padded)

        # ---- tile ----------------------------------------------------------------------------
        small = _single_threaded([int_extent(sch, it.loop_rv) for it in main_info.iters])
        s_iters = [it for it in main_info.iters if it.kind == "S"]
        r_loops, piece_loops, piece_step = _split_at_pieces(sch, main_info)
        v_o, v_i = sch.split(v_it.loop_rv, factors=[None, vt])
        row_o = row_i = None
        if row_it is not None:
            row_o, row_i = sch.split(row_it.loop_rv, factors=[None, rt])
        # spatial outer loops in original order, with the vector tile's outer loop taking the first
        # of the two slots: the weight panel of one vector tile is then reused across all rows.
        slots = _tile_slots(main_info, v_it, row_it)
        outer = []
        for i, it in enumerate(s_iters):
            if i in slots:
                outer.append(v_o if i == slots[0] else row_o)
            else:
                outer.append(it.loop_rv)
        lanes = vector_lanes(target, str(out_buf.dtype))
        v_m = None
        if vt > lanes and vt % lanes == 0:
            # one SIMD register per vector op: LLVM turns wider (e.g. <24 x float>) accumulators
            # into shuffles and spills
            v_m, v_i = sch.split(v_i, factors=[None, lanes])
        inner = ([row_i] if row_i is not None else []) + ([v_m] if v_m is not None else []) + [v_i]
        blocking = None
        if CACHE_BLOCKING and not small:
            options = []
            for budget in (PANEL_BYTES, 0, PANEL_BYTES // 2, PANEL_BYTES * 2):
                plan = (
                    _cache_block_plan(
                        main_info, reads, layout_free, v_it, vt, row_it, rt, slots, target, budget
                    )
                    if budget
                    else None
                )
                if plan not in options:
                    options.append(plan)
            blocking = options[knobs.choose(sch, "block", len(options))]
            if blocking is not None and piece_step is not None and piece_step % blocking[1]:
                # chunks must not straddle the pieces: the largest divisor of their step below it
                chunk = divisors_upto(piece_step, blocking[1])[-1]
                blocking = (blocking[0], chunk) if chunk >= MIN_CHUNK_STEPS else None
        task_local = None
        if blocking is None and not small:
            task_local = _task_local_plan(sch, main_info, stmt, v_it, row_it, rt, vt, slots, target)
            if task_local is not None and knobs.choose(sch, "inputs", 2):
                task_local = None
        task_loop = None
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
            logger.debug(
                "Contraction %s: %d parallel loops, reduction chunk %d", stmt.name_hint, n_par, chunk
            )
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

        # ---- accumulator tile in registers + epilogue right after the tile -------------------
        consumers = sch.get_consumers(main)
        epilogue = None
        if (
            len(consumers) == 1
            and not _writes_param(sch, main, func)
            and not _expands(sch, main, consumers[0])
        ):
            epilogue = consumers[0]
            if not reverse_compute_within(sch, epilogue, main, fused):
                epilogue = None
        # This TVM allocates every "local" buffer through TVMBackendAllocWorkspace (no stack
        # alloca), once per tile. For long reductions that is noise and the "local" tile is the
        # best register tile (LLVM promotes it); for short ones (depthwise 3x3, 1x1 convs with few
        # input channels) the allocation costs more than the tile's FMAs, so the accumulator
        # stays in the (compacted) global intermediate and LLVM keeps it in registers via LICM.
        r_total = math.prod(it.dom for it in main_info.iters if it.kind == "R")
        tile_fmas = rt * math.ceil(vt / lanes) * r_total
        if blocking is not None:
            acc_scope = "global"  # the whole task's accumulators, persisting across chunks
        else:
            # a ragged last tile puts its bounds check on every accumulator update, and LLVM then
            # keeps a "local" tile in memory (squeezenet's 128->16 1x1 conv over 55x55 in tiles
            # of 8: 2.2x slower than accumulating in the intermediate)
            ragged = RAGGED_GLOBAL_ACC and row_it is not None and row_it.dom % rt != 0
            short = tile_fmas < SHORT_TILE_FMAS or ragged
            scopes = ["global", "local"] if short else ["local", "global"]
            acc_scope = scopes[knobs.choose(sch, "acc", 2)]
        if epilogue is not None:
            if acc_scope == "local":
                sch.set_scope(main, 0, "local")
            acc_consumer = epilogue
        else:
            wb = sch.cache_write(main, 0, acc_scope)
            sch.reverse_compute_at(wb, fused)
            acc_consumer = wb
        # accumulator layout [.., rows, vt]: v's output dim last, so the micro-kernel's
        # vectorized accesses to it are contiguous (and LLVM keeps it in registers)
        v_dim = _out_dim_of(stmt.writes[0], v_it.var)
        ndim = len(stmt.writes[0].region)
        if v_dim is not None and v_dim != ndim - 1:
            perm = [d for d in range(ndim) if d != v_dim] + [v_dim]
            sch.transform_layout(
                main,
                ("write", 0),
                tirx.IndexMap.from_func(
                    lambda *i: [i[d] for d in perm], ndim=ndim, index_dtype=_idx_dtype(stmt)
                ),
            )
        if row_i is not None:
            sch.unroll(row_i)
        if v_m is not None:
            sch.unroll(v_m)
        for loop in piece_loops:
            sch.unroll(loop)
        sch.vectorize(v_i)
        init = sch.decompose_reduction(main, init_at)
        init_loops = sch.get_loops(init)
        try_primitive(sch.vectorize, init_loops[-1])
        if blocking is None:
            self._schedule_tile_epilogue(sch, acc_consumer, target, sch.get(main).writes[0].source, fused)
        else:  # the epilogue covers the task's whole region: vectorized, not unrolled
            schedule_injective_block(sch, acc_consumer, target, parallel=False)

        handled = {sch.get(b).name_hint for b in (main, init, acc_consumer)}
        if task_loop is not None:
            for name in producers:
                _compute_in_task(sch, sch.get_sblock(name), task_loop)
                handled.add(name)
        # ---- reduction prologue (layer_norm / softmax rows feeding the GEMM) -----------------
        if len(reductions) > 1:
            for prod in sch.get_producers(main):
                if sch.get(prod).annotations.get(LAYOUT_REWRITE_PREPROC) is not None:
                    continue
                handled |= _schedule_row_prologue(sch, prod, target)

        # ---- remaining root stages (pad, transposes, unfusable leftovers) ---------------------
        root = sch.get_sblock("root") if _has_root(sch) else None
        blocks = sch.get_child_blocks(root) if root is not None else []
        for blk in blocks:
            name = sch.get(blk).name_hint
            if name in handled or sch.get(blk).annotations.get(LAYOUT_REWRITE_PREPROC) is not None:
                continue
            schedule_leftover_stage(sch, blk, target)
        return sch

    # ------------------------------------------------------------------------------------------
    def _plans(self, main_info, stmt, reads, layout_free, target, dtype) -> list[tuple]:
        """Every (vector iter, vector tile, row iter, row tile, cost), best first, by a
        cycles-per-FMA cost model.

        Per reduction step the micro-kernel issues ``A = rows x vt/lanes`` FMAs and some loads; it
        takes ``max(A, loads, FMA_IN_FLIGHT) / 2`` cycles (two FMA pipes, two vector loads a cycle,
        and FMA latency x pipes = 8 accumulators needed to keep the pipes busy). Each tile also pays
        a fixed cost (loop, init, accumulator set-up) and its write-back, which is a scatter of
        single lanes when the vector iter is not the output's contiguous dim, plus a cost per cache
        line it touches (a 32-channel x 8-pixel tile of an NCHW output touches 32 lines, an
        8-channel x 16-pixel one 8: inside a model those lines come from L3/DRAM, and a 1x1 conv
        of MobileNet-V2 ran 2.3x faster with lanes along the plane). The cost is the
        tile's cycles over the cycles its FMAs need at peak (1.0 is FMA-bound), over the useful
        lanes only for a masked odd vector with more than ``FREE_IDLE_LANES`` idle lanes, times
        the imbalance of the tiles over the cores (``apply`` then charges the imbalance of the
        fewer tasks cache blocking leaves: ``_charge_blocked_imbalance``).
        """
        lanes = vector_lanes(target, dtype)
        masked = MASKED_ODD_VECTORS and vector_bits(target) == 512 and tvm.DataType(dtype).bits == 32
        per_line = CACHE_LINE_BYTES // (tvm.DataType(dtype).bits // 8)  # output values per cache line
        regs = num_vector_registers(target)
        max_acc = regs - 4
        s_iters = [it for it in main_info.iters if it.kind == "S" and isinstance(it.dom, int) and it.dom >= 2]
        if not s_iters:
            return []
        out_region = stmt.writes[0]
        cores = num_cores(target)
        # per value of the symbolic iters (their loops run outside every tile)
        total = _static_points(main_info)
        r_vars = [it.var for it in main_info.iters if it.kind == "R"]
        r_extents = {it.var: it.dom for it in main_info.iters if it.kind == "R"}
        r_steps = math.prod(it.dom for it in main_info.iters if it.kind == "R")
        ranked = {}  # (v iter, vt, row iter, rt) -> sort key
        pad_ok = _paddable(stmt, layout_free)
        for v_it in s_iters:
            pen = 0.0
            kinds = {}
            groups = {}  # id(read) -> G: invariant along vector tiles whose width divides G
            for r in reads:
                c = access_class(r, v_it.var)
                stride = 1
                if c == "contiguous" and any(uses_var(r.region[-1].min, rv) for rv in r_vars):
                    # a sliding window (w + kw): misaligned loads, half of them split across lines
                    c = "sliding"
                elif c == "strided" and (width := group_width(r, v_it.var)):
                    # a grouped conv's input along its output channels (``oc // G``): one
                    # broadcast per tile within a group, a gather across groups (priced per vt)
                    c = "grouped"
                    groups[id(r)] = width
                elif c == "strided":
                    stride = last_dim_stride(r, v_it.var)
                    if r.source in layout_free and bare_var_dim(r, v_it.var) is not None:
                        c = "packed"
                        pen += PACK_PENALTY
                    elif stride is not None and 2 <= stride <= 4:
                        # e.g. a stride-2 conv along W: LLVM loads `stride` vectors and shuffles
                        c = "short_stride"
                        pen += SHORT_STRIDE_PENALTY * stride
                    else:
                        pen += GATHER_PENALTY
                kinds[id(r)] = (c, stride)
            out_strided = access_class(out_region, v_it.var) != "contiguous"
            ext = v_it.dom
            vts = {m * lanes: 0.0 for m in (4, 3, 2, 1) if ext % (m * lanes) == 0}  # vt -> penalty
            lane_share = {}  # vt -> lanes computed per useful lane (default 1)
            if not vts:
                odd = [d for d in divisors_upto(ext, lanes - 1) if 2 * d > lanes] if masked else []
                if odd:  # the widest partial vector (MASKED_ODD_VECTORS)
                    vts = {odd[-1]: 0.0}
                    if lanes - odd[-1] > FREE_IDLE_LANES:  # its idle lanes do no work
                        lane_share[odd[-1]] = lanes / odd[-1]
                else:
                    # one register-sized (or smaller) vector: wider odd vectors become shuffles
                    vts = {
                        d: ODD_VECTOR_PENALTY for d in [d for d in divisors_upto(ext, lanes) if d >= 2][-1:]
                    }
                if ext > lanes and pad_ok(v_it):
                    # or the iteration padded to whole vectors (pad_einsum: zero-padded copies of
                    # the operands that v indexes, and a padded output cropped by the epilogue)
                    for m in (2, 1):
                        padded = math.ceil(ext / (m * lanes)) * m * lanes
                        vts[m * lanes] = PAD_PENALTY + (padded / ext - 1) * 2
                if not vts:
                    continue
            rows = [None] + [it for it in s_iters if it is not v_it]
            for row_it in rows:
                rts = [1] if row_it is None else _row_tiles(row_it.dom, self.max_rows)
                sliding_rows = row_it is not None and any(
                    _slides_along(r, row_it.var, r_extents) for r in reads
                )
                for vt, vt_pen in vts.items():
                    nvec = math.ceil(vt / lanes)
                    split_groups = [g for g in groups.values() if g % vt]
                    vt_pen += GATHER_PENALTY * len(split_groups)
                    for rt in rts:
                        acc = rt * nvec
                        # accumulators + one row of operand vectors + the broadcast register(s):
                        # rows along a window (w + kw) share their broadcasts from one reduction
                        # step to the next, and LLVM keeps all rt of them (see _slides_along)
                        broadcasts = rt if sliding_rows else 1
                        if acc > max_acc or acc + nvec + broadcasts > regs:
                            continue
                        loads = 0.0
                        for r in reads:
                            varies_row = row_it is not None and access_class(r, row_it.var) != "invariant"
                            mult = rt if varies_row else 1
                            c, stride = kinds[id(r)]
                            if c == "grouped":
                                c = "strided" if groups[id(r)] % vt else "invariant"
                            if c == "invariant":
                                loads += mult
                            elif c in ("contiguous", "packed"):
                                loads += nvec * mult
                            elif c == "sliding":
                                loads += SLIDING_LOAD_COST * nvec * mult
                            elif c == "short_stride":
                                loads += 1.5 * stride * nvec * mult
                            else:
                                loads += vt * mult
                        step = max(acc, loads, FMA_IN_FLIGHT) / 2
                        scatter = acc * (lanes if out_strided else 1) / 2
                        lines = _lines_written(vt, rt, out_strided, per_line)
                        write_back = scatter + WRITE_LINE_CYCLES * lines
                        tile = r_steps * step + TILE_OVERHEAD_CYCLES + write_back
                        cost = pen + vt_pen + lane_share.get(vt, 1.0) * tile / (r_steps * acc / 2)
                        if row_it is not None and row_it.dom % rt:
                            # a ragged last tile (197 rows in tiles of 8): its rows past the end
                            # are skipped, but the tile costs as much as a full one
                            cost *= math.ceil(row_it.dom / rt) * rt / row_it.dom + RAGGED_PENALTY
                        # load imbalance across cores (1 tile on 2 cores: half the machine idles)
                        cost *= _tile_imbalance(total, vt, rt, cores)
                        # ties: rows along the output's contiguous dim (broadcast operands then
                        # walk memory contiguously), then the narrower vector (smaller packed panel)
                        row_last = (
                            row_it is not None
                            and _out_dim_of(out_region, row_it.var) == len(out_region.region) - 1
                        )
                        key = (round(cost, 3), -acc, not row_last, vt)
                        plan = (v_it, vt, row_it if rt > 1 else None, rt)
                        ranked[plan] = min(key, ranked.get(plan, key))
        order = sorted(ranked, key=lambda plan: (ranked[plan], s_iters.index(plan[0])))
        return [(*plan, ranked[plan][0]) for plan in order]

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


def _tile_slots(main_info, v_it, row_it) -> list[int]:
    """Positions, among the spatial iters, of the vector and row iters (the tile's outer loops)."""
    s_iters = [it for it in main_info.iters if it.kind == "S"]
    return sorted(i for i, it in enumerate(s_iters) if it is v_it or it is row_it)


def _outer_tile_vars(main_info, v_it, row_it, slots) -> list:
    """The iter var each outer tile loop walks, in apply's order: the spatial iters', the vector
    and row tiles' outer loops taking the slots of their iters (see _tile_slots)."""
    outer_vars = [it.var for it in main_info.iters if it.kind == "S"]
    outer_vars[slots[0]] = v_it.var
    if len(slots) > 1:
        outer_vars[slots[1]] = row_it.var
    return outer_vars


def _tile_counts(main_info, v_it, vt, row_it, rt, slots) -> list[int]:
    """Extents of the outer spatial loops once the vector and row iters are tiled (symbolic: 1)."""
    exts = [it.dom if isinstance(it.dom, int) else 1 for it in main_info.iters if it.kind == "S"]
    exts[slots[0]] = math.ceil(v_it.dom / vt)  # padded to whole vectors (pad_einsum) if need be
    if len(slots) > 1:
        exts[slots[1]] = math.ceil(row_it.dom / rt)
    return exts


def _parallel_tasks(main_info, exts, n_par) -> int | None:
    """Tasks of a nest whose first ``n_par`` outer loops (extents ``exts``, see _tile_counts) are
    the parallel ones; None when one of them is symbolic (a dynamic batch: unknown)."""
    s_iters = [it for it in main_info.iters if it.kind == "S"]
    if not all(isinstance(it.dom, int) for it in s_iters[:n_par]):
        return None
    return math.prod(exts[:n_par])


def _charge_blocked_imbalance(plans, main_info, reads, layout_free, target) -> list[tuple]:
    """``plans`` re-ranked by the parallel tasks their default cache blocking leaves.

    ``_plans`` charges the imbalance of tiles over cores, but a blocked kernel's parallel tasks
    are only the tiles of the loops its panel moves with: 960->160 at 7x7 in 32-channel tiles
    makes 5 tasks (3 on one core, 2 on the other) and ran 0.083 ms, in 16-channel tiles 10 tasks
    and 0.070 ms, though the 32-channel tile is the better micro-kernel. A plan is charged the
    worse of the two imbalances (its tiles', already in its cost, or its tasks').
    """
    if _single_threaded([it.dom if isinstance(it.dom, int) else None for it in main_info.iters]):
        return plans  # no parallel loop, no blocking (see apply)
    cores = num_cores(target)
    points = _static_points(main_info)
    charged = []
    for v_it, vt, row_it, rt, cost in plans:
        slots = _tile_slots(main_info, v_it, row_it)
        blocking = _cache_block_plan(main_info, reads, layout_free, v_it, vt, row_it, rt, slots, target)
        tasks = None
        if blocking is not None:
            exts = _tile_counts(main_info, v_it, vt, row_it, rt, slots)
            tasks = _parallel_tasks(main_info, exts, blocking[0])
        if tasks is not None:
            cost *= max(1.0, _imbalance(tasks, cores) / _tile_imbalance(points, vt, rt, cores))
        charged.append((v_it, vt, row_it, rt, round(cost, 3)))
    order = sorted(range(len(charged)), key=lambda i: (charged[i][4], i))  # stable: the model's ties
    return [charged[i] for i in order]


def _cache_block_plan(
    main_info, reads, layout_free, v_it, vt, row_it, rt, slots, target, panel_bytes=PANEL_BYTES
):
    """Cache blocking of the reduction: ``(n_par, chunk)`` or None (keep the plain tile loop).

    The *panel* is the operand that moves with the vector iter and the reduction (the packed
    weight of a GEMM / conv). Unblocked, every tile streams the panel's whole reduction extent;
    when that is more than ``PANEL_BYTES`` (half of L1) it comes from L2 on every tile. Blocked,
    the loops are ``parallel(outer[:n_par]) / chunk / outer[n_par:] / rest of the reduction /
    micro-kernel``: the outer loops the panel does not depend on (``outer[n_par:]``) run inside
    the chunk loop, so one chunk of the panel (the largest divisor of the first reduction iter
    that fits ``PANEL_BYTES``) stays in L1 across all those tiles, and the accumulators of the
    whole parallel task persist across chunks in the (compacted) intermediate. Only worth it where
    the row operand's lines are shared by the next row tiles (conv planes), not for GEMM rows.
    """
    r_iters = [it for it in main_info.iters if it.kind == "R"]
    r0 = r_iters[0]
    outer_vars = _outer_tile_vars(main_info, v_it, row_it, slots)
    cands = [
        r
        for r in reads
        if access_class(r, v_it.var) != "invariant" and access_class(r, r0.var) != "invariant"
    ]
    if not cands:
        return None
    panel = ([r for r in cands if r.source in layout_free] + cands)[0]
    row_operands = [
        r
        for r in reads
        if r is not panel
        and access_class(r, r0.var) != "invariant"
        and access_class(r, v_it.var) == "invariant"
    ]
    if row_operands and all(access_class(r, r0.var) == "contiguous" for r in row_operands):
        # GEMM-like rows (A[m, k]): a tile uses up every line of its rows it reads, so blocking only
        # moves the panel from L2 to L1, and the per-chunk accumulator reloads cost more than that
        # (BERT / ViT GEMMs, K = 768..3072: unblocked 0-30% faster with their inputs fresh from the
        # producer). Conv planes read one line per reduction step, shared by the next row tiles:
        # those keep the chunk in L1 across tiles (1x1 convs: blocked 5-20% faster).
        return None
    moving = [i for i, var in enumerate(outer_vars) if access_class(panel, var) != "invariant"]
    n_par = max(moving) + 1
    exts = _tile_counts(main_info, v_it, vt, row_it, rt, slots)
    n_outer = len(exts)
    cores = num_cores(target)
    # parallel tasks: whole tiles of the loops the panel moves with; take more loops in while that
    # leaves cores idle (7 tasks on 2 cores: 12% of the machine waits)
    while n_par < n_outer - 1 and _imbalance(math.prod(exts[:n_par]), cores) > MAX_IMBALANCE:
        n_par += 1
    tasks = _parallel_tasks(main_info, exts, n_par)
    if tasks is not None and _imbalance(tasks, cores) > MAX_BLOCKED_IMBALANCE:
        # still far too few tasks (a 512->64 1x1 conv whose one vector tile covers all 64 output
        # channels: one task, one core idle, 2x slower); unblocked, every tile is a parallel task.
        # A milder imbalance is the lesser cost (232->232 at 14x14: 5 tasks, blocked 2x faster)
        return None
    if n_par >= n_outer or math.prod(exts[n_par:]) < MIN_TILE_REUSE:
        return None  # too few tiles per task reuse a chunk to pay for the accumulator reloads
    elem = max(int(panel.source.dtype.bits) // 8, 1)
    r0_dom = int(r0.dom)

    def footprint(chunk):
        spans = [(v_it.var, vt), (r0.var, chunk)] + [(it.var, it.dom) for it in r_iters[1:]]
        return _region_bytes(panel, spans, elem)

    if footprint(r0_dom) <= panel_bytes:
        return None  # the whole panel of a tile already stays in L1
    fits = [d for d in divisors_upto(r0_dom, r0_dom - 1) if footprint(d) <= panel_bytes]
    if not fits:
        return None
    chunk = fits[-1]
    steps = chunk * math.prod(it.dom for it in r_iters[1:])
    if steps < MIN_CHUNK_STEPS:
        return None  # accumulator reload per chunk would cost more than the L1 reuse saves
    return n_par, chunk


def _padded_weights(sch, main, layout_free) -> dict:
    """``{padded copy: block}`` for the constant weights ``pad_einsum`` padded for ``main``: a
    producer that reads nothing but one layout-free parameter (its copy runs once, at compile
    time, when it is the packing preproc; a 771-wide linear of FocalNet in 3-lane vectors ran at
    59 GF/s)."""
    found = {}
    for blk in sch.get_producers(main):
        block = sch.get(blk)
        sources = {r.source for r in block.reads}
        if len(block.writes) == 1 and len(sources) == 1 and next(iter(sources)) in layout_free:
            found[block.writes[0].source] = blk
    return found


def _paddable(stmt, layout_free):
    """``pad_ok(iter)``: whether ``sch.pad_einsum`` can pad that iter of the block: one output,
    every access a point indexed by bare iter vars or constants, each buffer read once (an
    einsum: matmul, batch_matmul; not a conv), and no constant weight indexed by the iter (a
    padded copy of a weight would run at every call instead of being packed once)."""
    regions = list(stmt.reads) + list(stmt.writes)
    sources = [r.source for r in regions]
    einsum = len(stmt.writes) == 1 and len(set(sources)) == len(sources)
    einsum = einsum and all(
        isinstance(rng.extent, tirx.IntImm)
        and int(rng.extent) == 1
        and isinstance(rng.min, tirx.IntImm | tirx.Var)
        for r in regions
        for rng in r.region
    )

    def pad_ok(it) -> bool:
        # a constant weight indexed by the iter is padded only where its padded copy can be the
        # packing itself (a bare-var dim: see _padded_weights), folded at compile time
        return einsum and not any(
            r.source in layout_free
            and any(uses_var(rng.min, it.var) for rng in r.region)
            and (not PAD_PACKED_WEIGHTS or bare_var_dim(r, it.var) is None)
            for r in stmt.reads
        )

    return pad_ok


def _row_tiles(extent: int, max_rows: int) -> list[int]:
    """Row tile sizes for a row iter: its divisors, plus ragged tiles (the last one partial) larger
    than its largest divisor (197 is prime: without them, one-row tiles that stream the whole
    weight panel per output row, 17x slower than 196 rows; 55 rows: tiles of 8, not 5). The cost
    model charges a ragged tile its wasted rows."""
    tiles = divisors_upto(extent, max_rows)
    if RAGGED_ROWS and tiles[-1] < max_rows and extent > max_rows:
        tiles += [t for t in range(max(tiles[-1] + 1, max_rows // 2), max_rows + 1) if extent % t]
    return tiles


def _slides_along(read, var, r_extents: dict) -> bool:
    """Whether consecutive rows of ``read`` along the row iter ``var`` overlap: one of its dims is
    ``a·var + b·kw`` with a reduction iter ``kw`` and ``|a| < |b|·extent(kw)`` (a conv's window
    ``w + kw``, or ``2w + kw`` of a stride-2 3x3; not a 4x4/4 patchify stem's ``4w + kw``). Row r
    at step kw then reads what row r+1 read before, and LLVM keeps the rows' broadcasts in
    registers to reuse them: with 24 accumulators and 4 operand vectors that spilled
    (inception_v3's 1x7 conv, 192 channels at 17x17: 1.05 ms with rows along w, 0.72 along h;
    its 1x3 conv at 8x8, 384 channels: 0.37 vs 0.27), where 12 accumulators did not (the
    160-channel 1x7 conv: 0.50 along w, 0.56 along h)."""
    for rng in read.region:
        for rv, extent in r_extents.items():
            if not (uses_var(rng.min, var) and uses_var(rng.min, rv)):
                continue
            coeffs = detect_linear_equation(rng.min, [var, rv])
            if len(coeffs) != 3:  # not linear in both: count it as sliding (the safe side)
                return True
            row_step, window_step = (abs(int(c)) if isinstance(c, tirx.IntImm) else None for c in coeffs[:2])
            if row_step is None or window_step is None or row_step < window_step * extent:
                return True
    return False


def _lines_written(vt: int, rt: int, out_strided: bool, per_line: int) -> int:
    """Cache lines one tile's write-back touches: ``rt`` rows of ``vt`` contiguous values, or, when
    the vector iter is not the output's contiguous dim, ``vt`` rows of ``rt`` values each."""
    if out_strided:
        return vt * math.ceil(rt / per_line)
    return rt * math.ceil(vt / per_line)


def _imbalance(tasks: int, cores: int) -> float:
    return math.ceil(tasks / cores) * cores / max(tasks, 1)


def _static_points(main_info) -> int:
    """Spatial points of the block per value of its symbolic iters (a dynamic batch)."""
    return math.prod(it.dom for it in main_info.iters if it.kind == "S" and isinstance(it.dom, int))


def _tile_imbalance(points: int, vt: int, rt: int, cores: int) -> float:
    """The imbalance ``_plans`` charges a plan: its whole ``vt x rt`` tiles over the cores (at
    least one tile: a padded vector tile may be larger than the iteration space)."""
    return _imbalance(max(points // (vt * rt), 1), cores)


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
    outer_vars = _outer_tile_vars(main_info, v_it, row_it, slots)
    dependent = [any(access_class(r, var) != "invariant" for r in reads) for var in outer_vars]
    order = [i for i, d in enumerate(dependent) if d] + [i for i, d in enumerate(dependent) if not d]
    n_par = sum(dependent)
    exts = _tile_counts(main_info, v_it, vt, row_it, rt, slots)
    if n_par == 0 or n_par == len(order):
        return None  # nothing to move into the tasks (or every tile its own task: no saving)
    if _imbalance(math.prod(exts[i] for i in order[:n_par]), num_cores(target)) > MAX_IMBALANCE:
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


def _single_threaded(extents: list[int | None]) -> bool:
    """Whether a kernel of these loop extents (None: symbolic) runs without a parallel loop."""
    return all(e is not None for e in extents) and math.prod(extents) < PARALLEL_MIN_MACS


def _region_bytes(region, spans, elem) -> int:
    """Bytes of a point access's bounding box when each ``(var, n)`` of spans takes n consecutive
    values and every other var is fixed (a symbolic dim the spans do not bound: 1 GiB, far
    beyond any cache)."""
    total = elem
    for d, rng in enumerate(region.region):
        dim = region.source.shape[d]
        ext = int(dim) if isinstance(dim, tirx.IntImm) else 1 << 30
        if isinstance(rng.extent, tirx.IntImm) and int(rng.extent) == 1:
            span, ok = 1, True
            for var, n in spans:
                if uses_var(rng.min, var):
                    c = linear_coeff(rng.min, var)
                    if c is None:
                        ok = False
                        break
                    span += abs(c) * (n - 1)
            ext = min(ext, span) if ok else ext
        total *= ext
    return total


def _reads_varying_with_reduction(stmt) -> list:
    """Read buffers (other than the output) whose access moves with a reduction iter."""
    out_buf = stmt.writes[0].source if stmt.writes else None
    r_vars = [it.var for it in stmt.iter_vars if it.iter_type == tirx.IterVar.CommReduce]
    bufs = []
    for region in stmt.reads:
        if out_buf is not None and region.source.same_as(out_buf):
            continue
        if any(access_class(region, v) != "invariant" for v in r_vars):
            if not any(region.source.same_as(b) for b in bufs):
                bufs.append(region.source)
    return bufs


def _prologue_contraction(sch, reductions):
    """The one contraction among several reduction blocks, if every other reduction is a row
    reduction (one operand moving along its reduction axes: sum / max / variance) that only feeds
    the contraction's inputs (layer_norm -> GEMM, softmax -> GEMM). Otherwise None.

    Two contractions (attention's QK^T -> softmax -> PV) are declined: the row stage would run
    the first GEMM scalar."""
    contractions = [b for b in reductions if len(_reads_varying_with_reduction(sch.get(b.block_rv))) >= 2]
    if len(contractions) != 1:
        return None
    main_info = contractions[0]
    up = {sch.get(b).name_hint for b in reachable_blocks(sch, main_info.block_rv, sch.get_producers)}
    for info in reductions:
        if info is main_info:
            continue
        stmt = sch.get(info.block_rv)
        if stmt.name_hint not in up or len(_reads_varying_with_reduction(stmt)) != 1:
            return None
        kinds = info.dom_kind()
        if not kinds.startswith("S") or "S" in kinds.lstrip("S"):
            return None  # rows (leading spatial) then reduction axes only
        if any(not isinstance(d, int) for d in info.dom()):
            return None
    return main_info


def _leading_spatial(stmt) -> int:
    n = 0
    for it in stmt.iter_vars:
        if it.iter_type != tirx.IterVar.DataPar:
            break
        n += 1
    return n


def _schedule_row_prologue(sch, anchor, target) -> set:
    """Schedule a materialized GEMM input and the row reductions it needs (layer_norm: sum,
    mean, variance, normalize) as one root stage: parallel over rows, every block of a row
    computed under that loop (the row stays in L1), injective blocks vectorized, reductions
    vectorized by an rfactor over SIMD lanes. Returns the names of the blocks it scheduled
    (empty when anchor has no reduction upstream: plain pads / transposes are left to the
    injective stage code)."""
    anchor_stmt = sch.get(anchor)
    if not all(it.iter_type == tirx.IterVar.DataPar for it in anchor_stmt.iter_vars):
        return set()
    group = reachable_blocks(sch, anchor, sch.get_producers)
    if not any(not all(it.iter_type == tirx.IterVar.DataPar for it in sch.get(b).iter_vars) for b in group):
        return set()
    stmts = [sch.get(b) for b in group]
    n_lead = min([_leading_spatial(st) for st in stmts] + [len(anchor_stmt.iter_vars) - 1])
    if n_lead < 1:
        return set()
    lanes = vector_lanes(target, str(anchor_stmt.writes[0].source.dtype))
    # root order: producers before consumers (compute_at below goes consumers first)
    order = {sch.get(b).name_hint: i for i, b in enumerate(sch.get_child_blocks(sch.get_sblock("root")))}
    names = sorted((st.name_hint for st in stmts), key=lambda n: order.get(n, -1))
    # vectorized row reductions: ki (SIMD lanes) becomes a spatial axis of an rf block that
    # accumulates lanes partial sums; the write-back block adds the lanes up. rfactor needs the
    # block alone under its loops, so it runs while the blocks are still at root.
    scheduled = []
    for name in names:
        blk = sch.get_sblock(name)
        st = sch.get(blk)
        if all(it.iter_type == tirx.IterVar.DataPar for it in st.iter_vars):
            scheduled.append(name)
            continue
        loops = sch.get_loops(blk)
        ext = int_extent(sch, loops[-1])
        if ext is not None and ext % lanes == 0 and ext >= 2 * lanes:
            _, ki = sch.split(loops[-1], factors=[None, lanes])
            try:
                rf = sch.rfactor(ki, factor_axis=len(st.writes[0].region))
                scheduled += [sch.get(rf).name_hint, name]
                continue
            except Exception as err:  # pylint: disable=broad-except
                logger.debug("rfactor of %s failed: %s", name, err)
        scheduled.append(name)
    loops = sch.get_loops(anchor)
    rows = sch.fuse(*loops[:n_lead]) if n_lead > 1 else loops[0]
    sch.parallel(rows)
    for name in reversed(scheduled):
        sch.compute_at(sch.get_sblock(name), rows, preserve_unit_loops=True)
    for blk in [sch.get_sblock(n) for n in scheduled] + [anchor]:
        _vectorize_row_inner(sch, blk, lanes)
    # everything under the row loop now (rf init blocks included) is taken care of
    return {sch.get(b).name_hint for b in sch.get_child_blocks(rows)} | {anchor_stmt.name_hint}


def _vectorize_row_inner(sch, blk, lanes):
    """Vectorize the innermost loop of a block under the row loop, if it binds a spatial iter."""
    st = sch.get(blk)
    loops = sch.get_loops(blk)[1:]
    if not loops:
        return
    inner = loops[-1]
    ext = int_extent(sch, inner)
    if ext is None or ext < 2:
        return
    if _binds_reduction(sch, blk, inner):
        # an rf block (compute_at put its lanes axis first): reduction loops out, lanes in
        spatial = [lp for lp in loops if not _binds_reduction(sch, blk, lp) and int_extent(sch, lp) == lanes]
        if spatial and try_primitive(
            sch.reorder, *[lp for lp in loops if lp is not spatial[-1]], spatial[-1]
        ):
            try_primitive(sch.vectorize, sch.get_loops(blk)[-1])
            r_loops = [lp for lp in sch.get_loops(blk)[1:] if _binds_reduction(sch, blk, lp)]
            if r_loops and st.init is not None:
                init = sch.decompose_reduction(blk, r_loops[0])
                try_primitive(sch.vectorize, sch.get_loops(init)[-1])
            return
        # reduction innermost (no rfactor): unroll by lanes so LLVM pipelines the scalar chain
        if ext > lanes and ext % lanes == 0:
            _, inner = sch.split(inner, factors=[None, lanes])
            sch.annotate(inner, ann_key="pragma_auto_unroll_max_step", ann_val=lanes)
            sch.annotate(inner, ann_key="pragma_unroll_explicit", ann_val=1)
        return
    if ext > lanes and ext % lanes == 0:
        _, inner = sch.split(inner, factors=[None, lanes])
    elif ext > lanes:
        return
    try_primitive(sch.vectorize, inner)


def _binds_reduction(sch, blk, loop) -> bool:
    var = sch.get(loop).loop_var
    realize = get_sblock_realize(sch, blk)
    for it, val in zip(sch.get(blk).iter_vars, realize.iter_values):
        if it.iter_type != tirx.IterVar.DataPar and any(
            v.same_as(var) for v in tirx.analysis.undefined_vars(val)
        ):
            return True
    return False


def schedule_leftover_stage(sch, blk, target) -> None:
    """A root stage next to a contraction that no other step took (a pad, a transpose, a
    prologue reduction the row stage could not take): parallel and vectorized if injective, at
    least parallel rows otherwise."""
    if all(it.iter_type == tirx.IterVar.DataPar for it in sch.get(blk).iter_vars):
        schedule_injective_block(sch, blk, target)
    else:
        try_primitive(schedule_nest, sch, blk, target)


def _make_pack_map(outer_order, blocked_dims, row, vec, ndim):
    def index_map(*ix):
        res = [ix[d] // t for d, t, _ in outer_order]
        res += [ix[d] for d in range(ndim) if d not in blocked_dims]
        res += [ix[d] % t for d, t, _ in row]
        res += [ix[d] % t for d, t, _ in vec]
        return res

    return index_map


def _layout_free_buffers(func: tirx.PrimFunc) -> set:
    idx = func.attrs.get("layout_free_buffers") if func.attrs is not None else None
    if not idx:
        return set()
    out = set()
    for i in idx:
        out.add(func.params[int(i)])  # in this TVM a PrimFunc param *is* its buffer
    return out


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


def _out_dim_of(region, var) -> int | None:
    for d, rng in enumerate(region.region):
        if isinstance(rng.min, tirx.Var) and rng.min.same_as(var):
            return d
    return None


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

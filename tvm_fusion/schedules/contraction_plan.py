"""The cost model behind ``Contraction``: which micro-kernel plan, and whether to cache-block.

Pure analysis of a contraction block's access patterns (no schedule is changed here):
``rank_plans`` ranks every (vector iter, vector tile, row iter, row tile) by the cycles a tile
takes per FMA at peak, ``charge_blocked_imbalance`` re-ranks them by the parallel tasks their cache
blocking leaves, and ``cache_block_plan`` picks the reduction chunk that keeps a weight panel in
L1. ``Contraction`` applies the plan it is given (its ``plan`` knob: the n-th best of these);
``Winograd``'s GEMM plans (which ``Strassen`` uses too) take the same hardware constants.
"""

from __future__ import annotations

import math

import tvm
from tvm import tirx
from tvm.sym import detect_linear_equation

from ._util import (
    access_class,
    bare_var_dim,
    divisors_upto,
    group_width,
    last_dim_stride,
    linear_coeff,
    num_cores,
    num_vector_registers,
    uses_var,
    vector_bits,
    vector_lanes,
)

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
MAX_ROWS = 8
RAGGED_ROWS = True
RAGGED_PENALTY = 0.05  # the last tile's bounds check on every row
PAD_PENALTY = 0.1  # zero-padded operand copies, and the cropping of the padded result
# A constant weight along a padded vector iter is padded by its packing, at compile time
# (padded_weights): FocalNet's 384 -> 771 linear in 3-lane vectors 2.42 ms, padded to 800 0.58
PAD_PACKED_WEIGHTS = True
CACHE_LINE_BYTES = 64
WRITE_LINE_CYCLES = 8  # per cache line a tile's write-back touches (fitted on whole convnets, see rank_plans)
# Cache blocking of the reduction (see cache_block_plan). L1D is 32 KiB on every x86 core this
# targets (znver2-4, Skylake..Sapphire Rapids have 32-48 KiB); half of it holds the panel chunk,
# the rest is for the row operand's lines and the accumulator tile's spills.
L1_BYTES = 32 << 10
PANEL_BYTES = L1_BYTES // 2
MIN_CHUNK_STEPS = 32  # reduction steps per chunk: the accumulators reload once per chunk
MIN_TILE_REUSE = 4  # tiles per parallel task that share one panel chunk
MAX_IMBALANCE = 1.1  # parallel tasks over cores: 7 tasks on 2 cores leave 12% of the machine idle
MAX_BLOCKED_IMBALANCE = 1.5  # beyond this, blocking is given up for parallelism (see cache_block_plan)
# Below this many multiply-adds a kernel runs single-threaded: waking the thread pool costs ~7 us
# on these machines, more than the work (a 1x32x10 classifier GEMM: 7.6 us parallel, 0.04 us not).
PARALLEL_MIN_MACS = 1 << 16


def rank_plans(main_info, stmt, reads, layout_free, target, dtype, max_rows: int = MAX_ROWS) -> list[tuple]:
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
    fewer tasks cache blocking leaves: ``charge_blocked_imbalance``).
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
    total = static_points(main_info)
    r_vars = [it.var for it in main_info.iters if it.kind == "R"]
    r_extents = {it.var: it.dom for it in main_info.iters if it.kind == "R"}
    r_steps = math.prod(it.dom for it in main_info.iters if it.kind == "R")
    ranked = {}  # (v iter, vt, row iter, rt) -> sort key
    pad_ok = paddable(stmt, layout_free)
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
                vts = {d: ODD_VECTOR_PENALTY for d in [d for d in divisors_upto(ext, lanes) if d >= 2][-1:]}
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
            rts = [1] if row_it is None else row_tiles(row_it.dom, max_rows)
            sliding_rows = row_it is not None and any(slides_along(r, row_it.var, r_extents) for r in reads)
            for vt, vt_pen in vts.items():
                nvec = math.ceil(vt / lanes)
                split_groups = [g for g in groups.values() if g % vt]
                vt_pen += GATHER_PENALTY * len(split_groups)
                for rt in rts:
                    acc = rt * nvec
                    # accumulators + one row of operand vectors + the broadcast register(s):
                    # rows along a window (w + kw) share their broadcasts from one reduction
                    # step to the next, and LLVM keeps all rt of them (see slides_along)
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
                    lines = lines_written(vt, rt, out_strided, per_line)
                    write_back = scatter + WRITE_LINE_CYCLES * lines
                    tile = r_steps * step + TILE_OVERHEAD_CYCLES + write_back
                    cost = pen + vt_pen + lane_share.get(vt, 1.0) * tile / (r_steps * acc / 2)
                    if row_it is not None and row_it.dom % rt:
                        # a ragged last tile (197 rows in tiles of 8): its rows past the end
                        # are skipped, but the tile costs as much as a full one
                        cost *= math.ceil(row_it.dom / rt) * rt / row_it.dom + RAGGED_PENALTY
                    # load imbalance across cores (1 tile on 2 cores: half the machine idles)
                    cost *= tile_imbalance(total, vt, rt, cores)
                    # ties: rows along the output's innermost dim the vector leaves (operands
                    # then walk memory with the smallest stride: an NHWC depthwise 7x7 conv with
                    # channel lanes and rows along W ran 4-8 % faster than along H), then the
                    # narrower vector (smaller packed panel); a one-row plan has no rows
                    row_dim = out_dim_of(out_region, row_it.var) if row_it is not None and rt > 1 else None
                    rows_outward = 1 if row_dim is None else -row_dim
                    key = (round(cost, 3), -acc, rows_outward, vt)
                    plan = (v_it, vt, row_it if rt > 1 else None, rt)
                    ranked[plan] = min(key, ranked.get(plan, key))
    order = sorted(ranked, key=lambda plan: (ranked[plan], s_iters.index(plan[0])))
    return [(*plan, ranked[plan][0]) for plan in order]


def tile_slots(main_info, v_it, row_it) -> list[int]:
    """Positions, among the spatial iters, of the vector and row iters (the tile's outer loops)."""
    s_iters = [it for it in main_info.iters if it.kind == "S"]
    return sorted(i for i, it in enumerate(s_iters) if it is v_it or it is row_it)


def outer_tile_vars(main_info, v_it, row_it, slots) -> list:
    """The iter var each outer tile loop walks, in apply's order: the spatial iters', the vector
    and row tiles' outer loops taking the slots of their iters (see tile_slots)."""
    outer_vars = [it.var for it in main_info.iters if it.kind == "S"]
    outer_vars[slots[0]] = v_it.var
    if len(slots) > 1:
        outer_vars[slots[1]] = row_it.var
    return outer_vars


def tile_counts(main_info, v_it, vt, row_it, rt, slots) -> list[int]:
    """Extents of the outer spatial loops once the vector and row iters are tiled (symbolic: 1)."""
    exts = [it.dom if isinstance(it.dom, int) else 1 for it in main_info.iters if it.kind == "S"]
    exts[slots[0]] = math.ceil(v_it.dom / vt)  # padded to whole vectors (pad_einsum) if need be
    if len(slots) > 1:
        exts[slots[1]] = math.ceil(row_it.dom / rt)
    return exts


def parallel_tasks(main_info, exts, n_par) -> int | None:
    """Tasks of a nest whose first ``n_par`` outer loops (extents ``exts``, see tile_counts) are
    the parallel ones; None when one of them is symbolic (a dynamic batch: unknown)."""
    s_iters = [it for it in main_info.iters if it.kind == "S"]
    if not all(isinstance(it.dom, int) for it in s_iters[:n_par]):
        return None
    return math.prod(exts[:n_par])


def charge_blocked_imbalance(plans, main_info, reads, layout_free, target) -> list[tuple]:
    """``plans`` re-ranked by the parallel tasks their default cache blocking leaves.

    ``rank_plans`` charges the imbalance of tiles over cores, but a blocked kernel's parallel tasks
    are only the tiles of the loops its panel moves with: 960->160 at 7x7 in 32-channel tiles
    makes 5 tasks (3 on one core, 2 on the other) and ran 0.083 ms, in 16-channel tiles 10 tasks
    and 0.070 ms, though the 32-channel tile is the better micro-kernel. A plan is charged the
    worse of the two imbalances (its tiles', already in its cost, or its tasks').
    """
    if single_threaded([it.dom if isinstance(it.dom, int) else None for it in main_info.iters]):
        return plans  # no parallel loop, no blocking (see Contraction.apply)
    cores = num_cores(target)
    points = static_points(main_info)
    charged = []
    for v_it, vt, row_it, rt, cost in plans:
        slots = tile_slots(main_info, v_it, row_it)
        blocking = cache_block_plan(main_info, reads, layout_free, v_it, vt, row_it, rt, slots, target)
        tasks = None
        if blocking is not None:
            exts = tile_counts(main_info, v_it, vt, row_it, rt, slots)
            tasks = parallel_tasks(main_info, exts, blocking[0])
        if tasks is not None:
            cost *= max(1.0, imbalance(tasks, cores) / tile_imbalance(points, vt, rt, cores))
        charged.append((v_it, vt, row_it, rt, round(cost, 3)))
    order = sorted(range(len(charged)), key=lambda i: (charged[i][4], i))  # stable: the model's ties
    return [charged[i] for i in order]


def cache_block_plan(
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
    outer_vars = outer_tile_vars(main_info, v_it, row_it, slots)
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
    exts = tile_counts(main_info, v_it, vt, row_it, rt, slots)
    n_outer = len(exts)
    cores = num_cores(target)
    # parallel tasks: whole tiles of the loops the panel moves with; take more loops in while that
    # leaves cores idle (7 tasks on 2 cores: 12% of the machine waits)
    while n_par < n_outer - 1 and imbalance(math.prod(exts[:n_par]), cores) > MAX_IMBALANCE:
        n_par += 1
    tasks = parallel_tasks(main_info, exts, n_par)
    if tasks is not None and imbalance(tasks, cores) > MAX_BLOCKED_IMBALANCE:
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
        return region_bytes(panel, spans, elem)

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


def padded_weights(sch, main, layout_free) -> dict:
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


def paddable(stmt, layout_free):
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
        # packing itself (a bare-var dim: see padded_weights), folded at compile time
        return einsum and not any(
            r.source in layout_free
            and any(uses_var(rng.min, it.var) for rng in r.region)
            and (not PAD_PACKED_WEIGHTS or bare_var_dim(r, it.var) is None)
            for r in stmt.reads
        )

    return pad_ok


def row_tiles(extent: int, max_rows: int) -> list[int]:
    """Row tile sizes for a row iter: its divisors, plus ragged tiles (the last one partial) larger
    than its largest divisor (197 is prime: without them, one-row tiles that stream the whole
    weight panel per output row, 17x slower than 196 rows; 55 rows: tiles of 8, not 5). The cost
    model charges a ragged tile its wasted rows."""
    tiles = divisors_upto(extent, max_rows)
    if RAGGED_ROWS and tiles[-1] < max_rows and extent > max_rows:
        tiles += [t for t in range(max(tiles[-1] + 1, max_rows // 2), max_rows + 1) if extent % t]
    return tiles


def slides_along(read, var, r_extents: dict) -> bool:
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


def lines_written(vt: int, rt: int, out_strided: bool, per_line: int) -> int:
    """Cache lines one tile's write-back touches: ``rt`` rows of ``vt`` contiguous values, or, when
    the vector iter is not the output's contiguous dim, ``vt`` rows of ``rt`` values each."""
    if out_strided:
        return vt * math.ceil(rt / per_line)
    return rt * math.ceil(vt / per_line)


def imbalance(tasks: int, cores: int) -> float:
    return math.ceil(tasks / cores) * cores / max(tasks, 1)


def static_points(main_info) -> int:
    """Spatial points of the block per value of its symbolic iters (a dynamic batch)."""
    return math.prod(it.dom for it in main_info.iters if it.kind == "S" and isinstance(it.dom, int))


def tile_imbalance(points: int, vt: int, rt: int, cores: int) -> float:
    """The imbalance ``rank_plans`` charges a plan: its whole ``vt x rt`` tiles over the cores (at
    least one tile: a padded vector tile may be larger than the iteration space)."""
    return imbalance(max(points // (vt * rt), 1), cores)


def single_threaded(extents: list[int | None]) -> bool:
    """Whether a kernel of these loop extents (None: symbolic) runs without a parallel loop."""
    return all(e is not None for e in extents) and math.prod(extents) < PARALLEL_MIN_MACS


def region_bytes(region, spans, elem) -> int:
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


def out_dim_of(region, var) -> int | None:
    for d, rng in enumerate(region.region):
        if isinstance(rng.min, tirx.Var) and rng.min.same_as(var):
            return d
    return None

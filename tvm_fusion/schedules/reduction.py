"""Row reductions (softmax, layer_norm) and plain reductions (a global mean / sum, RMS norm's sum).

``RowReduction`` computes every block of a row under one parallel row loop with the sums in SIMD
lanes, falling back to ``dlight.cpu.Reduction`` for shapes that schedule cannot take. Either would
also accept a conv + bias (one reduction then injective), computing each output element in its own
parallel iteration; so it only takes functions with at least two reduction blocks (the Contraction
rule takes single ones).
"""

from __future__ import annotations

import math

from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.s_tir.dlight.cpu import Reduction as _DlightReduction
from tvm.target import Target

from ._util import (
    PARALLEL_MIN_ELEMENTS,
    CpuRule,
    bare_var_dim,
    int_extent,
    is_cpu,
    last_dim_stride,
    logger,
    reachable_blocks,
    reverse_compute_within,
    safe_rule,
    try_primitive,
    vector_lanes,
)
from .row_stage import reads_varying_with_reduction, schedule_row_prologue, vectorize_row_inner

MAX_PARTIAL_SUMS = 16  # lanes of a ragged plane's float32 sum: two AVX2 vectors, one AVX-512


class RowReduction(ScheduleRule):
    """Row normalisations with several reductions per row (layer_norm, softmax): every block of a
    row computed under one parallel row loop (the row stays in L1), the sums vectorized by an
    rfactor over SIMD lanes (``row_stage.schedule_row_prologue``, the schedule of a norm fused in
    front of a GEMM).

    dlight's CPU Reduction (the fallback here) sums each row as one scalar chain, an add latency
    per element: BERT's standalone 128x768 layer norms took 0.098 ms each, 2.4 % of the model."""

    def __init__(self):
        self._inner = _DlightReduction()

    def is_target_available(self, target: Target) -> bool:
        return is_cpu(target)

    @safe_rule
    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool):
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        infos = normalize_prim_func(s_tir.Schedule(func))
        if not infos or sum(1 for b in infos if not b.is_injective()) < 2:
            return None
        return _vectorized_rows(func, target) or self._inner.apply(func, target, tunable)


def _vectorized_rows(func: tirx.PrimFunc, target: Target) -> s_tir.Schedule | None:
    """The row schedule when the function is one chain of row blocks ending in a single spatial
    output block that every other block feeds, its reductions over the trailing axes of the rows
    the output block iterates (None otherwise)."""
    sch = s_tir.Schedule(func)
    blocks = sch.get_child_blocks(sch.get_sblock("root"))
    sinks = [b for b in blocks if not sch.get_consumers(b)]
    if len(sinks) != 1 or not _rows_line_up([sch.get(b) for b in blocks]):
        return None
    try:
        scheduled = schedule_row_prologue(sch, sinks[0], target)
    except Exception as err:  # pylint: disable=broad-except
        logger.debug("row schedule of %s failed: %s", sch.get(sinks[0]).name_hint, err)
        return None
    root_blocks = {sch.get(b).name_hint for b in sch.get_child_blocks(sch.get_sblock("root"))}
    return sch if scheduled and not root_blocks - scheduled else None


def _rows_line_up(stmts: list) -> bool:
    """Whether every reduction reduces the trailing axes of one row of the output: a reduction's
    result is read, wherever it is read, at the reader's leading loop variables. A softmax over
    NCHW's channel axis reads its sums at (n, h, w) while the output's rows are (n, c, h): computed
    under that row loop, each row would redo the whole reduction."""
    reduced = [st.writes[0].source for st in stmts if not all(_spatial(it) for it in st.iter_vars)]
    for st in stmts:
        lead = [it.var for it in st.iter_vars]
        for region in st.reads:
            if not any(region.source.same_as(buf) for buf in reduced):
                continue
            index = [r.min for r in region.region if not isinstance(r.min, tirx.IntImm)]
            if len(index) > len(lead) or any(not i.same_as(v) for i, v in zip(index, lead)):
                return False
    return True


def _spatial(iter_var) -> bool:
    return iter_var.iter_type == tirx.IterVar.DataPar


class PlainReduction(CpuRule):
    """A reduction of one tensor over its trailing, contiguous axes (a global mean / sum / max:
    squeeze-excitation's pooling, a spatial mean): parallel over the kept axes, the reduction
    fused into one contiguous loop and summed in SIMD lanes (an rfactor), the epilogue per row.

    The Contraction rule would take it as a one-operand contraction and put its vector axis on
    channels, gathering one float per lane across planes (EfficientNet's SE means: 6x ORT's)."""

    @safe_rule
    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool):  # noqa: ARG002
        opened = self.normalized(func, target)
        if opened is None:
            return None
        sch, infos = opened
        reductions = [b for b in infos if not b.is_injective()]
        if len(reductions) != 1:
            return None
        info = reductions[0]
        red = info.block_rv
        stmt = sch.get(red)
        kinds = info.dom_kind()
        n_s = len(kinds) - len(kinds.lstrip("S"))
        if not n_s or set(kinds[n_s:]) != {"R"} or any(not isinstance(d, int) for d in info.dom()):
            return None
        varying = reads_varying_with_reduction(stmt)
        if len(varying) != 1:
            return None  # a contraction of two operands (or nothing): not ours
        (src,) = [r for r in stmt.reads if r.source.same_as(varying[0])]
        r_vars = [it.var for it in info.iters[n_s:]]
        if last_dim_stride(src, r_vars[-1]) != 1 or len(stmt.writes) != 1:
            return None  # the innermost reduction axis must walk the operand contiguously
        _inline_producers(sch, red, r_vars)
        lanes = vector_lanes(target, str(stmt.writes[0].source.dtype))
        loops = sch.get_loops(red)
        r_loops = loops[n_s:]
        if len(r_loops) > 1 and not _contiguous(src, r_vars):
            return None
        inner = sch.fuse(*r_loops) if len(r_loops) > 1 else r_loops[0]
        ext = int_extent(sch, inner)
        rows = sch.fuse(*loops[:n_s]) if n_s > 1 else loops[0]
        if (int_extent(sch, rows) or 2) > 1 and math.prod(info.dom()) >= PARALLEL_MIN_ELEMENTS:
            sch.parallel(rows)  # before the rfactor: afterwards the row loop holds two stages
        width = _partial_sums(ext, lanes)
        if width:
            _, ki = sch.split(inner, factors=[None, width])
            rf = sch.rfactor(ki, factor_axis=len(stmt.writes[0].region))
            sch.compute_at(rf, rows, preserve_unit_loops=True)
            vectorize_row_inner(sch, rf, width)
        # the epilogue, transitively (a cast back from float64, then GroupNorm's x - mean over the
        # whole group): each block per row, its loops fused and vectorized; left at the root, the
        # subtract was one serial scalar loop over the tensor (BiT: 0.6 ms a group norm)
        for blk in reachable_blocks(sch, red, sch.get_consumers):
            if _sole_consumer(sch, blk) and try_primitive(sch.reverse_compute_inline, blk):
                continue
            # checked against every block it reads: a reshape that scatters a row stays out
            if reverse_compute_within(sch, blk, None, rows):
                dtype = str(sch.get(blk).writes[0].source.dtype)
                _vectorize_elementwise_within(sch, blk, rows, vector_lanes(target, dtype))
        return sch


def _sole_consumer(sch, block) -> bool:
    """Whether ``block`` is the only reader of what its producer writes. This TVM's
    ``reverse_compute_inline`` does not check it: inlining GELU's ``x / sqrt(2)`` into a mean's
    division dropped the mean's buffer that GELU's ``x * ...`` still read (FocalNet's
    ``mean -> gelu`` kernels failed to compile)."""
    producers = sch.get_producers(block)
    return len(producers) == 1 and len(sch.get_consumers(producers[0])) == 1


def _vectorize_elementwise_within(sch, block, rows, lanes: int) -> None:
    """The loops of an elementwise ``block`` under ``rows`` as one loop, split into vectors."""
    loops = sch.get_loops(block)
    at = next((i for i, lp in enumerate(loops) if sch.get(lp).same_as(sch.get(rows))), None)
    inner = loops[at + 1 :] if at is not None else []
    if not inner:
        return
    fused = sch.fuse(*inner) if len(inner) > 1 else inner[0]
    extent = int_extent(sch, fused)
    if extent is not None and extent >= 2 * lanes:
        _, vec = sch.split(fused, factors=[None, lanes])
        try_primitive(sch.vectorize, vec)


def _inline_producers(sch, block, r_vars) -> None:
    """Inline the chain that feeds ``block``, not only its last link: a GroupNorm's variance
    squares the deviations, then casts them to float64; with only the cast inlined, the square
    stayed a serial stage writing the whole tensor (BiT: 0.7 ms a group norm). Only as far as the
    reduction still walks what it reads contiguously (a transpose up the chain would not); else
    its direct producers only."""

    def inline_all(schedule) -> None:
        while any(try_primitive(schedule.compute_inline, blk) for blk in schedule.get_producers(block)):
            pass

    probe = sch.copy()
    inline_all(probe)
    varying = reads_varying_with_reduction(probe.get(block))
    reads = [r for r in probe.get(block).reads if any(r.source.same_as(v) for v in varying)]
    if reads and all(last_dim_stride(r, r_vars[-1]) == 1 for r in reads):
        inline_all(sch)
        return
    for blk in sch.get_producers(block):
        try_primitive(sch.compute_inline, blk)


def _partial_sums(extent: int | None, lanes: int) -> int | None:
    """How many partial sums (vector lanes) the reduction keeps: a full vector when ``lanes``
    divides the extent, else the widest divisor of it from 4 to ``MAX_PARTIAL_SUMS`` that still
    leaves two steps (13 for a 13x13 plane, 7 for 7x7, 14 for 14x14: LLVM splits or widens the
    odd vector); None when there is none (a 19x19 plane, tiny ones: one scalar chain). Without
    lanes the sum is one scalar chain, an add latency per element: 1000 channels' 13x13 mean
    0.057 ms -> 0.023, 1280x7x7 0.046 -> 0.021, 672x14x14 0.052 -> 0.009 (2 threads, znver4)."""
    if extent is None:
        return None
    if extent % lanes == 0 and extent >= 2 * lanes:
        return lanes
    fits = [v for v in range(4, MAX_PARTIAL_SUMS + 1) if extent % v == 0 and extent >= 2 * v]
    return fits[-1] if fits else None


def _contiguous(region, r_vars) -> bool:
    """Whether the reduction iters index the operand's trailing dims, in order (so fusing them
    walks it linearly)."""
    dims = []
    for var in r_vars:
        d = bare_var_dim(region, var)
        if d is None:
            return False
        dims.append(d)
    ndim = len(region.region)
    return dims == list(range(ndim - len(dims), ndim))

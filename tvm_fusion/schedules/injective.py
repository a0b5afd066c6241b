"""Parallel + vectorized schedule for PrimFuncs made only of spatial (injective) blocks.

Elementwise chains, broadcasts, reshapes/transposes and pads: inline everything inlinable, then
each remaining output nest gets its leading loops fused and parallel (enough iterations for the
cores, no more, so the inner loops keep simple affine indices) and its innermost loop vectorized.

A transpose (NHWC -> NCHW around ConvNeXt's channels-last MLP, SqueezeBERT's NCW layer norms)
reads its input across the lines it writes along: vectorized along the output, every lane is a
load from another cache line. Such a nest is tiled instead (``TRANSPOSE_TILES``): a vector along
the input's contiguous dim, the output's dims outside it, so each input line is read once whole
and each output line is filled by consecutive iterations while it is in L1.
"""

from __future__ import annotations

import math

from tvm import tirx
from tvm.s_tir.dlight.base import try_inline
from tvm.target import Target

from ._util import (
    PARALLEL_MIN_ELEMENTS,
    CpuRule,
    access_class,
    bare_var_dim,
    num_cores,
    safe_rule,
    schedule_injective_block,
    vector_lanes,
)

TRANSPOSE_TILES = True


class Injective(CpuRule):
    """All blocks spatial: inline, then parallel outer loops + vectorized inner loop."""

    @safe_rule
    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool):
        opened = self.normalized(func, target)
        if opened is None:
            return None
        sch, infos = opened
        if not all(b.is_injective() for b in infos):
            return None
        if any(sch.get(b.block_rv).init is not None for b in infos):
            # A reduction whose loops all have extent 1 (a 1x1 depthwise conv) looks injective once
            # dlight drops unit loops, but inlining an epilogue into a block with an init puts the
            # epilogue into both init and update (the bias would be added twice). Leave it to
            # Contraction.
            return None
        remaining = try_inline(sch, infos)
        for info in remaining:
            dom = info.dom()
            small = all(isinstance(d, int) for d in dom) and math.prod(dom) < PARALLEL_MIN_ELEMENTS
            transposed = _transposed_iter(sch, info, target) if TRANSPOSE_TILES else None
            if transposed is not None:
                _schedule_transpose(sch, info, transposed, target, parallel=not small)
            else:
                schedule_injective_block(sch, info.block_rv, target, parallel=not small)
        return sch


def _transposed_iter(sch, info, target):
    """The iter that indexes the contiguous dim of a transposed read, when the block has one: a
    read that the output's contiguous iter moves by a stride, whose last dim is exactly another
    iter of whole SIMD vectors. Whole vectors is what measured: NCHW -> NHWC at 56x56 with
    14-lane vectors along the input ran 1.8x slower than the output-vectorized nest."""
    stmt = sch.get(info.block_rv)
    if len(stmt.writes) != 1 or not all(isinstance(it.dom, int) for it in info.iters):
        return None
    out = stmt.writes[0]
    lanes = vector_lanes(target, out.source.dtype)
    inner = [it for it in info.iters if bare_var_dim(out, it.var) == len(out.region) - 1]
    if len(inner) != 1:
        return None
    for read in stmt.reads:
        if access_class(read, inner[0].var) != "strided":
            continue
        for it in info.iters:
            if (
                it is not inner[0]
                and bare_var_dim(read, it.var) == len(read.region) - 1
                and it.dom % lanes == 0
            ):
                return it
    return None


def _schedule_transpose(sch, info, transposed, target, parallel: bool) -> None:
    """One vector along the transposed read's iter innermost, the output's contiguous iter just
    outside it (consecutive iterations fill each output line), the other loops outside both in
    their order; the leading loops parallel until there is enough work for the cores."""
    stmt = sch.get(info.block_rv)
    out = stmt.writes[0]
    lanes = vector_lanes(target, out.source.dtype)
    outer, vec = sch.split(transposed.loop_rv, factors=[None, lanes])
    (inner,) = [it for it in info.iters if bare_var_dim(out, it.var) == len(out.region) - 1]
    loops = [outer if it is transposed else it.loop_rv for it in info.iters if it is not inner]
    loops.append(inner.loop_rv)
    sch.reorder(*loops, vec)
    if parallel:
        k, work = 0, 1
        while k < len(loops) and work < 16 * num_cores(target):
            work *= sch.get(loops[k]).extent.value
            k += 1
        sch.parallel(sch.fuse(*loops[:k]) if k > 1 else loops[0])
    sch.vectorize(vec)

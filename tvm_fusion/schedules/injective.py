"""Parallel + vectorized schedule for PrimFuncs made only of spatial (injective) blocks.

Elementwise chains, broadcasts, reshapes/transposes and pads: inline everything inlinable, then
each remaining output nest gets its leading loops fused and parallel (enough iterations for the
cores, no more, so the inner loops keep simple affine indices) and its innermost loop vectorized.
"""

from __future__ import annotations

import math

from tvm import tirx
from tvm.s_tir.dlight.base import try_inline
from tvm.target import Target

from ._util import PARALLEL_MIN_ELEMENTS, CpuRule, safe_rule, schedule_injective_block


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
            schedule_injective_block(sch, info.block_rv, target, parallel=not small)
        return sch

"""Row reductions (softmax, layer_norm, RMS norm): dlight's CPU Reduction, applied only where safe.

``dlight.cpu.Reduction`` parallelizes the shared leading spatial axes and computes every block per
row. That is right for softmax / layer_norm, but it would also accept a conv + bias (one reduction
then injective), computing each output element in its own parallel iteration; so this rule only
hands over functions with at least two reduction blocks (the Contraction rule takes single ones).
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.s_tir.dlight.cpu import Reduction as _DlightReduction
from tvm.target import Target

from ._util import is_cpu, safe_rule


class RowReduction(ScheduleRule):
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
        return self._inner.apply(func, target, tunable)

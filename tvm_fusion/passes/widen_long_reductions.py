"""WidenLongReductions: float32 ``mean`` / ``variance`` / ``sum`` over many elements accumulate in float64.

Our reduction schedules sum in SIMD lanes, each lane a sequential float32 chain of ``n / lanes``
adds, so the rounding error of a sum grows with its length. A GroupNorm group of a 114x114 map
with 2 channels (BiT's stem: 25,992 elements) then comes out of normalization with 4.2e-6 relative
error where ONNX Runtime's has 4.7e-7 (both against float64 on the same input); through BiT's 53
normalized convs that became 1.5e-4 at the output, five times ONNX Runtime's error. Summed in
float64 (converted as it is read, inside the same kernel) the chains lose nothing that matters, and
since a long reduction reads its whole operand from memory, the wider adds cost about nothing.

Reductions over fewer than ``MIN_ELEMENTS`` elements (a LayerNorm row of a small transformer, a
global average pool of a 7x7 map) keep float32: their chains are short. Longer ones are widened
whatever they compute (an RMSNorm's mean of squares over a 4,096-wide hidden state too, which
``RecognizeRMSNorm`` leaves as a mean on CPU for that reason). CPU only (the pipeline adds it for
LLVM targets): GPU reductions sum in trees.
"""

from __future__ import annotations

import math

import tvm
from tvm import relax

from ..ir import dtype_of, op_name, rewrite_functions, static_shape

__all__ = ["MIN_ELEMENTS", "WidenLongReductions"]

MIN_ELEMENTS = 1024
_REDUCTIONS = {"relax.mean", "relax.variance", "relax.sum"}


def _reduced_elements(call: relax.Call) -> int | None:
    shape = static_shape(call.args[0])
    if shape is None:
        return None
    axes = call.attrs.axis
    if axes is None:
        return math.prod(shape)
    return math.prod(shape[int(a) % len(shape)] for a in axes)


def _applies(call: relax.Call) -> bool:
    if op_name(call) not in _REDUCTIONS or dtype_of(call.args[0]) != "float32":
        return False
    elements = _reduced_elements(call)
    return elements is not None and elements >= MIN_ELEMENTS


@relax.expr_functor.mutator
class _Widen(relax.PyExprMutator):
    def visit_call_(self, call):
        call = super().visit_call_(call)
        if not _applies(call):
            return call
        wide = self.builder_.emit(relax.op.astype(call.args[0], "float64"))
        reduced = self.builder_.emit(relax.Call(call.op, [wide], call.attrs))
        return relax.op.astype(reduced, "float32")


@tvm.transform.module_pass(opt_level=0, name="WidenLongReductions")
class WidenLongReductions:
    """Sum float32 reductions of at least ``MIN_ELEMENTS`` elements in float64 (see module doc)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return rewrite_functions(mod, _REDUCTIONS, _applies, _Widen)

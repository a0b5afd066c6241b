"""RemoveEmptyTensors: no kernel computes a tensor with no elements.

Why: Phi-3's rotary embedding is ``concat([rotated, x[..., rotary_dim:]], -1)``, and with the
rotary dimension the whole head the pass-through part is empty (``[1, 8, 128, 0]``). TVM lowered
that ``strided_slice`` to a kernel whose innermost loop has extent 0, which LLVM codegen refuses
to vectorize, so the whole build failed. An empty operand adds nothing to a ``concat``: it is
dropped (a ``concat`` of one operand is that operand), and any other op whose result is statically
empty becomes an empty constant, so nothing is left to lower. Exact; static shapes only.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from ..ir import graph_functions, op_name, static_shape, with_functions

__all__ = ["RemoveEmptyTensors"]


def _empty(expr) -> bool:
    shape = static_shape(expr)
    return shape is not None and 0 in shape


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    def visit_call_(self, call):
        call = super().visit_call_(call)
        if not isinstance(call.op, tvm.ir.Op) or isinstance(call.ty, relax.TupleType):
            return call
        if _empty(call) and isinstance(call.ty, relax.TensorType) and call.ty.dtype is not None:
            return relax.const(np.empty(static_shape(call), str(call.ty.dtype)), str(call.ty.dtype))
        if op_name(call) == "relax.concat" and isinstance(call.args[0], relax.Tuple):
            parts = [part for part in call.args[0].fields if not _empty(part)]
            if len(parts) == len(call.args[0].fields):
                return call
            return parts[0] if len(parts) == 1 else relax.op.concat(parts, call.attrs.axis)
        return call


@tvm.transform.module_pass(opt_level=0, name="RemoveEmptyTensors")
class RemoveEmptyTensors:
    """Drop empty ``concat`` operands; make every other statically empty op result a constant."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        updates = {}
        for gvar, func in graph_functions(mod):
            if not any(_empty(binding.var) for block in func.body.blocks for binding in block.bindings):
                continue
            updates[gvar] = relax.analysis.remove_all_unused(_Rewriter(mod).visit_expr(func))
        return with_functions(mod, updates)

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

from ..ir import op_name, rewrite_and_prune, static_shape

__all__ = ["RemoveEmptyTensors"]


def _empty(expr) -> bool:
    shape = static_shape(expr)
    return shape is not None and 0 in shape


def _parts(concat: relax.Call) -> list:
    return list(concat.args[0].fields) if isinstance(concat.args[0], relax.Tuple) else []


def _removable(call: relax.Call) -> bool:
    """An op call with a statically empty tensor result, or a ``concat`` with an empty operand."""
    if not isinstance(call.op, tvm.ir.Op) or not isinstance(call.ty, relax.TensorType):
        return False
    if _empty(call):
        return str(call.ty.dtype) not in ("", "void")
    return op_name(call) == "relax.concat" and any(_empty(part) for part in _parts(call))


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    def __init__(self, mod):
        super().__init__(mod)
        self.rewrote = False

    def visit_call_(self, call):
        call = super().visit_call_(call)
        if not _removable(call):
            return call
        self.rewrote = True
        if _empty(call):
            dtype = str(call.ty.dtype)
            return relax.const(np.empty(static_shape(call), dtype), dtype)
        parts = [part for part in _parts(call) if not _empty(part)]
        return parts[0] if len(parts) == 1 else relax.op.concat(parts, call.attrs.axis)


@tvm.transform.module_pass(opt_level=0, name="RemoveEmptyTensors")
class RemoveEmptyTensors:
    """Drop empty ``concat`` operands; make every other statically empty op result a constant."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return rewrite_and_prune(mod, _needs_rewrite, lambda func: _Rewriter(mod))


def _needs_rewrite(func: relax.Function) -> bool:
    found = []
    relax.analysis.post_order_visit(
        func.body,
        lambda expr: found.append(expr) if isinstance(expr, relax.Call) and _removable(expr) else None,
    )
    return bool(found)

"""BindUnknownShapes: give every tensor of data-dependent shape symbolic dims before FoldConstant.

A genuinely data-dependent op (``R.dynamic_strided_slice`` whose bounds are computed at run time,
as an ONNX ``Slice`` with computed ends imports) has a result type that knows only its rank, and
every op downstream inherits the unknown shape. TVM 0.27's ``FoldConstant`` legalizes *every*
call in a dataflow block to see whether it folds, which breaks twice on such a graph:

- legalizing an op on a tensor of unknown shape asserts ("emit_te now only supports Tensor that
  has ShapeExpr shape"), constant inputs or not;
- legalizing the data-dependent op itself emits helper bindings (a ``call_tir`` to a generated
  ``shape_func`` and a ``match_cast``) that FoldConstant keeps although it drops the generated
  PrimFunc, leaving a call to an undefined function.

This pass lowers each data-dependent op up front with its own legalization, run by a builder
attached to the module (so its ``shape_func`` lands in the module and its result gets symbolic
dims from the run-time shape), the way ``LegalizeOps`` later would. A tensor of unknown shape that
legalization cannot shape is bound with ``R.match_cast`` to fresh symbolic dims ``(d0, d1, ...)``
instead: the value is untouched, and everything downstream gets a ``ShapeExpr``.
"""

from __future__ import annotations

import tvm
from tvm import relax

__all__ = ["BindUnknownShapes"]


@tvm.transform.module_pass(opt_level=0, name="BindUnknownShapes")
class BindUnknownShapes:
    """Lower data-dependent ops (or match-cast their results) to symbolic shapes (see module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        todo = [
            (gvar, func)
            for gvar, func in mod.functions_items()
            if isinstance(func, relax.Function) and _has_unknown_shape(func)
        ]
        if not todo:
            return mod
        binder = _Binder(mod)
        for gvar, func in todo:
            binder.builder_.update_func(gvar, relax.analysis.remove_all_unused(binder.visit_expr(func)))
        return binder.builder_.get()


def _unknown_shape(ty) -> bool:
    return isinstance(ty, relax.TensorType) and ty.shape is None and ty.ndim >= 0


def _has_unknown_shape(func: relax.Function) -> bool:
    found = []
    relax.analysis.post_order_visit(
        func, lambda e: found.append(e) if isinstance(e, relax.Var) and _unknown_shape(e.ty) else None
    )
    return bool(found)


def _legalizer(value):
    if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op):
        return value.op.get_attr("FLegalize")
    return None


@relax.expr_functor.mutator
class _Binder(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule):
        super().__init__(mod)
        self.count = 0

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = self.visit_expr(binding.value)
        if not _unknown_shape(value.ty) or isinstance(value, relax.Var):
            super().visit_var_binding_(binding)
            return
        var = binding.var
        dataflow_out = not isinstance(var, relax.DataflowVar) and self.builder_.current_block_is_dataflow()
        legalize = _legalizer(value)
        if legalize is not None:
            try:
                lowered = self.builder_.normalize(legalize(self.builder_, value))
            except Exception:  # a legalization that needs shapes too: fall back to match_cast
                lowered = None
            if lowered is not None and not _unknown_shape(lowered.ty):
                emit = self.builder_.emit_output if dataflow_out else self.builder_.emit
                self.set_var_remap(var, emit(lowered, name_hint=var.name))
                return
        computed = self.builder_.emit(value, name_hint=f"{var.name}_unshaped")
        dims = []
        for _ in range(value.ty.ndim):
            dims.append(tvm.tirx.Var(f"d{self.count}", "int64"))
            self.count += 1
        shaped = self.builder_.match_cast(computed, relax.TensorType(dims, value.ty.dtype, value.ty.vdevice))
        if dataflow_out:
            shaped = self.builder_.emit_output(shaped, name_hint=var.name)
        self.set_var_remap(var, shaped)

"""RemoveInferenceDropout: ``dropout(x)`` is ``x`` when the model runs for inference.

Why: an ONNX ``Dropout`` that an exporter left in the graph (torch's dynamo exporter keeps one
per ``nn.Dropout`` of a module traced outside ``eval()`` mode, with ``training_mode`` false)
imports as ``R.nn.dropout``, a tuple of the output and a mask. TVM legalizes it to a kernel that
copies ``x`` and writes a mask of ones, two full-size writes per dropout, and the copy splits
the kernels around it (a GEMM's bias and residual add no longer fuse across it). The output is
now ``x`` itself and the mask ``ones_like(x)`` (read by nothing in the exports seen), as ONNX
Runtime does with its dropout elimination. Every dropout counts as inference: TVM's ONNX frontend
ignores ``training_mode`` too, and tvm_fusion builds models for inference.
"""

from __future__ import annotations

import tvm
from tvm import relax

from ..ir import graph_functions, op_calls, op_name, with_functions

__all__ = ["RemoveInferenceDropout"]

_DROPOUT = "relax.nn.dropout"


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    def visit_tuple_getitem_(self, item):
        item = super().visit_tuple_getitem_(item)
        source = item.tuple_value
        dropout = self.lookup_binding(source) if isinstance(source, relax.Var) else None
        if op_name(dropout) != _DROPOUT:
            return item
        data = dropout.args[0]
        return data if item.index == 0 else relax.op.ones_like(data)


@tvm.transform.module_pass(opt_level=0, name="RemoveInferenceDropout")
class RemoveInferenceDropout:
    """Replace each inference ``dropout``'s output by its input (and its mask by ones)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        updates = {
            gvar: relax.analysis.remove_all_unused(_Rewriter(mod).visit_expr(func))
            for gvar, func in graph_functions(mod)
            if op_calls(func, {_DROPOUT})
        }
        if not updates:
            return mod
        # `y = x` aliases left where the dropout was: passes that walk producers see x's op again
        # (only in the functions rewritten here; the others, kernels included, stay as they are)
        canonical = relax.transform.CanonicalizeBindings()(with_functions(mod, updates))
        return with_functions(mod, {gvar: canonical[gvar] for gvar in updates})

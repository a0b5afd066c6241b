"""SimplifyUnitPermutes: a ``permute_dims`` that moves only size-1 axes is a ``reshape``.

Why: ``nn.MultiheadAttention`` with ``batch_first=False`` (torchvision's ViT) transposes
``[batch, seq, dim]`` to ``[seq, batch, dim]`` and back around every attention block. At batch 1
that moves no data, yet each ``permute_dims`` became a copy kernel, and the one between the
block's layer norm and its Q/K/V GEMM kept the norm out of the GEMM (the policy fuses
``norm -> gemm``, not ``norm -> injective -> gemm``). As a ``reshape`` it is a free view.

Second rewrite, for the same reason: ``reshape(layer_norm(x))`` whose reshape keeps the normalized
trailing axes, and whose norm has no other use, becomes ``layer_norm(reshape(x))``: the same values
(the norm sees the same rows), and the norm now feeds its GEMM directly.

Both are exact. Axes of symbolic size are never taken as size 1. The hoist runs only in functions
that had a unit-axis permute: GPT-2's flattening reshape after each layer norm would also qualify
(its 24 norms would fuse into their GEMMs), which is not measured yet.
"""

from __future__ import annotations

import tvm
from tvm import relax

from ..ir import UseCountingMutator, count_uses, graph_functions, op_name, shape_dims, with_functions

__all__ = ["SimplifyUnitPermutes", "moves_only_unit_axes"]


def moves_only_unit_axes(call: relax.Call) -> bool:
    """True for a ``permute_dims`` whose axes of size other than 1 keep their order."""
    if op_name(call) != "relax.permute_dims":
        return False
    dims = shape_dims(call.args[0])
    if dims is None:
        return False
    rank = len(dims)
    axes = list(range(rank))[::-1] if call.attrs.axes is None else [int(a) % rank for a in call.attrs.axes]
    kept = [a for a in axes if dims[a] != 1]
    return kept == sorted(kept)


def _trailing_norm_axes(call: relax.Call) -> int | None:
    """How many trailing axes a ``layer_norm`` normalizes (None: not a trailing run)."""
    dims = shape_dims(call.args[0])
    if dims is None:
        return None
    rank = len(dims)
    axes = sorted(int(a) % rank for a in call.attrs.axes)
    return len(axes) if axes == list(range(rank - len(axes), rank)) else None


@relax.expr_functor.mutator
class _Rewriter(UseCountingMutator):  # the hoist needs a norm nothing else reads
    def visit_call_(self, call):
        call = super().visit_call_(call)
        if moves_only_unit_axes(call):
            return relax.op.reshape(call.args[0], call.ty.shape)
        if op_name(call) == "relax.reshape":
            return self._hoist_over_layer_norm(call)
        return call

    def _hoist_over_layer_norm(self, reshape: relax.Call) -> relax.Call:
        norm = self.single_use_binding(reshape.args[0])
        if op_name(norm) != "relax.nn.layer_norm":
            return reshape
        k = _trailing_norm_axes(norm)
        before, after = shape_dims(norm), shape_dims(reshape)
        if k is None or before is None or after is None or len(after) < k:
            return reshape
        if None in before[-k:] or tuple(before[-k:]) != tuple(after[-k:]):
            return reshape
        a = norm.attrs
        rank = len(after)
        return relax.op.nn.layer_norm(
            self.builder_.emit(relax.op.reshape(norm.args[0], reshape.ty.shape)),
            norm.args[1],
            norm.args[2],
            axes=list(range(rank - k, rank)),
            epsilon=float(a.epsilon),
            center=bool(a.center),
            scale=bool(a.scale),
        )


@tvm.transform.module_pass(opt_level=0, name="SimplifyUnitPermutes")
class SimplifyUnitPermutes:
    """Rewrite ``permute_dims`` of size-1 axes only to ``reshape``, and move a ``reshape`` that
    keeps a layer norm's axes in front of the norm."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        updates = {}
        for gvar, func in graph_functions(mod):
            # the hoist runs only where a unit permute was rewritten (see the module docstring)
            if not any(moves_only_unit_axes(b.value) for block in func.body.blocks for b in block.bindings):
                continue
            func = _Rewriter(mod, {}).visit_expr(func)  # permutes -> reshapes
            func = _Rewriter(mod, count_uses(func)).visit_expr(func)  # reshapes over norms
            updates[gvar] = relax.analysis.remove_all_unused(func)
        return with_functions(mod, updates)

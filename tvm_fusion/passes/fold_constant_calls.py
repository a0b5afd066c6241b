"""FoldConstantCalls: evaluate every ``call_tir`` on constants with one compiled module.

``relax.transform.FoldConstant`` evaluates a ``call_tir`` whose arguments are all constants by
building its PrimFunc with LLVM on its own, one module per function. After the schedules pack
constant weights (``SplitLayoutRewritePreproc`` makes one ``*_weight_prepack`` PrimFunc per
packed weight), that is one LLVM build per weight shape: DenseNet-121 has 64, and FoldConstant
took 12 s of its build for them. Put into one module, the same functions build in ~1.6 s (the
fixed cost of a build is paid once).

This pass collects those calls, builds their PrimFuncs together, runs them and binds the results
as new constants, one per distinct (function, argument contents): a weight shared by several
layers is packed once; ``FoldConstant`` afterwards finds nothing expensive left. Calls with symbolic
shapes, tuple outputs or non-tensor arguments are left to ``FoldConstant``.
"""

from __future__ import annotations

import hashlib

import numpy as np
import tvm
from tvm import relax

__all__ = ["FoldConstantCalls"]

_CALL_TIR = tvm.ir.Op.get("relax.call_tir")
_Const = tvm.ir.expr.Constant


def _static_shape(ty) -> list[int] | None:
    if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
        return None
    try:
        return [int(d) for d in ty.shape.values]
    except (TypeError, ValueError):
        return None


def _fingerprint(array: np.ndarray) -> tuple:
    """Shape, dtype and a digest of the contents: calls that pack the same weight (ALBERT's 12
    layers share one set; an export may also repeat a tensor) fold into one constant, not one
    copy per call (ALBERT-base: 356 MB of constants for 44 MB of weights before)."""
    data = np.ascontiguousarray(array)
    return (
        data.shape,
        str(data.dtype),
        hashlib.blake2b(data.view(np.uint8).reshape(-1), digest_size=20).digest(),
    )


def _foldable(call, mod) -> bool:
    if not (isinstance(call, relax.Call) and call.op.same_as(_CALL_TIR)) or len(call.args) != 2:
        return False
    gvar, args = call.args
    return (
        isinstance(gvar, relax.GlobalVar)
        and isinstance(mod[gvar], tvm.tirx.PrimFunc)
        and isinstance(args, relax.Tuple)
        and all(isinstance(a, _Const) for a in args.fields)
        and _static_shape(call.ty) is not None
    )


@relax.expr_functor.mutator
class _Replace(relax.PyExprMutator):
    def __init__(self, mod, values):
        super().__init__(mod)
        self.values = values  # call -> its folded relax constant

    def visit_call_(self, call):
        folded = self.values.get(call)
        return folded if folded is not None else super().visit_call_(call)


@tvm.transform.module_pass(opt_level=0, name="FoldConstantCalls")
class FoldConstantCalls:
    """Evaluate all constant ``call_tir``s of a module with one build of their PrimFuncs.

    Parameters
    ----------
    target : Target | str
        Where to run them (default: the host CPU, as ``FoldConstant`` does).
    """

    def __init__(self, target="llvm"):
        self.target = target

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        calls = []

        def visit(expr):
            if _foldable(expr, mod):
                calls.append(expr)

        for func in mod.functions.values():
            if isinstance(func, relax.Function):
                relax.analysis.post_order_visit(func, visit)
        if not calls:
            return mod
        names = sorted({call.args[0].name_hint for call in calls})
        prims = tvm.IRModule({name: mod[name].with_attr("global_symbol", name) for name in names})
        target = tvm.target.Target(self.target) if isinstance(self.target, str) else self.target
        lib = tvm.compile(prims, target=target)
        values = {}  # keyed by the call node itself (ObjectRef hashing: node identity)
        folded = {}  # (function, its arguments' contents) -> the one constant for every such call
        for call in calls:
            arrays = [a.value.numpy() for a in call.args[1].fields]
            shape = _static_shape(call.ty)
            key = (call.args[0].name_hint, tuple(shape), call.ty.dtype, *map(_fingerprint, arrays))
            if key not in folded:
                out = tvm.runtime.empty(shape, call.ty.dtype)
                lib[call.args[0].name_hint](*map(tvm.runtime.tensor, arrays), out)
                folded[key] = relax.const(out.numpy())
            values[call] = folded[key]
        for gvar, func in list(mod.functions.items()):
            if isinstance(func, relax.Function):
                mod[gvar] = _Replace(mod, values).visit_expr(func)
        return relax.transform.DeadCodeElimination()(mod)

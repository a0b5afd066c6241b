"""CanonicalizeActivations: turn exporter-spelled GELU, SiLU, HardSwish and Clip back into single ops.

ONNX below opset 20 has no GELU, so exporters write ``x * 0.5 * (1 + erf(x / sqrt(2)))``: five ops
whose ``x`` feeds two branches. The unique-consumer rule rightly refuses to fuse across that
diamond, so ``matmul -> add -> gelu`` would cost three kernels instead of one. Rewriting the
subgraph to ``R.nn.gelu(x)`` (same formula after legalisation) makes it a plain epilogue.
GPT-2's tanh form ``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3)))`` becomes
``R.nn.gelu_tanh(x)`` (its ``x**3`` was a ``powf`` call per element, 18% of GPT-2's time); other
``x ** 2`` / ``x ** 3`` become products. Likewise ``x * sigmoid(x)`` becomes ``R.nn.silu(x)``,
ONNX HardSwish's ``x * (clip(x + 3, 0, 6) / 6)`` (opset 14 on; older exports write
``x * HardSigmoid(x)``, left as it is) becomes ``R.nn.hardswish`` (an op of ours,
``tvm_fusion/ops.py``), and the Relax ONNX frontend's Clip, which it
emits as opaque ``call_tir(maximum)`` / ``call_tir(minimum)`` TE kernels, becomes ``R.clip`` (or
``R.maximum`` / ``R.minimum``), so later passes see a named elementwise op instead of a black box.

Matching is done on the dataflow graph (any association/commutation of the multiplies, ``x * c``
or ``x / sqrt(2)`` inside erf); the replaced binding keeps its variable, and the now-dead
intermediates are removed by dead-code elimination.
"""

from __future__ import annotations

import math

import tvm
import tvm_ffi
from tvm import relax

from ..ir import graph_functions, is_float_dtype, scalar_value, with_bindings
from ..ops import hardswish

_INV_SQRT2 = 1.0 / math.sqrt(2.0)


def _op(expr, var2val, name):
    """The call bound to ``expr`` if it is ``relax.<name>``, else None."""
    value = var2val.get(expr) if isinstance(expr, relax.Var) else expr
    if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and value.op.name == f"relax.{name}":
        return value
    return None


def _factors(expr, var2val, depth=2) -> list:
    """Flatten a product tree ``a * (b * c)`` into its leaves, up to ``depth`` levels."""
    call = _op(expr, var2val, "multiply")
    if call is None or depth == 0:
        return [expr]
    return [leaf for arg in call.args for leaf in _factors(arg, var2val, depth - 1)]


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _scaled(expr, var2val, value):
    """y if ``expr`` is ``y * value`` (either order), else None."""
    mul = _op(expr, var2val, "multiply")
    if mul is None:
        return None
    for y, c in (mul.args, mul.args[::-1]):
        scale = scalar_value(c, var2val)
        if scale is not None and math.isclose(scale, value, rel_tol=1e-4):
            return y
    return None


def _erf_input(expr, var2val):
    """x if ``expr`` is ``erf(x * 1/sqrt2)`` or ``erf(x / sqrt2)``."""
    erf = _op(expr, var2val, "erf")
    if erf is None:
        return None
    x = _scaled(erf.args[0], var2val, _INV_SQRT2)
    if x is not None:
        return x
    div = _op(erf.args[0], var2val, "divide")
    if div is not None:
        scale = scalar_value(div.args[1], var2val)
        if scale is not None and math.isclose(scale, math.sqrt(2.0), rel_tol=1e-4):
            return div.args[0]
    return None


def _is_cube_of(expr, x, var2val) -> bool:
    power = _op(expr, var2val, "power")
    return power is not None and power.args[0].same_as(x) and scalar_value(power.args[1], var2val) == 3.0


def _tanh_gelu_input(expr, var2val):
    """x if ``expr`` is ``tanh(sqrt(2/pi) * (x + 0.044715 * x**3))``."""
    tanh = _op(expr, var2val, "tanh")
    inner = _scaled(tanh.args[0], var2val, _SQRT_2_OVER_PI) if tanh is not None else None
    add = _op(inner, var2val, "add") if inner is not None else None
    if add is None:
        return None
    for x, cubic in (add.args, add.args[::-1]):
        cube = _scaled(cubic, var2val, 0.044715)
        if cube is not None and _is_cube_of(cube, x, var2val):
            return x
    return None


def _half_x_one_plus(var, var2val, inner_input):
    """x if ``var`` is ``0.5 * x * (1 + g)`` (any order of the product) where
    ``inner_input(g)`` is that same x: the shape both GELU spellings share."""
    leaves = _factors(var, var2val)
    if len(leaves) != 3:
        return None
    half = [
        leaf for leaf in leaves if (s := scalar_value(leaf, var2val)) is not None and math.isclose(s, 0.5)
    ]
    if len(half) != 1:
        return None
    for one_plus in leaves:
        add = _op(one_plus, var2val, "add")
        if add is None:
            continue
        for g, one in (add.args, add.args[::-1]):
            if scalar_value(one, var2val) != 1.0:
                continue
            x = inner_input(g, var2val)
            rest = [leaf for leaf in leaves if not leaf.same_as(one_plus) and not leaf.same_as(half[0])]
            if x is not None and len(rest) == 1 and rest[0].same_as(x):
                return x
    return None


def _match_gelu(var, var2val):
    """``0.5 * x * (1 + erf(x / sqrt2))`` (ONNX below opset 20)."""
    x = _half_x_one_plus(var, var2val, _erf_input)
    return relax.op.nn.gelu(x) if x is not None else None


def _match_gelu_tanh(var, var2val):
    """``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3)))`` (GPT-2's "new GELU")."""
    x = _half_x_one_plus(var, var2val, _tanh_gelu_input)
    return relax.op.nn.gelu_tanh(x) if x is not None else None


def _match_small_power(var, var2val):
    """``x ** 2`` / ``x ** 3`` with a constant exponent: products (RMS norms square, tanh-GELU
    cubes), which fuse as elementwise ops and need no ``powf`` call per element."""
    power = _op(var, var2val, "power")
    exponent = scalar_value(power.args[1], var2val) if power is not None else None
    if exponent not in (2.0, 3.0):
        return None
    x = power.args[0]
    if not tvm_ffi.structural_equal(x.ty, power.ty):
        return None  # the exponent broadcasts the result
    square = relax.op.multiply(x, x)
    return square if exponent == 2.0 else relax.op.multiply(square, x)


def _tir_clamp(expr, var2val, mod):
    """``(kind, x, bound)`` for ``call_tir(maximum|minimum, (x, scalar_const))`` emitted by the frontend."""
    value = var2val.get(expr) if isinstance(expr, relax.Var) else expr
    if not (
        isinstance(value, relax.Call)
        and isinstance(value.op, tvm.ir.Op)
        and value.op.name == "relax.call_tir"
    ):
        return None
    gvar, args = value.args[0], value.args[1]
    kind = gvar.name_hint.rstrip("0123456789")
    if kind not in ("maximum", "minimum") or not isinstance(args, relax.Tuple) or len(args.fields) != 2:
        return None
    x, bound = args.fields
    scalar = scalar_value(bound, var2val)
    func = mod[gvar] if mod is not None and gvar in mod.get_global_vars() else None
    if scalar is None or func is None or len(func.params) != 3:
        return None
    if not isinstance(x.ty, relax.TensorType) or not tvm_ffi.structural_equal(x.ty, value.ty):
        return None
    op = "T.max(" if kind == "maximum" else "T.min("
    if op not in func.script():
        return None  # a PrimFunc that only shares the name
    return kind, x, scalar


def _match_clip(var, var2val, mod):
    outer = _tir_clamp(var, var2val, mod)
    if outer is None:
        return None
    kind, x, bound = outer
    inner = _tir_clamp(x, var2val, mod)
    if inner is not None and inner[0] != kind:
        lo, hi = (inner[2], bound) if kind == "minimum" else (bound, inner[2])
        return relax.op.clip(inner[1], lo, hi)
    const = relax.const(bound, x.ty.dtype)
    return relax.op.maximum(x, const) if kind == "maximum" else relax.op.minimum(x, const)


def _match_silu(var, var2val):
    call = _op(var, var2val, "multiply")
    if call is None:
        return None
    for x, s in (call.args, call.args[::-1]):
        sig = _op(s, var2val, "sigmoid")
        if sig is not None and sig.args[0].same_as(x):
            return relax.op.nn.silu(x)
    return None


def _relu6_shifted_input(expr, var2val):
    """x if ``expr`` is ``clip(x + 3, 0, 6)``."""
    clip = _op(expr, var2val, "clip")
    bounds = [getattr(a, "value", None) for a in clip.args[1:]] if clip is not None else None
    if bounds != [0, 6]:  # the bounds are prim immediates (IntImm / FloatImm)
        return None
    add = _op(clip.args[0], var2val, "add")
    if add is None:
        return None
    for x, c in (add.args, add.args[::-1]):
        if scalar_value(c, var2val) == 3.0:
            return x
    return None


def _match_hardswish(var, var2val):
    """``x * (clip(x + 3, 0, 6) / 6)`` (the ONNX frontend's HardSwish), in either operand order."""
    call = _op(var, var2val, "multiply")
    if call is None:
        return None
    for x, gate in (call.args, call.args[::-1]):
        div = _op(gate, var2val, "divide")
        if div is None or scalar_value(div.args[1], var2val) != 6.0:
            continue
        if (inner := _relu6_shifted_input(div.args[0], var2val)) is not None and inner.same_as(x):
            if tvm_ffi.structural_equal(x.ty, call.ty):
                return hardswish(x)
    return None


@tvm.transform.module_pass(opt_level=0, name="CanonicalizeActivations")
class CanonicalizeActivations:
    """Rewrite erf-spelled GELU to ``nn.gelu``, tanh-spelled GELU to ``nn.gelu_tanh``,
    ``x * sigmoid(x)`` to ``nn.silu``, ``x * (clip(x + 3, 0, 6) / 6)`` to ``nn.hardswish`` and ``x ** 2`` / ``x ** 3`` to products."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        changed = False
        mod = tvm.IRModule(dict(mod.functions.items()), attrs=mod.attrs)  # never edit the caller's module
        for gvar, func in list(graph_functions(mod)):
            if not isinstance(func.body, relax.SeqExpr):
                continue
            for _ in range(3):  # a rewritten Clip can complete a HardSwish pattern: look again
                new_func = _rewrite(func, mod)
                if new_func is None:
                    break
                mod[gvar] = new_func
                mod = relax.transform.Normalize()(mod)
                func = mod[gvar]
                changed = True
        if not changed:
            return mod
        return relax.transform.DeadCodeElimination()(relax.transform.Normalize()(mod))


def _rewrite(func: relax.Function, mod: tvm.IRModule | None = None) -> relax.Function | None:
    var2val = relax.analysis.get_var2val(func)
    replace = {}
    for block in func.body.blocks:
        for binding in block.bindings:
            if isinstance(binding, relax.VarBinding) and isinstance(binding.var.ty, relax.TensorType):
                replacement = _match_gelu(binding.var, var2val)
                if replacement is None:
                    replacement = _match_gelu_tanh(binding.var, var2val)
                if replacement is None:
                    replacement = _match_silu(binding.var, var2val)
                if replacement is None:
                    replacement = _match_hardswish(binding.var, var2val)
                if replacement is None:
                    replacement = _match_small_power(binding.var, var2val)
                if replacement is None:
                    replacement = _match_clip(binding.var, var2val, mod)
                if replacement is not None and is_float_dtype(binding.var.ty.dtype):
                    replace[binding.var] = replacement
    return with_bindings(func, replace) if replace else None

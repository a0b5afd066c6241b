"""Vectorizable exp, sigmoid, SiLU, tanh and softmax: float32 legalizations with ``topi.fast_exp``
and ``topi.fast_tanh``.

The stock legalizations use ``T.exp`` / ``T.tanh``. LLVM turns a vectorized ``llvm.exp.v16f32``
into sixteen scalar ``expf`` calls (there is no vector math library to call), so every
activation with an exponential costs a libm call per element: EfficientNet-B0's conv + SiLU
kernels took 4x the time of ONNX Runtime's convs (a SiLU over 96 x 112 x 112: 4.1 ms, the
memory-bound copy ~0.6 ms), and softmax / tanh-GELU pay the same. ``topi.fast_exp`` (range
reduction + degree-7 polynomial) and ``topi.fast_tanh`` (a clamped rational function) are plain
SIMD arithmetic.

Accuracy (float32, measured on 2M points over [-20, 20] against float64 numpy): fast_exp max
relative error 1.1e-6, fast_tanh max absolute error 4e-7; the stock ``expf`` is ~1e-7. Other
dtypes keep the stock legalizations.

Switch: :func:`set_fast_exp` (process-wide), the :func:`fast_exp` context manager, or
``TVM_FUSION_FAST_EXP=0`` read at import; as for GELU (``fast_gelu.py``), the override wraps
the stock ``FLegalize`` and acts only in our pipeline's ``LegalizeOps``; tuning records are tied
to the setting they were made with.
"""

from __future__ import annotations

import contextlib
import math
import os

import tvm
from tvm import relax, te, tirx, topi

_enabled = os.environ.get("TVM_FUSION_FAST_EXP", "1").strip().lower() not in ("0", "false", "no", "off")


def fast_exp_enabled() -> bool:
    return _enabled


def set_fast_exp(enabled: bool) -> bool:
    """Turn the fast exp / tanh legalizations on or off; returns the previous setting."""
    global _enabled
    previous, _enabled = _enabled, bool(enabled)
    return previous


@contextlib.contextmanager
def fast_exp(enabled: bool = True):
    """``with fast_exp(False): tvm_fusion.build(...)`` legalizes with the exact ``exp``/``tanh``."""
    previous = set_fast_exp(enabled)
    try:
        yield
    finally:
        set_fast_exp(previous)


def _sigmoid(x: te.Tensor) -> te.Tensor:
    one = tirx.const(1.0, x.dtype)
    e = topi.fast_exp(topi.negative(x))
    return topi.divide(one, topi.add(one, e))


def silu_fast_te(x: te.Tensor) -> te.Tensor:
    return topi.multiply(x, _sigmoid(x))


def gelu_tanh_fast_te(x: te.Tensor) -> te.Tensor:
    """The stock tanh-GELU formula with ``fast_tanh``."""
    dtype = x.dtype
    c = tirx.const(math.sqrt(2.0 / math.pi), dtype)
    inner = c * x * (tirx.const(1.0, dtype) + tirx.const(0.044715, dtype) * x * x)
    return tirx.const(0.5, dtype) * x * (tirx.const(1.0, dtype) + topi.fast_tanh(inner))


def _float32(call: relax.Call) -> bool:
    ty = call.args[0].ty
    return isinstance(ty, relax.TensorType) and str(ty.dtype) == "float32"


def _when_enabled(lower):
    def try_legalize(bb: relax.BlockBuilder, call: relax.Call):
        return lower(bb, call) if _enabled and _float32(call) else None

    return try_legalize


_LOWERINGS = {
    "relax.exp": lambda bb, call: bb.call_te(topi.fast_exp, call.args[0], primfunc_name_hint="exp"),
    "relax.sigmoid": lambda bb, call: bb.call_te(_sigmoid, call.args[0], primfunc_name_hint="sigmoid"),
    "relax.nn.silu": lambda bb, call: bb.call_te(silu_fast_te, call.args[0], primfunc_name_hint="silu"),
    "relax.tanh": lambda bb, call: bb.call_te(topi.fast_tanh, call.args[0], primfunc_name_hint="tanh"),
    "relax.nn.gelu_tanh": lambda bb, call: bb.call_te(
        gelu_tanh_fast_te, call.args[0], primfunc_name_hint="gelu_tanh"
    ),
    "relax.nn.softmax": lambda bb, call: bb.call_te(
        topi.nn.fast_softmax, call.args[0], int(call.attrs.axis), primfunc_name_hint="softmax"
    ),
}


def lowerings() -> dict:
    """Op name -> the lowering ``tvm_fusion.legalize.register`` puts in front of TVM's."""
    return {
        **{op_name: _when_enabled(lower) for op_name, lower in _LOWERINGS.items()},
        "relax.power": legalize_power_small_integer,
    }


def _constant_exponent(expr) -> float | None:
    if isinstance(expr, tvm.ir.expr.Constant) and expr.value.numpy().size == 1:
        return float(expr.value.numpy().reshape(()))
    return None


def legalize_power_small_integer(bb: relax.BlockBuilder, call: relax.Call):
    """``power(x, c)`` for a constant c in {1, 2, 3, 4}: multiplications, not a ``powf`` call per
    element (GPT-2's tanh-GELU cubes its input: 43 of 238 ms single-threaded). Exact up to the
    rounding of the products; other exponents keep the stock lowering."""
    exponent = _constant_exponent(call.args[1])
    if exponent not in (1.0, 2.0, 3.0, 4.0) or not _float32(call):
        return None
    out_ty = call.ty
    if not isinstance(out_ty, relax.TensorType) or out_ty.shape is None:
        return None

    def power_te(x: te.Tensor) -> te.Tensor:
        def body(*i):
            v = x(*i)
            result = v
            for _ in range(int(exponent) - 1):
                result = result * v
            return result

        return te.compute(x.shape, body, name="T_power")

    if [int(d) for d in call.args[0].ty.shape] != [int(d) for d in out_ty.shape]:
        return None  # the exponent broadcasts the result: leave it to the stock lowering
    return bb.call_te(power_te, call.args[0], primfunc_name_hint="power")


__all__ = [
    "fast_exp",
    "fast_exp_enabled",
    "gelu_tanh_fast_te",
    "legalize_power_small_integer",
    "set_fast_exp",
    "silu_fast_te",
]

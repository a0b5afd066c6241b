"""RecognizeRMSNorm: turn exporter-spelled RMSNorm back into ``R.nn.rms_norm``.

ONNX below opset 23 has no RMSNormalization, so both torch exporters write T5's layer norm and the
Llama family's ``RMSNorm`` as ``Pow(x, 2) -> ReduceMean(-1) -> Add(eps) -> Sqrt -> Reciprocal
(or Div 1 /) -> Mul(x) [-> Cast] -> Mul(weight)``. As arithmetic it is two kernels per norm (the
mean of squares with its square root, then the scaling: the reduction's consumers cannot join it)
and a normalized copy of the activations written for the projection after it. As one
``rms_norm`` it is a ``norm``-class op, which the fusion policy puts in front of that projection
as a row prologue (``norm -> gemm``): T5-small's 13 norms no longer take kernels of their own.

Matched (float32, static shape, every intermediate used only inside the pattern; ``x * x`` is how
``CanonicalizeActivations`` writes the square)::

    s = sqrt(mean(x * x, axis=-1, keepdims=True) + eps)
    n = x * (1 / s)      # or x / s, or x * rsqrt(mean(..) + eps)
    n = astype(n, "float32")                    # optional, a no-op cast (Llama's)
    y = n * weight                              # optional; weight a constant over the last axis
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from ..ir import BindingChain, constant_value, replace_matches, scalar_value, static_shape

__all__ = ["RecognizeRMSNorm"]


def _other(call: relax.Call, var) -> relax.Expr | None:
    """The operand of a binary ``call`` that is not ``var`` (None if neither is)."""
    if call.args[0].same_as(var):
        return call.args[1]
    return call.args[0] if call.args[1].same_as(var) else None


def _scaled_by_inverse_rms(chain: BindingChain, x, mean_eps):
    """The var of ``x / sqrt(mean_eps)`` as the exporters spell it, following single-use
    bindings from ``mean_eps`` (the ``mean + eps`` var); None otherwise."""
    step = chain.only_user(mean_eps)
    if chain.call(step, "rsqrt") is not None:  # x * rsqrt(m)
        inverse = step
    elif chain.call(step, "sqrt") is not None:
        after = chain.only_user(step)
        divide = chain.call(after, "divide")
        if divide is None or not divide.args[1].same_as(step):
            return None
        if divide.args[0].same_as(x):  # x / sqrt(m)
            return after
        if scalar_value(divide.args[0], chain.var2val) != 1.0:
            return None
        inverse = after  # 1 / sqrt(m)
    else:
        return None
    scaled = chain.only_user(inverse)
    multiply = chain.call(scaled, "multiply")
    operand = _other(multiply, inverse) if multiply is not None else None
    return scaled if operand is not None and operand.same_as(x) else None


def _match(chain: BindingChain, mean_var, max_row: int | None = None):
    """``(y, rms_norm call)`` for the RMSNorm whose mean of squares is ``mean_var``; None when
    it is not one, or its rows have ``max_row`` elements or more."""
    mean = chain.call(mean_var, "mean")
    square = chain.call(mean.args[0], "multiply") if mean is not None else None
    if square is None or not square.args[0].same_as(square.args[1]) or chain.uses.get(mean.args[0]) != 1:
        return None
    x = square.args[0]
    shape = static_shape(x)
    if shape is None or len(shape) < 2 or str(x.ty.dtype) != "float32":
        return None
    axes = [int(a) % len(shape) for a in mean.attrs.axis] if mean.attrs.axis is not None else None
    if axes != [len(shape) - 1] or not bool(mean.attrs.keepdims):
        return None
    if max_row is not None and shape[-1] >= max_row:
        return None
    add_var = chain.only_user(mean_var)
    add = chain.call(add_var, "add")
    eps = scalar_value(_other(add, mean_var), chain.var2val) if add is not None else None
    if eps is None:
        return None
    y = _scaled_by_inverse_rms(chain, x, add_var)
    if y is None or static_shape(y) != shape:
        return None
    cast = chain.only_user(y)
    if (call := chain.call(cast, "astype")) is not None and str(call.attrs.dtype) == "float32":
        y = cast
    weight = np.ones(shape[-1], "float32")
    scale_var = chain.only_user(y)
    scale = chain.call(scale_var, "multiply")
    value = constant_value(_other(scale, y), chain.var2val) if scale is not None else None
    per_feature = value is not None and value.shape[-1:] == (shape[-1],) and value.size == shape[-1]
    if per_feature and static_shape(scale_var) == shape:  # a weight [D] or [1, .., D]
        weight, y = value.astype("float32").reshape(-1), scale_var
    call = relax.op.nn.rms_norm(x, relax.const(weight), axes=[-1], epsilon=eps)
    return y, call


@tvm.transform.module_pass(opt_level=0, name="RecognizeRMSNorm")
class RecognizeRMSNorm:
    """Rewrite the ONNX spelling of RMSNorm (T5, Llama, Qwen, Mistral, Gemma) to ``R.nn.rms_norm``.

    ``max_row``: norms over this many features or more stay arithmetic. The pipeline sets it on
    CPU to ``WidenLongReductions.MIN_ELEMENTS``, so that a long row's mean of squares (Llama-7B's
    4,096 features) is still summed in float64 there; ``rms_norm`` sums in float32 lanes."""

    def __init__(self, max_row: int | None = None):
        self.max_row = max_row

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return replace_matches(mod, "relax.mean", lambda chain, var: _match(chain, var, self.max_row))

"""RecognizeGroupNorm: turn exporter-spelled GroupNorm / InstanceNorm back into ``R.nn.group_norm``.

ONNX below opset 18 has no GroupNormalization, so torch writes ``nn.GroupNorm(G, C)`` (PoolFormer,
ResNet-GN, diffusion U-Nets) as ``Reshape([N, G, -1]) -> InstanceNormalization -> Reshape(x.shape)
-> Mul(gamma) -> Add(beta)``, and the Relax frontend spells the instance norm as mean, subtract,
variance, add eps, sqrt, divide. Eight ops, two reshapes that flatten the channels with the
spatial dims: a layout region cannot cross them (PoolFormer on CUDA kept 48 NHWC <-> NCHW
transforms, two per norm), and the norm costs three kernels. As one ``group_norm`` (the same
formula; ``channel_axis`` says where C is) it follows its input into any channels-last layout
and fuses as one reduction.

Matched (float32, static shapes, every intermediate used only inside the pattern)::

    r = reshape(x, [N, G, C/G * spatial])       # or r = x: an instance norm over x, G = C
    n = (r - mean(r, -1)) / sqrt(variance(r, -1) + eps)
    n = n * s + b                               # optional per-group constants (the instance norm's)
    y = reshape(n, x.shape) * gamma + beta      # optional per-channel constants

The per-group and per-channel constants fold into one ``gamma``/``beta`` pair in numpy.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from ..ir import BindingChain, constant_value, op_name, replace_matches, scalar_value, static_shape

__all__ = ["RecognizeGroupNorm"]

MAX_AFFINE_OPS = 4  # per run of constant * / + (an instance norm's scale and bias, then a GroupNorm's)


class _Chain(BindingChain):
    """A binding chain that also composes runs of constant ``*`` / ``+`` (the norm's affine)."""

    def affine(self, var, per_channel, gamma, beta):
        """Follow a run of ``* c`` / ``+ c`` from ``var`` (constants ``per_channel`` turns into one
        value per channel, or refuses with None), composing them into ``gamma`` / ``beta``:
        (last var, gamma, beta)."""
        for _ in range(MAX_AFFINE_OPS):
            nxt = self.only_user(var)
            call = next((c for name in ("multiply", "add") if (c := self.call(nxt, name)) is not None), None)
            if nxt is None or call is None:
                break
            other = call.args[1] if call.args[0].same_as(var) else call.args[0]
            value = constant_value(other, self.var2val)
            per = per_channel(value) if value is not None else None
            if per is None:
                break
            if op_name(call) == "relax.multiply":
                gamma, beta = gamma * per, beta * per
            else:
                beta = beta + per
            var = nxt
        return var, gamma, beta


def _normalized(chain: _Chain, div_var):
    """``(r, eps)`` when ``div_var`` is ``(r - mean(r, -1)) / sqrt(variance(r, -1) + eps)``."""
    div = chain.call(div_var, "divide")
    sub = chain.call(div.args[0], "subtract") if div is not None else None
    sqrt = chain.call(div.args[1], "sqrt") if div is not None else None
    if sub is None or sqrt is None:
        return None
    r = sub.args[0]
    mean = chain.call(sub.args[1], "mean")
    add = chain.call(sqrt.args[0], "add")
    var = chain.call(add.args[0], "variance") if add is not None else None
    eps = scalar_value(add.args[1], chain.var2val) if add is not None else None
    if mean is None or var is None or eps is None:
        return None
    if not (mean.args[0].same_as(r) and var.args[0].same_as(r)):
        return None
    shape = static_shape(r)
    if shape is None or len(shape) < 3 or static_shape(div_var) != shape:  # eps must not broadcast
        return None
    rank = len(shape)
    for reduce in (mean, var):
        axes = sorted(int(a) % rank for a in reduce.attrs.axis) if reduce.attrs.axis is not None else None
        if axes != list(range(2, rank)) or not bool(reduce.attrs.keepdims):
            return None
    inner = [div.args[0], div.args[1], sub.args[1], sqrt.args[0], add.args[0]]
    if any(chain.uses.get(v, 0) != 1 for v in inner):
        return None
    return r, eps


def _channel_values(value: np.ndarray, size: int, rank: int, channels: int):
    """A constant that broadcasts along axis 1 of a rank-``rank`` tensor (a scalar, or ``size``
    values laid out as ``[size, 1, ...]`` / ``[1, size, 1, ...]``) as one value per channel, each
    group's value repeated over its channels; None for any other constant."""
    dims = list(value.shape)
    flat = value.astype("float32").reshape(-1)
    if flat.size == 1 and len(dims) <= rank:
        return np.full(channels, flat[0], "float32")
    if len(dims) not in (rank - 1, rank) or dims[-(rank - 1)] != size or flat.size != size:
        return None
    return np.repeat(flat, channels // size)


def _match(chain: _Chain, div_var):
    """``(y, group_norm call)`` for the GroupNorm / InstanceNorm that ends at the returned var."""
    found = _normalized(chain, div_var)
    if found is None:
        return None
    r, eps = found
    r_shape = static_shape(r)
    source = chain.call(r, "reshape")
    x = source.args[0] if source is not None else r
    x_shape = static_shape(x)
    if x_shape is None or len(x_shape) < 3 or str(x.ty.dtype) != "float32":
        return None
    rank, channels = len(x_shape), x_shape[1]
    gamma, beta = np.ones(channels, "float32"), np.zeros(channels, "float32")
    if r_shape == x_shape:  # an instance norm straight over x (or over an identity reshape of it)
        groups = channels
        y, gamma, beta = chain.affine(
            div_var, lambda v: _channel_values(v, channels, rank, channels), gamma, beta
        )
    else:
        groups = r_shape[1]
        if source is None or len(r_shape) != 3 or r_shape[0] != x_shape[0] or channels % groups:
            return None
        last, gamma, beta = chain.affine(
            div_var, lambda v: _channel_values(v, groups, 3, channels), gamma, beta
        )
        back = chain.only_user(last)
        if back is None or chain.call(back, "reshape") is None or static_shape(back) != x_shape:
            return None
        y, gamma, beta = chain.affine(
            back, lambda v: _channel_values(v, channels, rank, channels), gamma, beta
        )
    call = relax.op.nn.group_norm(
        x,
        relax.const(gamma),
        relax.const(beta),
        num_groups=groups,
        channel_axis=1,
        axes=list(range(2, len(x_shape))),
        epsilon=eps,
    )
    return y, call


@tvm.transform.module_pass(opt_level=0, name="RecognizeGroupNorm")
class RecognizeGroupNorm:
    """Rewrite the ONNX spelling of GroupNorm (and InstanceNorm) to ``R.nn.group_norm``."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return replace_matches(mod, "relax.divide", _match, _Chain)

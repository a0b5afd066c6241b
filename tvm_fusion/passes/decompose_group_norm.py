"""DecomposeGroupNorm: ``R.nn.group_norm`` as means and elementwise ops, in its own layout.

Runs after RewriteLayout. ``group_norm`` is kept whole until then so that it can follow its input
into a channels-last layout (``RecognizeGroupNorm``); after that, the ops are what the fusion policy
and the schedules handle well: TOPI's group_norm is one kernel that computes the variance as
E[x²] - E[x]² (cancels badly when the mean is large) and, with one group, runs its whole reduction
on one thread (CPU) or one thread block (CUDA), normalization included. Decomposed, the mean and
the variance (the mean of the squared deviations, two-pass) are reductions of their own, one per
kernel, and the normalization fuses with its neighbours.

Channels-first ``[N, C, *S]`` groups as ``[N, G, C/G, *S]`` (the exported groups, split off the
channel axis only: a conv that takes the view as its epilogue still writes plain output
positions) or, for one group, ``[N, 1, C * S]``; channels-last ``[N, *S, C]`` as
``[N, 1, S * C]`` for one group, else ``[N, S, G, C/G]`` reduced over axes 1 and 3. Other axis
choices stay as they are.
"""

from __future__ import annotations

import math

import numpy as np
import tvm
from tvm import relax

from ..ir import op_name, rewrite_functions, static_shape

__all__ = ["DecomposeGroupNorm"]


def _grouping(call: relax.Call):
    """``(grouped shape, reduction axes, per-channel broadcast shape)``, or None to leave it."""
    shape = static_shape(call.args[0])
    if shape is None or len(shape) < 3:
        return None
    rank, groups = len(shape), int(call.attrs.num_groups)
    channel_axis = int(call.attrs.channel_axis) % rank
    axes = sorted(int(a) % rank for a in call.attrs.axes)
    n, channels = shape[0], shape[channel_axis]
    if channel_axis == 1 and axes == list(range(2, rank)):
        per_channel = [channels] + [1] * (rank - 2)
        if groups == 1:  # one flat row: PoolFormer 8 % faster than over [N, 1, C, *S]
            return [n, 1, channels * math.prod(shape[2:])], [2], per_channel
        # [N, G, C/G, *S], not [N, G, C/G * S]: a split of the channel axis only, so a conv before
        # it that takes the reshape as its epilogue still writes [N, C, *S] positions plainly
        # (BiT's Winograd convs: through the flattened view, its 7x7 F(2) convs' output indices
        # became div/mod chains no schedule could tile)
        return [n, groups, channels // groups, *shape[2:]], list(range(2, rank + 1)), per_channel
    if channel_axis == rank - 1 and axes == list(range(1, rank - 1)):
        spatial = math.prod(shape[1:-1])
        if groups == 1:
            return [n, 1, spatial * channels], [2], [channels]
        return [n, spatial, groups, channels // groups], [1, 3], [channels]
    return None


def _applies(call: relax.Call) -> bool:
    return str(call.args[0].ty.dtype) == "float32" and _grouping(call) is not None


def _param(expr, enabled: bool, neutral: float):
    """gamma / beta to apply: a constant's values as numpy, any other expression as it is; None
    when it is ``neutral`` everywhere or switched off."""
    if not enabled:
        return None
    if isinstance(expr, tvm.ir.expr.Constant):
        value = expr.value.numpy()
        return None if np.all(value == neutral) else value
    return expr


@relax.expr_functor.mutator
class _Decomposer(relax.PyExprMutator):
    def visit_call_(self, call):
        call = super().visit_call_(call)
        if op_name(call) != "relax.nn.group_norm" or not _applies(call):
            return call
        grouped, axes, per_channel = _grouping(call)
        a, emit = call.attrs, self.builder_.emit
        x = call.args[0]
        r = emit(relax.op.reshape(x, grouped))
        centered = emit(relax.op.subtract(r, emit(relax.op.mean(r, axis=axes, keepdims=True))))
        # the mean of the squared deviations, not relax's variance: one reduction per kernel, which
        # the reduction rule vectorizes (variance computes its own mean first, in the same kernel,
        # and fell to a scalar fallback schedule: BiT's 400k-element groups 0.8 ms each)
        squared = emit(relax.op.multiply(centered, centered))
        variance = emit(relax.op.mean(squared, axis=axes, keepdims=True))
        eps = relax.const(np.float32(a.epsilon))
        scale = emit(relax.op.sqrt(emit(relax.op.add(variance, eps))))
        out = emit(relax.op.reshape(emit(relax.op.divide(centered, scale)), static_shape(x)))
        gamma = _param(call.args[1], bool(a.scale), 1.0)
        beta = _param(call.args[2], bool(a.center), 0.0)
        if gamma is not None:
            out = relax.op.multiply(out, self._per_channel(gamma, per_channel))
        if beta is not None:
            out = relax.op.add(emit(out) if gamma is not None else out, self._per_channel(beta, per_channel))
        return out

    def _per_channel(self, value, shape):
        if isinstance(value, np.ndarray):
            return relax.const(np.ascontiguousarray(value.reshape(shape)))
        return self.builder_.emit(relax.op.reshape(value, shape))


@tvm.transform.module_pass(opt_level=0, name="DecomposeGroupNorm")
class DecomposeGroupNorm:
    """Expand float32 ``R.nn.group_norm`` into means and elementwise ops (see module doc)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return rewrite_functions(mod, {"relax.nn.group_norm"}, _applies, _Decomposer)

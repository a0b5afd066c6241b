"""PoolBeforePointwiseConv: average-pool a 1x1 conv's input instead of its output.

Why: DenseNet's transition layers run a 1x1 conv over the full map, then a 2x2/2 average pool
keeps a quarter of it: three quarters of the conv's FLOPs are averaged away. A 1x1 conv is the
same affine map at every pixel, and an average pool a weighted sum whose weights add up to 1,
so ``avg_pool(conv1x1(x) + b) == conv1x1(avg_pool(x)) + b`` exactly (up to float rounding).
Pooled first, the conv runs on the pooled map: DenseNet-121's three transition convs do 4x
fewer FLOPs (ONNX Runtime runs them as exported).

When the pool's weights add up to 1 in every window: no padding, or padding that is not
counted (``count_include_pad=False``) and holds no whole window, and no ``ceil_mode`` (its
partial windows); and for float convs in their input's dtype. It applies only where it saves
work (the pool has fewer pixels out than in), where the conv's result feeds only the pool, and
to the NCHW convs and pools the importer makes (it runs before ``RewriteLayout``).
"""

from __future__ import annotations

import tvm
from tvm import relax

from ..ir import (
    UseCountingMutator,
    count_uses,
    is_pointwise_conv,
    op_calls,
    op_name,
    rewrite_and_prune,
    static_shape,
)

__all__ = ["PoolBeforePointwiseConv"]

_POOL = "relax.nn.avg_pool2d"


def _averages_each_window(pool: relax.Call) -> bool:
    """True if every window's weights add up to 1 (an affine map commutes with the pool): padding
    is not counted, and no window lies wholly in it (its average would be 0, not the bias)."""
    a = pool.attrs
    if bool(a.ceil_mode) or str(a.layout) != "NCHW" or str(a.out_layout) != "NCHW":
        return False
    pads = [int(p) for p in a.padding]
    if not any(pads):
        return True
    windows = [int(d) * (int(k) - 1) + 1 for d, k in zip(a.dilation, a.pool_size)]
    return not bool(a.count_include_pad) and all(p < windows[i % 2] for i, p in enumerate(pads))


def _is_channel_bias(add) -> bool:
    """``y + b`` with a constant ``b`` the same at every pixel (shape [C, 1, 1], [1, C, 1, 1], ...)."""
    if op_name(add) != "relax.add":
        return False
    bias = add.args[1]
    shape = static_shape(bias)
    return isinstance(bias, tvm.ir.expr.Constant) and shape is not None and all(d == 1 for d in shape[-2:])


def _shrinks(pool: relax.Call) -> bool:
    """The pool has fewer output pixels than input pixels: the conv then does less work."""
    before, after = static_shape(pool.args[0]), static_shape(pool)
    return before is not None and after is not None and after[2] * after[3] < before[2] * before[3]


@relax.expr_functor.mutator
class _Rewriter(UseCountingMutator):
    def visit_call_(self, call):
        call = super().visit_call_(call)
        if op_name(call) != _POOL or not _averages_each_window(call) or not _shrinks(call):
            return call
        producer, bias = self.single_use_binding(call.args[0]), None
        if _is_channel_bias(producer):
            bias = producer.args[1]
            producer = self.single_use_binding(producer.args[0])
        if not is_pointwise_conv(producer):
            return call
        # the same pool on the conv's input, the same conv on the pooled map (attrs checked above)
        pooled = self.builder_.emit(relax.Call(call.op, [producer.args[0]], call.attrs))
        conv = relax.Call(producer.op, [pooled, producer.args[1]], producer.attrs)
        self.rewrote = True
        return conv if bias is None else relax.op.add(self.builder_.emit(conv), bias)


@tvm.transform.module_pass(opt_level=0, name="PoolBeforePointwiseConv")
class PoolBeforePointwiseConv:
    """Rewrite ``avg_pool2d(conv2d_1x1(x) [+ b])`` to ``conv2d_1x1(avg_pool2d(x)) [+ b]`` where the
    pool keeps fewer pixels than it reads."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return rewrite_and_prune(
            mod, lambda func: op_calls(func, {_POOL}), lambda func: _Rewriter(mod, count_uses(func))
        )

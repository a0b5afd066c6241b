"""SimplifyPoolCeilMode: drop ``ceil_mode`` from pools where rounding up changes nothing.

PyTorch exports SqueezeNet's and GoogLeNet's pools with ``ceil_mode=True``. TOPI implements it by
padding the input with ``stride - 1`` extra rows and columns (``-inf`` for max), so the kernel
copies its whole input into a padded buffer first, even when no window ever reaches that padding:
whenever ``(size + pads - window) % stride == 0`` the floor and ceil output sizes are equal and
every window lies inside the input. SqueezeNet's three 3x3/2 pools (111, 55 and 27 wide) are all
such; the padded copy made them 2-3x slower than the same pool without it (64x111x111:
0.154 -> 0.057 ms, 128x55x55: 0.069 -> 0.030 ms on the znver4 VM, 2 threads).

The rewrite is exact: same windows, same output shape, same values (also for average pools,
whose divisor depends only on the windows).
"""

from __future__ import annotations

import re

import tvm
from tvm import relax

from ..ir import op_name, rewrite_functions, static_shape

__all__ = ["SimplifyPoolCeilMode"]

_POOLS = {
    f"relax.nn.{kind}_pool{dims}d": getattr(relax.op.nn, f"{kind}_pool{dims}d")
    for kind in ("max", "avg")
    for dims in (1, 2, 3)
}


def ceil_mode_is_noop(call: relax.Call) -> bool:
    """True if the pool has ``ceil_mode`` set and rounding down would give the same windows."""
    attrs = call.attrs
    if not bool(attrs.ceil_mode):
        return False
    shape = static_shape(call.args[0])
    if shape is None:
        return False
    axes = re.findall(r"\d*[A-Za-z]", str(attrs.layout))  # "NCHW16c" -> N, C, H, W, 16c
    spatial = [axes.index(axis) for axis in "DHW" if axis in axes]
    dims = len(spatial)
    pads = [int(p) for p in attrs.padding]
    for i, axis in enumerate(spatial):
        window = int(attrs.dilation[i]) * (int(attrs.pool_size[i]) - 1) + 1
        span = shape[axis] + pads[i] + pads[i + dims] - window
        if span < 0 or span % int(attrs.strides[i]):
            return False
    return True


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    def visit_call_(self, call):
        call = super().visit_call_(call)
        if op_name(call) not in _POOLS:
            return call
        if not ceil_mode_is_noop(call):
            return call
        a = call.attrs
        return _POOLS[call.op.name](
            call.args[0],
            pool_size=list(a.pool_size),
            strides=list(a.strides),
            padding=list(a.padding),
            dilation=list(a.dilation),
            ceil_mode=False,
            count_include_pad=bool(a.count_include_pad),
            layout=str(a.layout),
            out_layout=str(a.out_layout),
        )


@tvm.transform.module_pass(opt_level=0, name="SimplifyPoolCeilMode")
class SimplifyPoolCeilMode:
    """Rewrite ``ceil_mode=True`` pools whose ceil and floor windows coincide to ``ceil_mode=False``."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return rewrite_functions(mod, _POOLS, ceil_mode_is_noop, _Rewriter)

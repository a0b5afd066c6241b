"""PadConvChannels: give a conv's output channels whole SIMD vectors, on CPU.

The Contraction rule puts a 1×1 / direct conv's vector lanes on its output channels. With a
count no vector width divides (SqueezeNet's 1000-way classifier conv, RegNet's 440 / 104
channels) and an output plane no vector width divides either (13×13, 7×7, 14×14) it falls back
to narrow or odd vectors: SqueezeNet's 512→1000 conv at 13×13 ran at 186 GFLOP/s, the same conv
with 1008 channels at 397. So a conv with a constant weight becomes
``strided_slice(conv2d(x, W'), channels 0..O)`` where ``W'`` has zero filters up to the next
multiple of the vector width: the padded weight is a constant (free at run time), the extra
channels cost at most ``MAX_WASTE`` more FMAs, and the slice fuses into the conv's kernel as its
epilogue. Runs on high-level Relax before fusion; other targets and layouts are left alone.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from ..ir import dtype_of, graph_functions, op_name, static_shape, with_functions
from ..schedules._util import vector_lanes

__all__ = ["PadConvChannels"]

MIN_VECTORS = 4  # convs with fewer output channels than this many vectors are left alone
MAX_WASTE = 0.125  # at most this share of extra (zero) filters


@tvm.transform.module_pass(opt_level=0, name="PadConvChannels")
class PadConvChannels:
    """Pad the output channels of constant-weight NCHW conv2d to whole vectors (module docstring)."""

    def __init__(self, target: tvm.target.Target):
        self.target = target

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        if self.target.kind.name != "llvm":
            return mod
        lanes = vector_lanes(self.target, "float32")
        updates = {}
        for gvar, func in graph_functions(mod):
            new_func = _Padder(lanes).visit_expr(func)
            if not new_func.same_as(func):
                updates[gvar] = new_func
        return with_functions(mod, updates)


def padded_channels(channels: int, lanes: int) -> int | None:
    """The channel count to compute instead of ``channels``, or None to keep it."""
    if channels % lanes == 0 or channels < MIN_VECTORS * lanes:
        return None
    padded = -(-channels // lanes) * lanes
    return padded if padded - channels <= MAX_WASTE * channels else None


@relax.expr_functor.mutator
class _Padder(relax.PyExprMutator):
    def __init__(self, lanes: int):
        super().__init__()
        self.lanes = lanes

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        if op_name(call) != "relax.nn.conv2d":
            return call
        data, weight = call.args
        attrs = call.attrs
        layouts = (str(attrs.data_layout), str(attrs.kernel_layout), str(attrs.out_layout))
        wshape = static_shape(weight)
        if (
            not (isinstance(weight, tvm.ir.Constant) and hasattr(weight, "value"))
            or layouts != ("NCHW", "OIHW", "NCHW")
            or int(attrs.groups) != 1
            or wshape is None
            or {dtype_of(data), dtype_of(weight), dtype_of(call)} != {"float32"}
        ):
            return call
        out_shape = static_shape(call)
        plane = None if out_shape is None else out_shape[2] * out_shape[3]
        if plane is None or plane < self.lanes or plane % self.lanes == 0:
            # a plane of whole vectors takes the lanes itself (MobileNet-V3's 72 channels at 56x56);
            # a 1x1 plane (squeeze-excitation) is a GEMV: the crop would cost more than it saves
            return call
        padded = padded_channels(wshape[0], self.lanes)
        if padded is None:
            return call
        filters = weight.value.numpy()
        zeros = np.zeros((padded - wshape[0], *wshape[1:]), dtype=filters.dtype)
        conv = relax.op.nn.conv2d(
            data,
            relax.const(np.concatenate([filters, zeros])),
            strides=attrs.strides,
            padding=attrs.padding,
            dilation=attrs.dilation,
            groups=1,
            data_layout="NCHW",
            kernel_layout="OIHW",
            out_layout="NCHW",
            out_dtype=attrs.out_dtype,
        )
        return relax.op.strided_slice(conv, axes=[1], begin=[0], end=[wshape[0]])

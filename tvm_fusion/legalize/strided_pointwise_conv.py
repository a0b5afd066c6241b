"""Pointwise (1×1) NCHW conv2d with a stride on LLVM CPUs: subsample the input, then a stride-1 conv.

Why: a 1×1 stride-2 conv reads ``x[c, 2y, 2x]``. Along the output plane (the axis the Contraction
rule vectorizes or tiles rows on) every load is a stride-2 gather, and the plane cannot be
flattened into one GEMM axis. ResNet-50's three downsample convs ran at ~200 GFLOP/s (256→512
channels at 56×56/2: 1.0 ms alone, 1.55 ms in the model) where its stride-1 1×1 convs reach
350-400. Here the conv becomes two stages of the same kernel: ``subsample`` copies the quarter of
the input the conv reads (contiguous rows), and a stride-1 1×1 conv over it, which the Contraction
rule schedules as a GEMM over the flattened plane.
"""

from __future__ import annotations

from tvm import relax, te

from .conv_args import cpu_float32_nchw_conv


def strided_pointwise_conv2d_nchw(data, weight, strides, dtype: str):
    """TE of the subsample + stride-1 1×1 conv; returns the NCHW output."""
    n_ = data.shape[0]  # symbolic in a generic entry (dynamic batch)
    c_, h_, w_ = (int(x) for x in data.shape[1:])
    k_ = int(weight.shape[0])
    sh, sw = (int(s) for s in strides)
    oh_, ow_ = (h_ - 1) // sh + 1, (w_ - 1) // sw + 1
    sub = te.compute(
        (n_, c_, oh_, ow_), lambda b, c, y, x: data[b, c, y * sh, x * sw], name="pointwise_subsample"
    )
    rc = te.reduce_axis((0, c_), name="rc")
    return te.compute(
        (n_, k_, oh_, ow_),
        lambda b, k, y, x: te.sum(
            sub[b, rc, y, x].astype(dtype) * weight[k, rc, 0, 0].astype(dtype), axis=rc
        ),
        name="pointwise_conv",
    )


def eligible_conv(call: relax.Call) -> list[int] | None:
    """The strides of a conv this lowering covers (1×1 window, no padding, one group, a stride
    above 1, NCHW / OIHW, float32 shapes static but for the batch, LLVM target in scope), else
    None."""
    shapes = cpu_float32_nchw_conv(call)
    if shapes is None:
        return None
    attrs = call.attrs
    strides = [int(s) for s in attrs.strides]
    _, wshape = shapes
    if wshape[2:] != [1, 1] or int(attrs.groups) != 1 or any(int(p) for p in attrs.padding):
        return None
    return strides if max(strides) > 1 else None


def legalize_strided_pointwise_conv2d(bb: relax.BlockBuilder, call: relax.Call):
    """Legalize an eligible strided 1×1 conv (see :func:`eligible_conv`); None otherwise."""
    strides = eligible_conv(call)
    if strides is None:
        return None
    return bb.call_te(
        strided_pointwise_conv2d_nchw,
        call.args[0],
        call.args[1],
        strides,
        "float32",
        primfunc_name_hint="conv2d",
    )

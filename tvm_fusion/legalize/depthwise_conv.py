"""Depthwise and narrow grouped NCHW conv2d on LLVM CPUs, in a form whose inner loop is a plain
vector FMA.

Why: TVM's depthwise conv reads ``pad[c, y·s + kh, x·s + kw]``. Vectorized along the output
width ``x`` that is a gather whenever the stride ``s`` is 2 (one load per lane), and the widths
of MobileNet-style planes (7, 14, 28, 56) are not whole AVX-512 vectors. Measured on
mobilenet_v2: its 112×112 stride-2 depthwise kernel ran at 8 GFLOP/s and the depthwise kernels
took 2.2 of the model's 4.9 ms; RegNet's grouped convs (8 channels per group) the same.
A network's RGB stem (up to 4 input channels, stride 1 or 2, a window wider than the stride) is
one such group: with lanes on output
columns its epilogue stores whole vectors where TVM's conv, lanes on output channels, scatters
single lanes into the NCHW output after only 27-147 reduction steps (in the model: ResNet's
7x7/2 stem 1.52 -> 1.26 ms, mobilenet_v2's 3x3/2 0.26 -> 0.24 ms; squeezenet's 3x3/2, 111 rows
in tasks of 3, 0.31 -> 0.33 ms).

The conv becomes up to four TE stages, each block annotated ``tvm_fusion.depthwise = <stage>``
(the ``Depthwise`` schedule rule recognises them by that, ``schedules/depthwise.py``):

* ``pad``: the zero-padded input ``d_pad`` (computed per task by the schedule, a few rows at a
  time; with a stride, by default inside the phase copy);
* ``phase`` (stride > 1 only): ``P[b, c, y, r, q] = d_pad[b, c, y, q·s + r]``, so that the input
  column ``x·s + kw`` of every output column ``x`` is the contiguous vector
  ``P[.., kw mod s, x + kw / s]`` (the polyphase layout Winograd's pad uses);
* ``conv``: ``acc[b, k, y, x] = Σ_{ic, kh, kw} P[b, g(k)·cig + ic, y·s + kh, kw mod s, x + kw / s]
  · w[k, ic, kh, kw]`` (``cig`` input channels per group, 1 for depthwise) over an output width
  padded up to whole vectors (:func:`padded_width`);
* ``crop``: the real output width, when it was padded; FuseTIR appends the fused epilogue (bias,
  clip, residual add) after the last stage.
"""

from __future__ import annotations

import tvm
from tvm import relax, te, tirx

from .conv_args import cpu_float32_nchw_conv, padded_width

STAGE = "tvm_fusion.depthwise"  # block annotation: pad / phase / conv / crop
GROUP_OUT = "tvm_fusion.group_channels"  # on the conv block: output channels per group
PAD_COLUMNS = "tvm_fusion.pad_columns"  # on a strided conv's pad block: [left padding, input width]
# Stride-1 outputs narrower than this keep TVM's conv (Contraction vectorizes those over the
# plane): on 7×7 planes the per-row padding costs more than it saves (0.021 vs 0.014 ms, 960 ch)
MIN_WIDTH = 8
# ... and depthwise 3×3 stride-1 outputs narrower than this: too few taps to pay for a task's
# padded rows (mobilenet_v2's 384×14×14 in the model: 0.079 ms TVM's conv, 0.107 ours; its 5×5
# windows still win: efficientnet_b0's 672×14×14 0.227 -> 0.179 ms)
MIN_WIDTH_3X3 = 16
# Grouped convs with at most this many input channels per group take the same form (RegNet's
# group width is 8, ResNeXt's 4); wider groups are GEMM-like enough for the Contraction rule.
MAX_GROUP_CHANNELS = 16
# A dense conv with at most this many input channels, stride 1 or 2 and a window wider than the
# stride (a network's stem on RGB) is one group; patchifying stems (ViT's 16x16/16, ConvNeXt's
# 4x4/4) and 1x1 convs are GEMMs, not these
MAX_STEM_CHANNELS = 4


def depthwise_conv2d_nchw(data, weight, strides, padding, width: int, dtype: str):
    """TE of the depthwise / grouped conv (see the module docstring); returns the NCHW output."""
    n_ = data.shape[0]  # symbolic in a generic entry (dynamic batch): an outer loop throughout
    c_, h_, w_ = (int(x) for x in data.shape[1:])
    k_, cig, kh_, kw_ = (int(x) for x in weight.shape)
    cog = k_ // (c_ // cig)  # output channels per group
    sh, sw = (int(s) for s in strides)
    pt, pl, pb, pr = (int(p) for p in padding)
    oh_ = (h_ + pt + pb - kh_) // sh + 1
    ow_ = (w_ + pl + pr - kw_) // sw + 1
    rows, cols = (oh_ - 1) * sh + kh_, width + (kw_ - 1) // sw

    def padded(b, c, y, x):
        yy, xx = y - pt, x - pl
        inside = tirx.all(yy >= 0, yy < h_, xx >= 0, xx < w_)
        return tirx.if_then_else(inside, data[b, c, yy, xx], tirx.const(0.0, data.dtype))

    # with a stride, the schedule computes the padding in the phase copy and needs its columns
    pad_attrs = {STAGE: "pad", **({PAD_COLUMNS: [pl, w_]} if sw > 1 else {})}
    pad = te.compute((n_, c_, rows, cols * sw), padded, name="depthwise_pad", attrs=pad_attrs)
    if sw == 1:

        def window(b, c, y, kw, x):
            return pad[b, c, y, x + kw]

    else:
        # polyphase: P[b, c, y, r, q] = pad[b, c, y, q·s + r]
        phase = te.compute(
            (n_, c_, rows, sw, cols),
            lambda b, c, y, r, q: pad[b, c, y, q * sw + r],
            name="depthwise_phase",
            attrs={STAGE: "phase"},
        )

        def window(b, c, y, kw, x):
            return phase[b, c, y, kw % sw, x + kw // sw]

    ic = te.reduce_axis((0, cig), name="ic")
    kh = te.reduce_axis((0, kh_), name="kh")
    kw = te.reduce_axis((0, kw_), name="kw")
    acc = te.compute(
        (n_, k_, oh_, width),
        lambda b, k, y, x: te.sum(
            window(b, k // cog * cig + ic, y * sh + kh, kw, x).astype(dtype)
            * weight[k, ic, kh, kw].astype(dtype),
            axis=[ic, kh, kw],
        ),
        name="depthwise_conv",
        attrs={STAGE: "conv", GROUP_OUT: cog},
    )
    if width == ow_:
        return acc
    return te.compute(
        (n_, k_, oh_, ow_), lambda b, k, y, x: acc[b, k, y, x], name="depthwise_crop", attrs={STAGE: "crop"}
    )


def eligible_conv(call: relax.Call) -> dict | None:
    """The conv's facts if it is a conv this lowering covers (NCHW / OIHW, one filter per channel,
    narrow groups, or an RGB stem: ≤ ``MAX_STEM_CHANNELS`` input channels, stride ≤ 2 and a window
    wider than the stride; dilation 1, float32 shapes static but for the batch, stride 2 or an
    output width ≥ ``MIN_WIDTH`` (``MIN_WIDTH_3X3`` for 3×3 windows over one input channel), LLVM
    target in scope), else None."""
    shapes = cpu_float32_nchw_conv(call)
    if shapes is None:
        return None
    attrs = call.attrs
    dshape, wshape = shapes
    groups = int(attrs.groups)
    strides = [int(s) for s in attrs.strides]
    stem = (
        wshape[1] <= MAX_STEM_CHANNELS
        and max(strides) <= 2
        and wshape[2] > strides[0]
        and wshape[3] > strides[1]
    )
    if groups < 2 and not stem:
        return None
    if wshape[1] > MAX_GROUP_CHANNELS or wshape[0] % groups or dshape[1] != groups * wshape[1]:
        return None
    padding = [int(p) for p in attrs.padding]
    ow = (dshape[3] + padding[1] + padding[3] - wshape[3]) // strides[1] + 1
    oh = (dshape[2] + padding[0] + padding[2] - wshape[2]) // strides[0] + 1
    small_window = wshape[1] == 1 and wshape[2] * wshape[3] <= 9
    if strides[1] == 1 and (ow < MIN_WIDTH or (small_window and ow < MIN_WIDTH_3X3)):
        return None
    if ow < 2 or oh < 1:
        return None
    from ..schedules._util import vector_lanes  # pylint: disable=import-outside-toplevel

    target = tvm.target.Target.current()
    return {
        "strides": strides,
        "padding": padding,
        "width": padded_width(ow, vector_lanes(target, "float32")),
    }


def legalize_depthwise_conv2d(bb: relax.BlockBuilder, call: relax.Call):
    """Legalize an eligible depthwise conv (see :func:`eligible_conv`); None otherwise."""
    conv = eligible_conv(call)
    if conv is None:
        return None
    return bb.call_te(
        depthwise_conv2d_nchw,
        call.args[0],
        call.args[1],
        conv["strides"],
        conv["padding"],
        conv["width"],
        "float32",
        primfunc_name_hint="depthwise_conv2d",
    )

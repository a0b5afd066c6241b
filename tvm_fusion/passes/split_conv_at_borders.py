"""SplitConvAtBorders: compute each region of a conv's output with only the taps it reads inside the input.

DeepLabV3's dilation-12 ASPP conv on a 14x14 map (torchvision ``deeplabv3_mobilenet_v3_large`` at
224x224) keeps all nine taps after ``TrimPaddingTaps``, since the border outputs read some input
through each of them. But the 10x10 centre of its output reads the input only through the
centre tap, the edges through two taps and the corners through four: 18 % of the multiply-adds of
the full 3x3 window over a zero-padded copy (ONNX Runtime skips the padding taps per output and
ran this conv in a third of our time).

Along each spatial axis the outputs fall into bands that read the input through the same span of
taps (:func:`tap_bands`). The rewrite computes every (row band, column band) region as its own
conv, on the slice of the input it reads, with that region's taps and no padding, and
concatenates the regions back: the same values (every dropped term is 0 · w). It applies to
dilated NCHW / OIHW ``conv2d`` with a constant weight and static H and W when the regions need at most
``MAX_WORK`` of the full conv's multiply-adds and there are at most ``MAX_BANDS`` bands per axis
(ordinary 3x3 convs, padded by 1, keep ~all their work and are left alone). The regions' kernels
are slices of the weight, so a tap shared by several regions is stored once per region (the
ASPP conv: 25 taps for 9, +16 MB). CPU only: on CUDA the nine small kernels are not measured.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import tvm
from tvm import relax

from ..ir import op_name, rewrite_functions, shape_dims

__all__ = ["MAX_BANDS", "MAX_WORK", "Band", "SplitConvAtBorders", "tap_bands"]

_CONV2D = "relax.nn.conv2d"
MAX_WORK = 0.5  # split only when the regions need at most half the multiply-adds
MAX_BANDS = 3  # per axis: at most 9 convs in place of one


class Band(NamedTuple):
    """Outputs ``begin <= y < end`` of one axis, which read the input through taps ``first_tap``
    to ``last_tap`` (inclusive)."""

    begin: int
    end: int
    first_tap: int
    last_tap: int

    def input_span(self, pad_before: int, dilation: int, stride: int) -> tuple[int, int]:
        """The input slice ``[start, stop)`` these outputs read through these taps, unpadded."""
        start = self.begin * stride - pad_before + self.first_tap * dilation
        return start, (self.end - 1) * stride - pad_before + self.last_tap * dilation + 1


def tap_bands(size: int, pad_before: int, kernel: int, dilation: int, stride: int, out: int):
    """Runs of consecutive outputs along one axis that read the input through the same taps, as
    :class:`Band` s; None if some output reads no input. The padding after the input enters
    through ``out`` (the output size) and ``size``: a tap past the input's end is not counted."""
    bands: list[Band] = []
    for y in range(out):
        start = y * stride - pad_before  # input index of tap 0
        first = max(0, -(start // dilation))  # ceil(-start / dilation)
        last = min(kernel - 1, (size - 1 - start) // dilation)
        if first > last:
            return None
        if bands and bands[-1][2:] == (first, last):
            bands[-1] = bands[-1]._replace(end=y + 1)
        else:
            bands.append(Band(y, y + 1, first, last))
    return bands


def _plan(call: relax.Call):
    """The (row bands, column bands) of a conv worth splitting, or None."""
    attrs = call.attrs
    layouts = (str(attrs.data_layout), str(attrs.kernel_layout), str(attrs.out_layout))
    if layouts != ("NCHW", "OIHW", "NCHW") or min(int(d) for d in attrs.dilation) == 1:
        return None  # undilated convs on tiny maps would qualify too; only dilated ones were timed
    weight, shape, out = call.args[1], shape_dims(call.args[0]), shape_dims(call)
    if not (isinstance(weight, tvm.ir.Constant) and hasattr(weight, "value")) or shape is None:
        return None
    if None in (shape[2], shape[3]) or out is None or None in (out[2], out[3]):
        return None
    kernel = [int(d) for d in weight.value.shape[2:]]
    top, left = int(attrs.padding[0]), int(attrs.padding[1])
    bands = [
        tap_bands(shape[2 + i], pad, kernel[i], int(attrs.dilation[i]), int(attrs.strides[i]), out[2 + i])
        for i, pad in enumerate((top, left))
    ]
    if any(b is None or len(b) > MAX_BANDS for b in bands) or all(len(b) == 1 for b in bands):
        return None
    work = [sum((b.end - b.begin) * (b.last_tap - b.first_tap + 1) for b in axis) for axis in bands]
    if work[0] * work[1] > MAX_WORK * out[2] * kernel[0] * out[3] * kernel[1]:
        return None
    return bands


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    def visit_call_(self, call):
        bands = _plan(call) if op_name(call) == _CONV2D else None  # decided on the typed call
        call = super().visit_call_(call)
        if bands is None:
            return call
        a = call.attrs
        data, weight = call.args[0], call.args[1].value.numpy()
        size = shape_dims(data)[2:]
        strides = [int(s) for s in a.strides]
        dilation = [int(d) for d in a.dilation]
        pads = (int(a.padding[0]), int(a.padding[1]))
        rows = []
        for row in bands[0]:
            regions = []
            for col in bands[1]:
                spans = [
                    band.input_span(*args) for band, args in zip((row, col), zip(pads, dilation, strides))
                ]
                part = data
                if spans != [(0, size[0]), (0, size[1])]:
                    begin, end = zip(*spans)
                    part = self.builder_.emit(relax.op.strided_slice(data, [2, 3], list(begin), list(end)))
                taps = weight[:, :, row.first_tap : row.last_tap + 1, col.first_tap : col.last_tap + 1]
                conv = relax.op.nn.conv2d(
                    part,
                    relax.const(np.ascontiguousarray(taps)),
                    strides=strides,
                    padding=[0, 0, 0, 0],
                    dilation=[1 if b.first_tap == b.last_tap else d for b, d in zip((row, col), dilation)],
                    groups=int(a.groups),
                    data_layout="NCHW",
                    kernel_layout="OIHW",
                    out_layout="NCHW",
                    out_dtype=a.out_dtype,
                )
                regions.append(self.builder_.emit(conv))
            rows.append(regions[0] if len(regions) == 1 else self.builder_.emit(relax.op.concat(regions, 3)))
        return rows[0] if len(rows) == 1 else relax.op.concat(rows, 2)


@tvm.transform.module_pass(opt_level=0, name="SplitConvAtBorders")
class SplitConvAtBorders:
    """Split a conv into output regions that each keep only their taps (see the module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return rewrite_functions(mod, (_CONV2D,), lambda call: _plan(call) is not None, _Rewriter)

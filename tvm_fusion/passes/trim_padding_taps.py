"""TrimPaddingTaps: drop the kernel rows and columns of a conv that only ever read zero padding.

DeepLabV3's ASPP convolves the backbone's 14x14 map (torchvision ``deeplabv3_mobilenet_v3_large``
at 224x224) with 3x3 kernels dilated 12, 24 and 36 and padded as much. With dilation 24 or 36
every off-centre tap of every output lands in the padding: each of those convs is a 1x1 conv
computed nine times over. ONNX Runtime's conv skips taps outside the input; ours run the whole
window over a zero-padded copy, so the model ran at 2.2x ONNX Runtime's time.

The rewrite keeps the taps that some output reads inside the input and shrinks the padding to
match: same output shape, same values (every dropped term is 0 · w). An axis cut to one tap gets
dilation 1, so the rest of the pipeline sees a plain 1x1 conv (our CPU lowerings and horizontal
fusion take only undilated convs). It applies to NCHW / OIHW ``conv2d`` with a constant weight and
static H and W, before layout rewriting; a conv whose trimmed form would need negative padding
(input rows past the last one any output reads) is left as it is.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from ..ir import op_name, rewrite_functions, shape_dims

__all__ = ["TrimPaddingTaps", "kept_taps"]

_CONV2D = "relax.nn.conv2d"


def kept_taps(size: int, pad_before: int, pad_after: int, kernel: int, dilation: int, stride: int):
    """``(first tap, last tap, new pad_before, new pad_after)`` of one spatial axis: the span of
    taps that read the input for at least one output; None when it is the whole kernel or empty,
    or when the trimmed form would need negative padding."""
    out = (size + pad_before + pad_after - dilation * (kernel - 1) - 1) // stride + 1
    valid = []
    for tap in range(kernel):
        offset = tap * dilation - pad_before  # input index of output y: y * stride + offset
        first = max(0, -(offset // stride))  # ceil(-offset / stride): the first y inside
        last = min(out - 1, (size - 1 - offset) // stride)
        if first <= last:
            valid.append(tap)
    if not valid or valid[-1] - valid[0] + 1 == kernel:  # with a stride, a middle tap may read none
        return None
    lo, hi = valid[0], valid[-1]
    before = pad_before - lo * dilation
    after = (out - 1) * stride + dilation * (hi - lo) + 1 - size - before
    if -stride < after < 0:
        after = 0  # the output size rounds down: the same outputs
    if before < 0 or after < 0:
        return None
    return lo, hi, before, after


def _trimmed_spans(call: relax.Call):
    """Per spatial axis ``(first tap, last tap, pad before, pad after)`` of the trimmed conv, or
    None if it drops nothing (or is not a conv this pass covers). Cheap: no weight is read."""
    attrs = call.attrs
    if str(attrs.data_layout) != "NCHW" or str(attrs.kernel_layout) != "OIHW":
        return None
    weight, shape = call.args[1], shape_dims(call.args[0])
    if not (isinstance(weight, tvm.ir.Constant) and hasattr(weight, "value")) or shape is None:
        return None
    if shape[2] is None or shape[3] is None:  # a symbolic batch is fine: only H and W matter
        return None
    kernel = [int(d) for d in weight.value.shape[2:]]
    top, left, bottom, right = (int(p) for p in attrs.padding)
    spans, trimmed = [], False
    for i, (before, after) in enumerate(((top, bottom), (left, right))):
        kept = kept_taps(
            shape[2 + i], before, after, kernel[i], int(attrs.dilation[i]), int(attrs.strides[i])
        )
        trimmed |= kept is not None
        spans.append(kept or (0, kernel[i] - 1, before, after))
    return spans if trimmed else None


def _trim(call: relax.Call, spans):
    """The trimmed conv's ``(weight slice, padding, dilation)`` for its :func:`_trimmed_spans`."""
    (r0, r1, top, bottom), (c0, c1, left, right) = spans
    sliced = call.args[1].value.numpy()[:, :, r0 : r1 + 1, c0 : c1 + 1]
    dilation = [1 if last == first else int(d) for (first, last, *_), d in zip(spans, call.attrs.dilation)]
    return np.ascontiguousarray(sliced), [top, left, bottom, right], dilation


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    def visit_call_(self, call):
        call = super().visit_call_(call)
        if op_name(call) != _CONV2D:
            return call
        spans = _trimmed_spans(call)
        if spans is None:
            return call
        weight, padding, dilation = _trim(call, spans)
        a = call.attrs
        return relax.op.nn.conv2d(
            call.args[0],
            relax.const(weight),
            strides=list(a.strides),
            padding=padding,
            dilation=dilation,
            groups=int(a.groups),
            data_layout=str(a.data_layout),
            kernel_layout=str(a.kernel_layout),
            out_layout=str(a.out_layout),
            out_dtype=a.out_dtype,
        )


@tvm.transform.module_pass(opt_level=0, name="TrimPaddingTaps")
class TrimPaddingTaps:
    """Drop conv taps that read only zero padding (see the module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return rewrite_functions(mod, (_CONV2D,), lambda call: _trimmed_spans(call) is not None, _Rewriter)

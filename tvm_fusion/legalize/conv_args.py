"""What our conv2d legalizations share: the call's static shapes and target they all check first,
and the rounding of a vectorized extent up to whole vectors."""

from __future__ import annotations

import tvm
from tvm import relax


def static_shapes(call: relax.Call) -> tuple[list[int], list[int]] | None:
    """``(data shape, weight shape)`` of a conv2d call when both are static, else None."""
    dty, wty = call.args[0].ty, call.args[1].ty
    if not all(isinstance(t, relax.TensorType) and t.shape is not None for t in (dty, wty)):
        return None
    try:
        return [int(x) for x in dty.shape], [int(x) for x in wty.shape]
    except (TypeError, ValueError):  # symbolic dims
        return None


def out_dtype(attrs) -> str | None:
    """The conv's ``out_dtype``, None when it follows the input's."""
    text = "" if attrs.out_dtype is None else str(attrs.out_dtype)
    return None if text in ("", "void", "None") else text


def cpu_float32_nchw_conv(call: relax.Call) -> tuple[list[int], list[int]] | None:
    """``(data shape, weight shape)`` of a conv2d our CPU lowerings may take: an LLVM target in
    scope, NCHW / OIHW / NCHW, dilation 1, static 4-D float32 shapes and result; else None."""
    attrs = call.attrs
    target = tvm.target.Target.current(allow_none=True)
    if target is None or target.kind.name != "llvm":
        return None
    if (str(attrs.data_layout), str(attrs.kernel_layout), str(attrs.out_layout)) != ("NCHW", "OIHW", "NCHW"):
        return None
    if any(int(d) != 1 for d in attrs.dilation):
        return None
    shapes = static_shapes(call)
    if shapes is None or len(shapes[0]) != 4 or len(shapes[1]) != 4:
        return None
    dtypes = {str(call.args[0].ty.dtype), str(call.args[1].ty.dtype), out_dtype(attrs) or "float32"}
    return shapes if dtypes == {"float32"} else None


def padded_width(width: int, lanes: int) -> int:
    """``width`` (a depthwise conv's output width, a Winograd row's tile count) when it is a whole
    number of vectors of ``lanes`` or of 8 lanes (a 256-bit vector), else rounded up to a multiple
    of 8 (or ``lanes`` when the SIMD width is smaller); the extra columns read zeros and are
    cropped or never read."""
    step = min(lanes, 8)  # divides lanes: a whole number of lanes-vectors is one of steps too
    return -(-width // step) * step

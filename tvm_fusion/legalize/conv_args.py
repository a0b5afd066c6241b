"""What our conv2d legalizations share: the call's static shapes and target they all check first,
and the rounding of a vectorized extent up to whole vectors."""

from __future__ import annotations

import tvm
from tvm import relax, tirx


def static_shapes(call: relax.Call, symbolic_batch: bool = False) -> tuple[list, list[int]] | None:
    """``(data shape, weight shape)`` of a conv2d call when both are static, else None. With
    ``symbolic_batch`` the data's first dim may be symbolic: it is then returned as its PrimExpr
    (a model exported with a dynamic batch keeps every other dim static)."""
    dty, wty = call.args[0].ty, call.args[1].ty
    if not all(isinstance(t, relax.TensorType) and t.shape is not None for t in (dty, wty)):
        return None
    dims = list(dty.shape)
    batch = dims[:1] if symbolic_batch and dims and not isinstance(dims[0], tirx.IntImm) else []
    try:
        return batch + [int(x) for x in dims[len(batch) :]], [int(x) for x in wty.shape]
    except (TypeError, ValueError):  # symbolic dims
        return None


def out_dtype(attrs) -> str | None:
    """The conv's ``out_dtype``, None when it follows the input's."""
    text = "" if attrs.out_dtype is None else str(attrs.out_dtype)
    return None if text in ("", "void", "None") else text


def cpu_float32_nchw_conv(call: relax.Call) -> tuple[list, list[int]] | None:
    """``(data shape, weight shape)`` of a conv2d our CPU lowerings may take: an LLVM target in
    scope, NCHW / OIHW / NCHW, dilation 1, 4-D float32 shapes and result, static but for the
    batch (a PrimExpr when symbolic: the lowerings keep it an outer loop); else None."""
    attrs = call.attrs
    target = tvm.target.Target.current(allow_none=True)
    if target is None or target.kind.name != "llvm":
        return None
    if (str(attrs.data_layout), str(attrs.kernel_layout), str(attrs.out_layout)) != ("NCHW", "OIHW", "NCHW"):
        return None
    if any(int(d) != 1 for d in attrs.dilation):
        return None
    shapes = static_shapes(call, symbolic_batch=True)
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

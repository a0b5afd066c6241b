"""LinearResizeAsMatmul: a bilinear resize of a small map becomes two matmuls with constant
interpolation matrices.

Why: TOPI's ``resize2d`` computes every output pixel on its own: source coordinates, floors,
clamps and four gathered reads, which vectorize badly. Segmentation heads end with such a resize:
torchvision's ``deeplabv3_mobilenet_v3_large`` upsamples 21x14x14 logits to 224x224 in 1.07 ms,
where ONNX Runtime takes 0.34 ms. Bilinear interpolation is separable, ``out = A_h · X · A_wᵀ``,
with at most two non-zeros per row of ``A_h`` (out_h x in_h) and ``A_w`` (out_w x in_w): as dense
matmuls the resize is a GEMM our Contraction rule runs near the FMA peak. Dense matrices do
in_h / 2 times the interpolation's multiplies, so only maps up to ``MAX_INPUT`` rows and columns
are rewritten.

The weights follow TOPI's linear resize (``topi.image.resize``): source coordinate per
``coordinate_transformation_mode``, ``floor``, neighbours clamped to the edge, ``lerp`` weights
``1 - t`` and ``t``. They are computed in float64 and stored in float32, so the result differs from
TOPI's float32 coordinate arithmetic by rounding only. (align_corners to a size of 1 would read
source 0 here, as PyTorch and ONNX Runtime do; TOPI divides by ``size - 1`` and such a model
already fails at ``FoldConstant``, before this pass.)
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from ..ir import dtype_of, op_name, rewrite_functions, shape_dims
from ..legalize.conv_args import out_dtype

__all__ = ["LinearResizeAsMatmul", "interpolation_matrix"]

MAX_INPUT = 32  # input rows / columns: the dense matmul's extra work grows with them
_RESIZE = "relax.image.resize2d"
_MODES = ("half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric")


def interpolation_matrix(size_in: int, size_out: int, mode: str) -> np.ndarray:
    """``(size_out, size_in)`` weights of 1-D linear interpolation, as TOPI computes it."""
    if mode not in _MODES:
        raise ValueError(f"unknown coordinate_transformation_mode {mode!r}: one of {', '.join(_MODES)}")
    x = np.arange(size_out, dtype=np.float64)
    scale = size_in / size_out
    if mode == "align_corners":
        source = x * ((size_in - 1) / (size_out - 1)) if size_out > 1 else np.zeros_like(x)
    elif mode == "asymmetric":
        source = x * scale
    elif mode == "pytorch_half_pixel" and size_out == 1:
        source = np.zeros_like(x)
    else:  # half_pixel, pytorch_half_pixel
        source = (x + 0.5) * scale - 0.5
    low = np.floor(source)
    t = source - low
    matrix = np.zeros((size_out, size_in))
    rows = np.arange(size_out)
    np.add.at(matrix, (rows, np.clip(low, 0, size_in - 1).astype(int)), 1.0 - t)
    np.add.at(matrix, (rows, np.clip(low + 1, 0, size_in - 1).astype(int)), t)
    return matrix


def _matrices(call: relax.Call):
    """``(A_h, A_wᵀ)`` in float32 for a resize this pass rewrites, else None."""
    attrs = call.attrs
    mode = str(attrs.coordinate_transformation_mode)
    if str(attrs.method) != "linear" or str(attrs.layout) != "NCHW" or mode not in _MODES:
        return None
    if any(float(r) != 0.0 for r in attrs.roi) or out_dtype(attrs) not in (None, "float32"):
        return None
    shape, out = shape_dims(call.args[0]), shape_dims(call)
    if shape is None or out is None or len(shape) != 4 or None in (*shape[2:], *out[2:]):
        return None
    if dtype_of(call.args[0]) != "float32" or max(shape[2:]) > MAX_INPUT:
        return None
    (h_in, w_in), (h_out, w_out) = shape[2:], out[2:]
    if (h_in, w_in) == (h_out, w_out):
        return None
    return (
        interpolation_matrix(h_in, h_out, mode).astype(np.float32),
        interpolation_matrix(w_in, w_out, mode).T.astype(np.float32),
    )


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    def visit_call_(self, call):
        # decided on the original call, which has its type; the visited one may not
        matrices = _matrices(call) if op_name(call) == _RESIZE else None
        call = super().visit_call_(call)
        if matrices is None:
            return call
        rows, columns = matrices
        along_w = self.builder_.emit(relax.op.matmul(call.args[0], relax.const(columns)))
        return relax.op.matmul(relax.const(rows), along_w)


@tvm.transform.module_pass(opt_level=0, name="LinearResizeAsMatmul")
class LinearResizeAsMatmul:
    """Rewrite small bilinear NCHW resizes as ``A_h · X · A_wᵀ`` (see the module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return rewrite_functions(mod, (_RESIZE,), lambda call: _matrices(call) is not None, _Rewriter)

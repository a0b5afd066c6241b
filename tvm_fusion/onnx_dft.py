"""ONNX ``DFT`` and ``STFT`` as one matmul with a constant DFT matrix (the Relax ONNX frontend has
neither).

The torch exporters write ``torch.fft`` calls (FNet's token mixing, spectral layers) as ``DFT``
nodes: real or complex signals, complex written as a trailing axis of 2 (real, imaginary). For a
static transform length L the DFT along one axis is a matrix product, and with the complex axis
interleaved into the contraction it is a single one: the signal axis moved next to the complex
axis, flattened to ``[..., n·c]`` (c = 1 for a real signal, 2 for a complex one), times a
``[n·c, 2K]`` matrix whose entries are the twiddles ``cos θ`` and ``±sin θ``, gives ``[..., K, 2]``.
That is O(L²) multiply-adds per signal instead of an FFT's O(L log L), but it is a GEMM, which the
Contraction rule schedules near the FMA peak (FNet's own TPU implementation does the same).
``STFT`` (``torch.stft`` from the dynamo exporter: in-model spectrograms) is the same matmul over
frames gathered from the signal, with the window folded into the matrix.
"""

from __future__ import annotations

import numpy as np
from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend as frontend

from .ir import constant_value, op_name, shape_dims
from .onnx_inputs import constant_input, constant_int


class DFT(frontend.OnnxOpConverter):
    """``DFT`` (opset 17: ``axis`` attribute; opset 20: ``axis`` input) over a static axis."""

    @classmethod
    def _impl_v17(cls, bb, inputs, attr, params):
        length = constant_int(inputs[1], params, "dft_length")  # absent inputs read as None
        return _dft(
            bb, inputs[0], attr.get("axis", 1), length, attr.get("inverse", 0), attr.get("onesided", 0)
        )

    @classmethod
    def _impl_v20(cls, bb, inputs, attr, params):
        length = constant_int(inputs[1], params, "dft_length")
        axis = constant_int(inputs[2], params, "axis")
        return _dft(
            bb,
            inputs[0],
            -2 if axis is None else axis,
            length,
            attr.get("inverse", 0),
            attr.get("onesided", 0),
        )


def dft_matrix(n: int, length: int, bins: int, complex_input: bool, inverse: bool) -> np.ndarray:
    """``[n·c, 2·bins]``: row ``j·c + p`` (p: real, imaginary part of input sample j) to column
    ``2k + q`` (q: real, imaginary part of bin k). Samples past ``length`` are not read; ``n`` below
    ``length`` is zero padding, which drops rows. Built in float64; ``θ = 2π (j·k mod L) / L``."""
    j = np.arange(n)[:, None]
    k = np.arange(bins)[None, :]
    theta = 2 * np.pi * ((j * k) % length) / length
    cos, sin = np.cos(theta), (1.0 if inverse else -1.0) * np.sin(theta)  # e^{±iθ} = cos + i·sin
    c = 2 if complex_input else 1
    w = np.zeros((n, c, bins, 2))
    w[:, 0, :, 0], w[:, 0, :, 1] = cos, sin  # (a + ib)(cos + i·sin): real a·cos − b·sin
    if complex_input:
        w[:, 1, :, 0], w[:, 1, :, 1] = -sin, cos  # imaginary a·sin + b·cos
    if inverse:
        w /= length
    return w.reshape(n * c, bins * 2)


def _dft(bb: relax.BlockBuilder, data, axis: int, length: int | None, inverse: int, onesided: int):
    shape = _float_shape(data)
    rank = len(shape)
    if axis < 0:
        axis += rank
    if not 0 <= axis <= rank - 2:
        raise ValueError(f"DFT: axis {axis} is outside the signal axes of a rank-{rank} input")
    real = _real_part_of_zero_imaginary(bb, data, rank) if shape_dims(data)[-1] == 2 else None
    if real is not None:  # half the contraction
        data, shape = real, _float_shape(real)
    dims = shape_dims(data)
    c, n = dims[-1], dims[axis]
    if c not in (1, 2) or n is None:
        raise ValueError(
            f"DFT: needs a static length along axis {axis} and a last axis of 1 (real) or 2 (complex); "
            f"the input's shape is {list(shape)}"
        )
    if inverse and onesided:
        raise ValueError("DFT: an inverse one-sided transform (irfft) is not supported")
    length = n if length is None else length
    if length < 1:
        raise ValueError(f"DFT: dft_length {length} must be positive")
    if length < n:  # the signal is truncated to its first `length` samples
        data = bb.normalize(relax.op.strided_slice(data, axes=[axis], begin=[0], end=[length]))
        n = length
    bins = length // 2 + 1 if onesided else length
    # the signal axis next to the complex axis, both flattened into the contraction
    order = [d for d in range(rank - 1) if d != axis] + [axis, rank - 1]
    moved = data if axis == rank - 2 else bb.normalize(relax.op.permute_dims(data, order))
    lead = [shape[d] for d in order[:-2]]
    flat = relax.op.reshape(moved, lead + [n * c])
    dtype = str(data.ty.dtype)
    matrix = relax.const(dft_matrix(n, length, bins, c == 2, bool(inverse)).astype(dtype), dtype)
    out = relax.op.reshape(relax.op.matmul(flat, matrix), lead + [bins, 2])
    if axis == rank - 2:
        return out
    return relax.op.permute_dims(out, [int(i) for i in np.argsort(order)])


def _real_part_of_zero_imaginary(bb: relax.BlockBuilder, data, rank: int):
    """``x`` when ``data`` is ``concat([x, zeros], axis=-1)`` with ``x`` one wide on that axis: the
    dynamo exporter makes a real signal complex that way before a complex DFT. Else None."""
    value = bb.lookup_binding(data) if isinstance(data, relax.Var) else data  # the frontend passes calls
    if (
        op_name(value) != "relax.concat"
        or value.attrs.axis is None
        or int(value.attrs.axis) % rank != rank - 1
    ):
        return None
    parts = value.args[0]
    if not isinstance(parts, relax.Tuple) or len(parts.fields) != 2:
        return None
    real, imaginary = parts.fields
    zeros = constant_value(imaginary, _Bindings(bb))
    if zeros is None or np.any(zeros) or shape_dims(real)[-1] != 1:
        return None
    return real


class _Bindings:
    """The block builder's bindings as the var -> value mapping ``ir.constant_value`` reads."""

    def __init__(self, bb: relax.BlockBuilder):
        self.bb = bb

    def get(self, var):
        return self.bb.lookup_binding(var) if isinstance(var, relax.Var) else None


def _float_shape(data) -> list:
    """The dims of a float tensor of known rank (a dim may be symbolic)."""
    ty = getattr(data, "ty", None)
    if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
        raise ValueError("DFT: the input's rank and shape must be known at import")
    if not str(ty.dtype).startswith("float"):
        raise ValueError(f"DFT: a {ty.dtype} input is not supported (float only)")
    return list(ty.shape.values)


class STFT(frontend.OnnxOpConverter):
    """``STFT`` (opset 17): frames gathered by a constant index table, then one matmul by the DFT
    matrix with the window folded into its rows. ``frame_step``, ``window`` and
    ``frame_length`` must be constants."""

    @classmethod
    def _impl_v17(cls, bb, inputs, attr, params):
        signal, step = inputs[0], constant_int(inputs[1], params, "frame_step")
        shape, dims = _float_shape(signal), shape_dims(signal)
        if len(dims) != 3 or dims[-1] not in (1, 2) or dims[1] is None:
            raise ValueError(
                f"STFT: needs a [batch, samples, 1 or 2] signal of static length, not {list(shape)}"
            )
        c, samples = dims[-1], dims[1]
        window = constant_input(inputs[2], params, "window")
        if window is not None:
            window = window.astype(np.float64)
        frame = constant_int(inputs[3], params, "frame_length")
        if frame is None:  # the window's length, else the whole signal (ONNX's reference)
            frame = len(window) if window is not None else samples
        if window is None:
            window = np.ones(frame)
        if len(window) != frame:
            raise ValueError(f"STFT: window of {len(window)} samples for frames of {frame}")
        if step is None or step < 1 or not 1 <= frame <= samples:
            raise ValueError(f"STFT: {samples} samples hold no frame of {frame} at step {step}")
        frames = (samples - frame) // step + 1
        bins = frame // 2 + 1 if attr.get("onesided", 1) else frame
        starts = np.arange(frames)[:, None] * step + np.arange(frame)[None, :]
        framed = relax.op.take(
            signal, relax.const(starts.astype("int64")), axis=1
        )  # [batch, frames, frame, c]
        flat = relax.op.reshape(framed, [shape[0], frames, frame * c])
        dtype = str(signal.ty.dtype)
        matrix = dft_matrix(frame, frame, bins, c == 2, inverse=False) * np.repeat(window, c)[:, None]
        out = relax.op.matmul(flat, relax.const(matrix.astype(dtype), dtype))
        return relax.op.reshape(out, [shape[0], frames, bins, 2])

"""ONNX ``DFT`` imported as a matmul with a constant DFT matrix (``tvm_fusion/onnx_dft.py``)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from conftest import HAS_GPU, ort_run, rel_err, run_executable
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from tvm import relax

import tvm_fusion
from tvm_fusion.frontend import import_onnx
from tvm_fusion.ir import op_calls
from tvm_fusion.onnx_dft import dft_matrix
from tvm_fusion.onnx_import import ImportNodeError
from tvm_fusion.passes import SliceBeforeLayoutOps


def dft_model(shape, axis, length=None, inverse=0, onesided=0, opset=20):
    """One ``DFT`` node over a float32 input ``x`` (opset 17: ``axis`` attribute; 20: input)."""
    inits, inputs, attrs = [], ["x", ""], {"inverse": inverse, "onesided": onesided}
    if length is not None:
        inits.append(numpy_helper.from_array(np.array(length, np.int64), "dft_length"))
        inputs[1] = "dft_length"
    if opset >= 20:
        inits.append(numpy_helper.from_array(np.array(axis, np.int64), "axis"))
        inputs.append("axis")
    else:
        attrs["axis"] = axis
    out = list(shape)
    n = length or shape[axis]
    out[axis], out[-1] = (n // 2 + 1 if onesided else n), 2
    graph = helper.make_graph(
        [helper.make_node("DFT", inputs, ["y"], name="/fourier/DFT", **attrs)],
        "dft",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, out)],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _built_and_ort(model, shape, cpu_target):
    feeds = {"x": np.random.default_rng(3).standard_normal(shape).astype(np.float32)}
    built = tvm_fusion.build(model, cpu_target, tuning_logs=None)
    return built, run_executable(built.executable, feeds), ort_run(model, feeds)


@pytest.mark.parametrize(
    "shape, axis, length, inverse, onesided, opset",
    [
        ((2, 16, 1), 1, None, 0, 0, 20),  # real signal
        ((2, 16, 2), 1, None, 0, 0, 20),  # complex signal
        ((1, 12, 10, 2), 1, None, 0, 0, 20),  # not the last signal axis: moved next to the complex axis
        ((1, 12, 10, 2), 2, None, 0, 0, 17),  # opset 17's axis attribute
        ((1, 12, 10, 1), -2, None, 0, 0, 20),  # a negative axis
        ((3, 20, 1), 1, 16, 0, 0, 20),  # dft_length below the signal: truncated
        ((3, 20, 1), 1, 32, 0, 0, 20),  # dft_length above it: zero padded
        ((3, 20, 1), 1, None, 0, 1, 20),  # one-sided: 11 bins
        ((3, 21, 2), 1, None, 1, 0, 20),  # inverse, odd length
        ((2, 7, 5, 2), 1, None, 1, 0, 17),
    ],
)
def test_dft_matches_ort(shape, axis, length, inverse, onesided, opset, cpu_target):
    _, ours, ref = _built_and_ort(dft_model(shape, axis, length, inverse, onesided, opset), shape, cpu_target)
    assert ours.shape == ref.shape
    assert rel_err(ours, ref) < 1e-5


@pytest.mark.parametrize("complex_input", [False, True])
def test_dft_matrix_is_numpys_fft_over_interleaved_parts(complex_input):
    rng = np.random.default_rng(0)
    signal = rng.standard_normal(9) + (1j * rng.standard_normal(9) if complex_input else 0)
    parts = np.stack([signal.real, signal.imag], -1) if complex_input else signal.real[:, None]
    for inverse, expected in ((False, np.fft.fft(signal, 12)), (True, np.fft.ifft(signal, 12))):
        got = parts.reshape(-1) @ dft_matrix(9, 12, 12, complex_input, inverse)
        np.testing.assert_allclose(got[0::2] + 1j * got[1::2], expected, atol=1e-12)


def fnet_mixing():
    """FNet's ``fft.fftn(x, dim=(1, 2)).real`` plus its residual, as the dynamo exporter writes it:
    the real input made complex with zeros, a DFT over the tokens, one over the hidden axis, the
    real part."""
    zeros = numpy_helper.from_array(np.zeros((1, 24, 32, 1), np.float32), "zeros")
    axes = [numpy_helper.from_array(np.array(a, np.int64), f"axis{a}") for a in (1, 2)]
    minus_one = numpy_helper.from_array(np.array([-1], np.int64), "minus_one")
    real = numpy_helper.from_array(np.array(0, np.int64), "real")
    nodes = [
        helper.make_node("Unsqueeze", ["x", "minus_one"], ["x1"]),
        helper.make_node("Concat", ["x1", "zeros"], ["xc"], axis=-1),
        helper.make_node("DFT", ["xc", "", "axis1"], ["f1"]),
        helper.make_node("DFT", ["f1", "", "axis2"], ["f2"]),
        helper.make_node("Gather", ["f2", "real"], ["re"], axis=3),
        helper.make_node("Add", ["x", "re"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "fnet_mixing",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 24, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 24, 32])],
        [zeros, *axes, minus_one, real],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])


def test_fnet_fourier_mixing_is_two_gemms_and_matches_ort(cpu_target):
    model = fnet_mixing()
    built, ours, ref = _built_and_ort(model, (1, 24, 32), cpu_target)
    assert rel_err(ours, ref) < 1e-5
    matmuls = [
        gv.name_hint
        for gv, func in built.lowered.functions_items()
        if isinstance(func, tvm.tirx.PrimFunc) and "matmul" in gv.name_hint
    ]
    assert len(matmuls) == 2, matmuls
    # the token DFT reads only the real part (the zeros are not multiplied): [24, 48], not [48, 48];
    # of the hidden DFT only the real part is read: its matmul computes those columns, [64, 32]
    mod = import_onnx(model).mod
    assert _matmul_weights(mod) == [(24, 48), (64, 64)]
    assert _matmul_weights(SliceBeforeLayoutOps()(mod)) == [(24, 48), (64, 32)]


def _matmul_weights(mod) -> list[tuple]:
    calls = op_calls(mod["main"], {"relax.matmul"})
    return sorted(tuple(int(d) for d in call.args[1].ty.shape) for call in calls)


def test_dft_length_computed_at_run_time_is_named():
    model = dft_model((2, 16, 1), 1)
    graph = model.graph
    graph.input.append(helper.make_tensor_value_info("n", TensorProto.INT64, []))
    graph.node[0].input[1] = "n"
    with pytest.raises(ImportNodeError, match=r"node '/fourier/DFT' \(DFT.*dft_length must be a constant"):
        import_onnx(model)


def test_inverse_one_sided_dft_is_refused_by_name():
    with pytest.raises(ImportNodeError, match=r"'/fourier/DFT'.*inverse one-sided"):
        import_onnx(dft_model((2, 9, 2), 1, inverse=1, onesided=1))


def test_dft_imports_as_one_matmul_and_views():
    mod = import_onnx(dft_model((2, 16, 1), 1)).mod
    ops = set()
    relax.analysis.post_order_visit(
        mod["main"].body,
        lambda e: ops.add(e.op.name) if isinstance(e, relax.Call) and hasattr(e.op, "name") else None,
    )
    assert "relax.matmul" in ops and ops <= {"relax.matmul", "relax.reshape", "relax.permute_dims"}, ops


def test_fnet_fourier_mixing_builds_and_exports_for_cuda(tmp_path):
    model = fnet_mixing()
    path = tvm_fusion.build(model, {"kind": "cuda", "arch": "sm_80"}, tuning_logs=None).export(
        tmp_path / "fnet_mixing.so"
    )
    assert path.stat().st_size > 10_000
    if HAS_GPU:  # numerics where a GPU is present
        feeds = {"x": np.random.default_rng(3).standard_normal((1, 24, 32)).astype(np.float32)}
        ours = tvm_fusion.load(path)(*feeds.values())
        np.testing.assert_allclose(ours, ort_run(model, feeds), rtol=1e-4, atol=1e-5)


def stft_model(samples=200, frame=32, step=10, window=True, onesided=1, complex_signal=False):
    """One ``STFT`` node over a ``[2, samples, 1 or 2]`` signal, with a Hann window, or none and a
    ``frame_length`` (``frame=None``: neither, one frame of the whole signal)."""
    inits = [numpy_helper.from_array(np.array(step, np.int64), "step")]
    inputs = ["x", "step", "", ""]
    if window:
        inits.append(numpy_helper.from_array(np.hanning(frame).astype(np.float32), "window"))
        inputs[2] = "window"
    elif frame is not None:
        inits.append(numpy_helper.from_array(np.array(frame, np.int64), "frame"))
        inputs[3] = "frame"
    frame = samples if frame is None else frame
    frames, bins = (samples - frame) // step + 1, (frame // 2 + 1 if onesided else frame)
    shape = [2, samples, 2 if complex_signal else 1]
    graph = helper.make_graph(
        [helper.make_node("STFT", inputs, ["y"], name="/spectrogram/STFT", onesided=onesided)],
        "stft",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, frames, bins, 2])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), shape


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"window": False},
        {"onesided": 0},
        {"complex_signal": True, "onesided": 0},
        {"samples": 205, "step": 7},
    ],
    ids=[
        "hann-onesided",
        "frame-length-no-window",
        "two-sided",
        "complex-signal",
        "ragged-end",
    ],
)
def test_stft_matches_ort(kwargs, cpu_target):
    model, shape = stft_model(**kwargs)
    _, ours, ref = _built_and_ort(model, shape, cpu_target)
    assert ours.shape == ref.shape
    assert rel_err(ours, ref) < 1e-5


def test_stft_without_window_or_frame_length_is_one_frame_of_the_signal(cpu_target):
    """ONNX's reference evaluator (ONNX Runtime fails on this form)."""
    model, shape = stft_model(samples=48, window=False, frame=None)
    feeds = {"x": np.random.default_rng(3).standard_normal(shape).astype(np.float32)}
    ours = run_executable(tvm_fusion.build(model, cpu_target, tuning_logs=None).executable, feeds)
    reference = ReferenceEvaluator(model).run(None, feeds)[0]
    assert ours.shape == reference.shape == (2, 1, 25, 2)
    assert rel_err(ours, reference) < 1e-5

"""ONNX ``LSTM`` / ``GRU`` unrolled over their sequence (``tvm_fusion/onnx_rnn.py``), against ORT."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import HAS_GPU, ort_outputs, run_outputs
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import tvm_fusion
from tvm_fusion.frontend import import_onnx
from tvm_fusion.onnx_import import ImportNodeError

STEPS, BATCH, FEATURES, HIDDEN = 5, 2, 6, 4


def rnn_model(
    op: str,
    direction: str = "forward",
    bias: bool = True,
    initial: bool = False,
    peepholes: bool = False,
    batch_first: bool = False,
    **attrs,
):
    """One ``LSTM`` / ``GRU`` node with random constant weights; every output is a graph output."""
    rng = np.random.default_rng(0)
    gates = 4 if op == "LSTM" else 3
    dirs = 2 if direction == "bidirectional" else 1
    const = lambda name, *shape: numpy_helper.from_array(  # noqa: E731
        (rng.standard_normal(shape) * 0.5).astype(np.float32), name
    )
    inits = [const("W", dirs, gates * HIDDEN, FEATURES), const("R", dirs, gates * HIDDEN, HIDDEN)]
    inputs = ["x", "W", "R", "", "", "", "", ""]
    if bias:
        inits.append(const("B", dirs, 2 * gates * HIDDEN))
        inputs[3] = "B"
    state_shape = (BATCH, dirs, HIDDEN) if batch_first else (dirs, BATCH, HIDDEN)
    if initial:
        inits.append(const("h0", *state_shape))
        inputs[5] = "h0"
        if op == "LSTM":
            inits.append(const("c0", *state_shape))
            inputs[6] = "c0"
    if peepholes:
        inits.append(const("P", dirs, 3 * HIDDEN))
        inputs[7] = "P"
    inputs = inputs[: 8 if op == "LSTM" else 6]
    while inputs[-1] == "":
        inputs.pop()
    outputs = ["y", "y_h", "y_c"][: 3 if op == "LSTM" else 2]
    y_shape = (BATCH, STEPS, dirs, HIDDEN) if batch_first else (STEPS, dirs, BATCH, HIDDEN)
    node = helper.make_node(
        op,
        inputs,
        outputs,
        name=f"/encoder/{op.lower()}",
        hidden_size=HIDDEN,
        direction=direction,
        layout=int(batch_first),
        **attrs,
    )
    x_shape = (BATCH, STEPS, FEATURES) if batch_first else (STEPS, BATCH, FEATURES)
    graph = helper.make_graph(
        [node],
        "rnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [
            helper.make_tensor_value_info(n, TensorProto.FLOAT, y_shape if n == "y" else state_shape)
            for n in outputs
        ],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])
    model.ir_version = 8
    return model, {"x": rng.standard_normal(x_shape).astype(np.float32)}


CASES = {
    "lstm": dict(op="LSTM"),
    "lstm-reverse-no-bias": dict(op="LSTM", direction="reverse", bias=False),
    "lstm-bidirectional-initial-states": dict(op="LSTM", direction="bidirectional", initial=True),
    "lstm-peepholes-clip": dict(op="LSTM", peepholes=True, clip=0.8),
    "lstm-batch-first": dict(op="LSTM", batch_first=True, initial=True, direction="bidirectional"),
    "lstm-relu-cell": dict(op="LSTM", activations=["Sigmoid", "Relu", "Tanh"]),
    "lstm-per-direction-activations": dict(
        op="LSTM",
        direction="bidirectional",
        activations=["Sigmoid", "Tanh", "Tanh", "Sigmoid", "Relu", "Tanh"],
    ),
    "gru-clip": dict(op="GRU", clip=0.5, initial=True),
    "gru": dict(op="GRU"),
    "gru-linear-before-reset": dict(op="GRU", linear_before_reset=1, initial=True),
    "gru-bidirectional-batch-first": dict(op="GRU", direction="bidirectional", batch_first=True),
    "gru-no-bias-reverse": dict(op="GRU", bias=False, direction="reverse", linear_before_reset=1),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_rnn_matches_ort(case, cpu_target):
    """Against ONNX Runtime; batch-first layouts against ONNX's reference evaluator (ORT refuses them)."""
    model, feeds = rnn_model(**CASES[case])
    result = tvm_fusion.build(model, cpu_target, tuning_logs=None)
    if CASES[case].get("batch_first"):
        references = ReferenceEvaluator(model).run(None, feeds)
    else:
        references = ort_outputs(model, feeds)
    for ours, reference in zip(run_outputs(result.executable, feeds), references, strict=True):
        assert ours.shape == reference.shape
        np.testing.assert_allclose(ours, reference, rtol=1e-5, atol=1e-5)


def test_the_input_projection_is_one_matmul_for_the_whole_sequence():
    """Per direction: one matmul of all steps by the input weights, then one per step."""
    model, _ = rnn_model("LSTM")
    mod = import_onnx(model).mod
    shapes = []
    for call in tvm_fusion.ir.op_calls(mod["main"], {"relax.matmul"}):
        shapes.append(tuple(int(d) for d in call.ty.shape))
    assert shapes.count((STEPS, BATCH, 4 * HIDDEN)) == 1
    assert shapes.count((BATCH, 4 * HIDDEN)) == STEPS


@pytest.mark.parametrize(
    "attrs, message",
    [
        (dict(input_forget=1), "input_forget"),
        (dict(activations=["Sigmoid", "Elu", "Tanh"]), "activation 'elu' is not supported"),
        (dict(activation_alpha=[0.5]), "alpha / beta"),
        (dict(direction="bidirectional", activations=["Sigmoid", "Tanh", "Tanh"]), "3 activations given"),
    ],
)
def test_unsupported_attributes_are_named(attrs, message):
    model, _ = rnn_model("LSTM", **attrs)
    with pytest.raises(ImportNodeError, match=rf"'/encoder/lstm' \(LSTM.*{message}"):
        import_onnx(model)


def test_shorter_sequence_lengths_are_refused_by_name():
    model, _ = rnn_model("GRU")
    model.graph.initializer.append(numpy_helper.from_array(np.array([STEPS, 3], np.int32), "lens"))
    node = model.graph.node[0]
    node.input.extend([""] * (5 - len(node.input)))
    node.input[4] = "lens"
    with pytest.raises(ImportNodeError, match="sequence_lens shorter than the sequence"):
        import_onnx(model)


@pytest.mark.parametrize("op", ["LSTM", "GRU"])
def test_rnn_builds_and_exports_for_cuda(op, tmp_path):
    model, feeds = rnn_model(op, direction="bidirectional", initial=True)
    path = tvm_fusion.build(model, {"kind": "cuda", "arch": "sm_80"}, tuning_logs=None).export(
        tmp_path / "rnn.so"
    )
    assert path.stat().st_size > 10_000
    if HAS_GPU:
        got = tvm_fusion.load(path)(*feeds.values())
        np.testing.assert_allclose(got[0], ort_outputs(model, feeds)[0], rtol=1e-4, atol=1e-5)

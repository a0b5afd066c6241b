"""RemoveEmptyTensors: empty concat operands are dropped, no kernel computes an empty tensor."""

from __future__ import annotations

import numpy as np
import onnx
from conftest import ort_outputs, run_outputs
from onnx import TensorProto, helper, numpy_helper

import tvm_fusion
from tvm_fusion.frontend import import_onnx
from tvm_fusion.ir import op_calls
from tvm_fusion.passes import RemoveEmptyTensors

HEAD = 8


def partial_rotary(rotary_dim: int, empty_output: bool = False):
    """Phi-3's rotary embedding: ``concat([rotate_half(x[..., :r]), x[..., r:]], -1)``; with ``r``
    the whole head the pass-through part is ``[1, 2, 4, 0]``. Optionally that empty part is an
    output of its own."""
    const = lambda name, value: numpy_helper.from_array(np.array(value, np.int64), name)  # noqa: E731
    inits = [
        const("axis", [3]),
        const("zero", [0]),
        const("half", [rotary_dim // 2]),
        const("rotary", [rotary_dim]),
        const("end", [HEAD]),
    ]
    nodes = [
        helper.make_node("Slice", ["x", "zero", "rotary", "axis"], ["rot"]),
        helper.make_node("Slice", ["x", "rotary", "end", "axis"], ["passthrough"]),
        helper.make_node("Slice", ["rot", "zero", "half", "axis"], ["first"]),
        helper.make_node("Slice", ["rot", "half", "rotary", "axis"], ["second"]),
        helper.make_node("Neg", ["second"], ["negated"]),
        helper.make_node("Concat", ["negated", "first"], ["rotated"], axis=-1),
        helper.make_node("Mul", ["rotated", "rot"], ["scaled"]),
        helper.make_node("Concat", ["scaled", "passthrough"], ["y"], axis=-1),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 4, HEAD])]
    if empty_output:
        outputs.append(helper.make_tensor_value_info("passthrough", TensorProto.FLOAT, [1, 2, 4, 0]))
    graph = helper.make_graph(
        nodes,
        "partial_rotary",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 4, HEAD])],
        outputs,
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    feeds = {"x": np.random.default_rng(0).standard_normal((1, 2, 4, HEAD)).astype(np.float32)}
    return onnx.shape_inference.infer_shapes(model), feeds


def test_whole_head_rotary_builds_and_matches_ort(cpu_target):
    model, feeds = partial_rotary(HEAD)
    result = tvm_fusion.build(model, cpu_target, tuning_logs=None)
    np.testing.assert_allclose(
        run_outputs(result.executable, feeds)[0], ort_outputs(model, feeds)[0], rtol=1e-6
    )


def test_the_empty_operand_is_dropped_and_its_slice_is_gone():
    model, _ = partial_rotary(HEAD)
    mod = import_onnx(model).mod
    assert any(
        0 in [int(d) for d in call.ty.shape] for call in op_calls(mod["main"], {"relax.strided_slice"})
    )
    rewritten = RemoveEmptyTensors()(mod)
    concats = op_calls(rewritten["main"], {"relax.concat"})
    assert all(len(call.args[0].fields) == 2 for call in concats) and len(concats) == 1  # rotate_half's
    assert all(
        0 not in [int(d) for d in call.ty.shape]
        for call in op_calls(rewritten["main"], {"relax.strided_slice"})
    )


def test_a_partial_rotary_is_left_alone():
    model, _ = partial_rotary(HEAD // 2)
    mod = import_onnx(model).mod
    assert RemoveEmptyTensors()(mod).same_as(mod)


def test_an_empty_output_is_a_constant_and_builds(cpu_target):
    model, feeds = partial_rotary(HEAD, empty_output=True)
    result = tvm_fusion.build(model, cpu_target, tuning_logs=None)
    ours, reference = run_outputs(result.executable, feeds), ort_outputs(model, feeds)
    assert ours[1].shape == reference[1].shape == (1, 2, 4, 0)
    np.testing.assert_allclose(ours[0], reference[0], rtol=1e-6)
    rewritten = RemoveEmptyTensors()(import_onnx(model).mod)
    shapes = [
        [int(d) for d in call.ty.shape] for call in op_calls(rewritten["main"], {"relax.strided_slice"})
    ]
    assert all(0 not in shape for shape in shapes)

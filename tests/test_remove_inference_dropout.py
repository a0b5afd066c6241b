import numpy as np
import tvm
from conftest import ort_outputs, run_outputs
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

from tvm_fusion import build
from tvm_fusion.frontend import import_onnx
from tvm_fusion.ir import op_calls
from tvm_fusion.passes import RemoveInferenceDropout


def dropout_model():
    """x -> MatMul -> Add -> Dropout (ratio 0.1, training_mode false) -> Add x -> y, as the dynamo
    exporter writes a Dropout of a module traced outside eval()."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.standard_normal((16, 16)).astype("float32"), "w"),
        numpy_helper.from_array(rng.standard_normal(16).astype("float32"), "b"),
        numpy_helper.from_array(np.array(0.1, "float32"), "ratio"),
        numpy_helper.from_array(np.array(False), "training"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["mm"]),
        helper.make_node("Add", ["mm", "b"], ["biased"]),
        helper.make_node("Dropout", ["biased", "ratio", "training"], ["dropped"]),
        helper.make_node("Add", ["dropped", "x"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "dropout",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 16])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model, {"x": rng.standard_normal((4, 16)).astype("float32")}


def test_dropout_is_its_input_and_leaves_no_kernel(cpu_target):
    model, feeds = dropout_model()
    mod = import_onnx(model).mod
    assert op_calls(mod["main"], {"relax.nn.dropout"})
    removed = RemoveInferenceDropout()(mod)
    assert not op_calls(removed["main"], {"relax.nn.dropout"})
    reference = ort_outputs(model, feeds)[0]
    np.testing.assert_allclose(run_outputs(removed, feeds)[0], reference, rtol=1e-5, atol=1e-5)
    result = build(model, cpu_target, name="dropout", tuning_logs=None)
    kernels = [gv.name_hint for gv, f in result.lowered.functions.items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert kernels and not [k for k in kernels if "dropout" in k], kernels
    assert len(kernels) == 1, kernels  # matmul, bias and residual add in one kernel again
    np.testing.assert_allclose(run_outputs(result.executable, feeds)[0], reference, rtol=1e-5, atol=1e-5)


def test_a_mask_that_is_read_becomes_ones():
    x = relax.Var("x", relax.TensorType((2, 3), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            dropped = bb.emit(relax.op.nn.dropout(x, 0.5))
            out = bb.emit_output(
                relax.op.multiply(
                    bb.emit(relax.TupleGetItem(dropped, 0)), bb.emit(relax.TupleGetItem(dropped, 1))
                )
            )
        bb.emit_func_output(out)
    mod = bb.get()
    removed = RemoveInferenceDropout()(mod)
    assert not op_calls(removed["main"], {"relax.nn.dropout"})
    feeds = [np.arange(6, dtype="float32").reshape(2, 3)]
    np.testing.assert_array_equal(run_outputs(removed, feeds)[0], feeds[0])


def test_other_functions_are_left_as_they_are():
    """Kernels already split off (Primitive functions) keep their bindings, aliases included."""
    x = relax.Var("x", relax.TensorType((2, 3), "float32"))
    bb = relax.BlockBuilder()
    a = relax.Var("a", relax.TensorType((2, 3), "float32"))
    with bb.function("kernel", [a], {"Primitive": True}, private=True):
        with bb.dataflow():
            alias = bb.emit(a)
            out = bb.emit_output(relax.op.add(alias, a))
        bb.emit_func_output(out)
    with bb.function("main", [x]):
        with bb.dataflow():
            dropped = bb.emit(relax.TupleGetItem(bb.emit(relax.op.nn.dropout(x, 0.5)), 0))
            out = bb.emit_output(relax.op.nn.relu(dropped))
        bb.emit_func_output(out)
    mod = bb.get()
    removed = RemoveInferenceDropout()(mod)
    assert not op_calls(removed["main"], {"relax.nn.dropout"})
    assert removed["kernel"].same_as(mod["kernel"])

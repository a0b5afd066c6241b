import numpy as np
import pytest
from conftest import max_abs_err, ort_run, run_executable, run_relax
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

from tvm_fusion import build
from tvm_fusion.frontend import import_onnx
from tvm_fusion.ir import op_calls, static_shape
from tvm_fusion.passes import PoolBeforePointwiseConv


def transition_model(
    *,
    kernel: int = 1,
    bias: bool = False,
    pool: dict | None = None,
    second_reader: bool = False,
    size: int = 12,
):
    """DenseNet's transition: x -> relu -> Conv(kernel, 16 -> 8) [+ bias] -> AveragePool -> y
    (``second_reader``: the conv's result is also an output)."""
    rng = np.random.default_rng(kernel * 10 + bias)
    pool = pool or {"kernel_shape": [2, 2], "strides": [2, 2]}
    weight = numpy_helper.from_array(rng.standard_normal((8, 16, kernel, kernel)).astype("float32"), "w")
    inits = [weight]
    conv_inputs = ["r", "w"]
    if bias:
        inits.append(numpy_helper.from_array(rng.standard_normal(8).astype("float32"), "b"))
        conv_inputs.append("b")
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("Conv", conv_inputs, ["c"], pads=[kernel // 2] * 4),
        helper.make_node("AveragePool", ["c"], ["y"], **pool),
    ]
    pads = pool.get("pads", [0] * 4)
    out = (size + pads[0] + pads[2] - pool["kernel_shape"][0]) // pool["strides"][0] + 1
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, out, out])]
    if second_reader:
        outputs.append(helper.make_tensor_value_info("c", TensorProto.FLOAT, [1, 8, size, size]))
    graph = helper.make_graph(
        nodes,
        "transition",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, size, size])],
        outputs,
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    feeds = {"x": rng.standard_normal((1, 16, size, size)).astype("float32")}
    return model, feeds


def imported(model):
    """The Relax module as the pipeline hands it to the pass (the bias reshape folded)."""
    return relax.transform.FoldConstant()(import_onnx(model).mod)


def conv_input_shapes(mod) -> list[tuple[int, ...]]:
    return [static_shape(call.args[0]) for call in op_calls(mod["main"], {"relax.nn.conv2d"})]


@pytest.mark.parametrize(
    "bias, pool, size",
    [
        (False, {"kernel_shape": [2, 2], "strides": [2, 2]}, 12),
        (True, {"kernel_shape": [2, 2], "strides": [2, 2]}, 12),
        (False, {"kernel_shape": [3, 3], "strides": [2, 2]}, 13),  # overlapping windows
        (True, {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}, 13),  # pads not counted
    ],
    ids=["densenet", "bias", "overlapping", "uncounted-pads"],
)
def test_conv_runs_on_the_pooled_map_and_matches_onnx_runtime(cpu_target, bias, pool, size):
    model, feeds = transition_model(bias=bias, pool=pool, size=size)
    mod = imported(model)
    rewritten = PoolBeforePointwiseConv()(mod)
    pooled = static_shape(op_calls(rewritten["main"], {"relax.nn.avg_pool2d"})[0])
    assert conv_input_shapes(mod) == [(1, 16, size, size)]
    assert conv_input_shapes(rewritten) == [(1, 16, *pooled[2:])]
    np.testing.assert_allclose(run_relax(rewritten, feeds), run_relax(mod, feeds), rtol=1e-5, atol=1e-5)
    result = build(model, cpu_target, name="transition", tuning_logs=None)
    reference = ort_run(model, feeds)
    assert max_abs_err(run_executable(result.executable, feeds), reference) < 1e-5 * np.abs(reference).max()


@pytest.mark.parametrize(
    "options",
    [
        {"kernel": 3},  # not a pointwise conv
        {"pool": {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "count_include_pad": 1}},
        {"pool": {"kernel_shape": [3, 3], "strides": [1, 1], "pads": [1, 1, 1, 1]}},  # keeps every pixel
        {"second_reader": True},  # the full-size conv result is needed anyway
    ],
    ids=["3x3-conv", "counted-pads", "no-fewer-pixels", "second-reader"],
)
def test_left_alone_where_not_exact_or_no_cheaper(options):
    model, feeds = transition_model(**options)
    mod = imported(model)
    assert PoolBeforePointwiseConv()(mod).same_as(mod)


def _conv_then_pool(dtype: str, out_dtype: str, **pool):
    """main(x: [1, 4, 8, 8] dtype) = avg_pool2d(conv2d_1x1(x, w) + b) with constant w, b."""
    x = relax.Var("x", relax.TensorType((1, 4, 8, 8), dtype))
    weight = relax.const(np.arange(32).reshape(8, 4, 1, 1).astype(dtype))
    bias = relax.const(np.ones((1, 8, 1, 1), out_dtype))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            conv = bb.emit(relax.op.nn.conv2d(x, weight, out_dtype=out_dtype))
            biased = bb.emit(relax.op.add(conv, bias))
            out = bb.emit_output(relax.op.nn.avg_pool2d(biased, **pool))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize(
    "dtype, out_dtype, pool",
    [
        ("int8", "int32", {"pool_size": 2, "strides": 2}),  # an int8 input cannot be averaged first
        ("float32", "float32", {"pool_size": 2, "strides": 2, "padding": 2}),  # all-padding windows
    ],
    ids=["int8-conv", "window-all-padding"],
)
def test_left_alone_where_the_pool_would_change_values(dtype, out_dtype, pool):
    mod = _conv_then_pool(dtype, out_dtype, **pool)
    assert PoolBeforePointwiseConv()(mod).same_as(mod)
    rewritten_with_one_pad = PoolBeforePointwiseConv()(
        _conv_then_pool("float32", "float32", pool_size=2, strides=2)
    )
    assert not rewritten_with_one_pad.same_as(mod)  # the same graph in float32, unpadded, is rewritten

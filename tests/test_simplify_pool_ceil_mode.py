import numpy as np
import pytest
import tvm
from conftest import max_abs_err, ort_run, run_executable, run_relax
from onnx import TensorProto, helper
from tvm import relax

from tvm_fusion import build
from tvm_fusion.frontend import import_onnx
from tvm_fusion.passes import SimplifyPoolCeilMode


def pool_model(op: str, size: int, count_include_pad: int = 0, pad: int = 0):
    """x -> <op> 3x3 stride 2, ceil_mode -> y, on a 1x8xSIZExSIZE input."""
    attrs = {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1, "pads": [pad] * 4}
    if op == "AveragePool":
        attrs["count_include_pad"] = count_include_pad
    out = -(-(size + 2 * pad - 3) // 2) + 1
    graph = helper.make_graph(
        [helper.make_node(op, ["x"], ["y"], **attrs)],
        "pool",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, size, size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, out, out])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    feeds = {"x": np.random.default_rng(size).standard_normal((1, 8, size, size)).astype("float32")}
    return model, feeds


def pools(mod) -> list[tuple[bool, list[int]]]:
    """(ceil_mode, output shape) of every pool binding in ``main``."""
    found = []
    for block in mod["main"].body.blocks:
        for binding in block.bindings:
            value = binding.value
            if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and "pool" in value.op.name:
                shape = [int(d) for d in binding.var.ty.shape.values]
                found.append((bool(value.attrs.ceil_mode), shape))
    return found


@pytest.mark.parametrize(
    "size, noop",
    [(111, True), (27, True), (112, False), (28, False)],
    ids=["111-exact", "27-exact", "112-rounds-up", "28-rounds-up"],
)
def test_ceil_mode_dropped_only_where_it_changes_nothing(size, noop):
    mod = import_onnx(pool_model("MaxPool", size)[0]).mod
    ((ceil, shape),) = pools(mod)
    assert ceil
    simplified = SimplifyPoolCeilMode()(mod)
    assert pools(simplified) == [(not noop, shape)]


def _relax_pool(make, shape, **attrs):
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(make(x, ceil_mode=True, **attrs)))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize(
    "make, shape, attrs, noop",
    [
        (relax.op.nn.max_pool1d, (1, 4, 11), dict(pool_size=3, strides=2, padding=(1, 1)), True),
        (relax.op.nn.max_pool1d, (1, 4, 11), dict(pool_size=3, strides=2, padding=(1, 0)), False),
        (
            relax.op.nn.avg_pool3d,
            (1, 2, 7, 9, 5),
            dict(pool_size=3, strides=2, padding=(0, 1, 0, 0, 1, 0), count_include_pad=True),
            True,
        ),
        (
            relax.op.nn.avg_pool3d,
            (1, 2, 7, 9, 5),
            dict(pool_size=3, strides=2, padding=(0, 1, 0, 0, 0, 0), count_include_pad=True),
            False,
        ),
        (
            relax.op.nn.max_pool2d,
            (1, 13, 13, 4),
            dict(pool_size=3, strides=2, dilation=2, layout="NHWC"),
            True,
        ),
        (relax.op.nn.avg_pool2d, (1, 4, 10, 10), dict(pool_size=3, strides=2, padding=(1, 0, 0, 1)), True),
        (relax.op.nn.avg_pool2d, (1, 4, 10, 10), dict(pool_size=3, strides=2, padding=(1, 0, 0, 0)), False),
    ],
    ids=[
        "1d",
        "1d-rounds-up",
        "3d-avg",
        "3d-rounds-up",
        "nhwc-dilated",
        "asymmetric-pads",
        "asymmetric-rounds-up",
    ],
)
def test_other_pools_layouts_and_pads_give_identical_results(make, shape, attrs, noop):
    mod = _relax_pool(make, shape, **attrs)
    simplified = SimplifyPoolCeilMode()(mod)
    assert [ceil for ceil, _ in pools(simplified)] == [not noop]
    x = np.random.default_rng(0).standard_normal(shape).astype("float32")
    np.testing.assert_array_equal(run_relax(simplified, [x]), run_relax(mod, [x]))


@pytest.mark.parametrize(
    "op, size, count_include_pad",
    [
        ("MaxPool", 55, 0),
        ("MaxPool", 56, 0),
        ("AveragePool", 55, 0),
        ("AveragePool", 55, 1),
        ("AveragePool", 56, 1),
    ],
)
def test_pools_match_onnx_runtime(cpu_target, op, size, count_include_pad):
    model, feeds = pool_model(op, size, count_include_pad)
    result = build(model, cpu_target, name=f"pool{size}", tuning_logs=None)
    assert max_abs_err(run_executable(result.executable, feeds), ort_run(model, feeds)) < 1e-5


@pytest.mark.parametrize("size, padded", [(111, False), (112, True)])
def test_exact_ceil_mode_pool_kernel_reads_its_input_without_a_padded_copy(cpu_target, size, padded):
    model, _ = pool_model("MaxPool", size)
    lowered = build(model, cpu_target, name=f"pool{size}", tuning_logs=None).lowered
    kernels = [f for _, f in lowered.functions.items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert len(kernels) == 1
    assert ("pad_temp" in kernels[0].script()) == padded  # TOPI's padded copy of the input

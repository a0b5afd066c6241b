import numpy as np
import pytest
import tvm
from conftest import max_abs_err, ort_run, run_executable
from onnx import TensorProto, helper
from tvm import relax

from tvm_fusion import build
from tvm_fusion.frontend import import_onnx
from tvm_fusion.passes import SimplifyPoolCeilMode


def pool_model(op: str, size: int, count_include_pad: int = 0):
    """x -> <op> 3x3 stride 2, ceil_mode -> y, on a 1x8xSIZExSIZE input."""
    attrs = {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1}
    if op == "AveragePool":
        attrs["count_include_pad"] = count_include_pad
    out = -(-(size - 3) // 2) + 1
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


def ceil_modes(mod) -> list[bool]:
    modes = []

    def visit(expr):
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and "pool" in expr.op.name:
            modes.append(bool(expr.attrs.ceil_mode))

    relax.analysis.post_order_visit(mod["main"].body, visit)
    return modes


@pytest.mark.parametrize(
    "size, noop",
    [(111, True), (27, True), (112, False), (28, False)],
    ids=["111-exact", "27-exact", "112-rounds-up", "28-rounds-up"],
)
def test_ceil_mode_dropped_only_where_it_changes_nothing(size, noop):
    mod = import_onnx(pool_model("MaxPool", size)[0]).mod
    assert ceil_modes(mod) == [True]
    simplified = SimplifyPoolCeilMode()(mod)
    assert ceil_modes(simplified) == [not noop]
    assert [int(d) for d in simplified["main"].ret_ty.shape.values] == [
        int(d) for d in mod["main"].ret_ty.shape.values
    ]


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


def test_exact_ceil_mode_pool_kernel_reads_its_input_without_a_padded_copy(cpu_target):
    model, _ = pool_model("MaxPool", 111)
    lowered = build(model, cpu_target, name="pool111", tuning_logs=None).lowered
    kernels = [f for _, f in lowered.functions.items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert len(kernels) == 1
    assert "pad_temp" not in kernels[0].script()

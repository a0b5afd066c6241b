import re

import numpy as np
import pytest
import tvm
from conftest import ort_run
from onnx import TensorProto, helper, numpy_helper

import tvm_fusion.passes.stack_allocate_loop_buffers as stack
from tvm_fusion import build
from tvm_fusion.passes import StackAllocateLoopBuffers
from tvm_fusion.pipeline import CPU_TIR_PIPELINE, tir_pipeline
from tvm_fusion.schedules._util import vector_lanes
from tvm_fusion.targets import llvm_target


def depthwise_then_pointwise():
    """x -> depthwise 3x3 stride 2 (+bias, relu) -> 1x1 conv 32->48 (+bias): the depthwise
    task's padded / polyphase rows are per-task buffers."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.standard_normal((32, 1, 3, 3)).astype("float32"), "dw"),
        numpy_helper.from_array(rng.standard_normal(32).astype("float32"), "dwb"),
        numpy_helper.from_array(rng.standard_normal((48, 32, 1, 1)).astype("float32") * 0.2, "pw"),
        numpy_helper.from_array(rng.standard_normal(48).astype("float32"), "pwb"),
    ]
    nodes = [
        helper.make_node(
            "Conv", ["x", "dw", "dwb"], ["d"], kernel_shape=[3, 3], strides=[2, 2], pads=[1] * 4, group=32
        ),
        helper.make_node("Relu", ["d"], ["r"]),
        helper.make_node("Conv", ["r", "pw", "pwb"], ["y"], kernel_shape=[1, 1]),
    ]
    graph = helper.make_graph(
        nodes,
        "dw_pw",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32, 56, 56])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 48, 28, 28])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    feeds = {"x": rng.standard_normal((1, 32, 56, 56)).astype("float32")}
    return model, feeds


def workspace_calls(func, pipeline: str) -> int:
    """Calls to TVMBackendAllocWorkspace in the LLVM IR of ``func`` built with ``pipeline``."""
    target = tvm.target.Target(llvm_target())
    lib = tvm.tirx.build(func.with_attr("global_symbol", "main"), target=target, pipeline=pipeline)
    return len(re.findall(r"load ptr, ptr @__TVMBackendAllocWorkspace", lib.inspect_source("ll")))


@pytest.fixture(scope="module")
def built():
    model, feeds = depthwise_then_pointwise()
    return build(model, llvm_target(), name="dw_pw", tuning_logs=None), model, feeds


def kernels(result):
    return [f for f in result.lowered.functions.values() if isinstance(f, tvm.tirx.PrimFunc)]


def test_per_task_buffers_leave_the_workspace_pool(built):
    result, _, _ = built
    funcs = kernels(result)
    before = [workspace_calls(f, "default") for f in funcs]
    after = [workspace_calls(f, CPU_TIR_PIPELINE) for f in funcs]
    # the depthwise task's polyphase rows (which compute the padding too) and its accumulators
    # leave the pool
    assert sum(before) >= 2, before
    assert after == [0] * len(funcs), after


def gemm(k: int = 384, n: int = 96, m: int = 256):
    rng = np.random.default_rng(1)
    w = numpy_helper.from_array(rng.standard_normal((k, n)).astype("float32"), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "gemm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [m, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, n])],
        [w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model, {"x": rng.standard_normal((m, k)).astype("float32")}


def test_gemm_tile_on_the_stack_is_read_in_register_pieces():
    """A GEMM tile's "local" accumulators live across its reduction loop. As an alloca, LLVM
    spilled the whole tile when the epilogue read it wider than it was written (<48 x float>
    over 16-lane writes: a K=384 GEMM 7x slower); the epilogue now reads SIMD-register pieces."""
    model, feeds = gemm()
    result = build(model, llvm_target(), name="gemm", tuning_logs=None)
    funcs = kernels(result)
    assert sum(workspace_calls(f, "default") for f in funcs) >= 1  # the tile, in TVM's pipeline
    assert [workspace_calls(f, CPU_TIR_PIPELINE) for f in funcs] == [0] * len(funcs)
    lanes = vector_lanes(tvm.target.Target(llvm_target()), "float32")
    scripts = "\n".join(f.script() for f in funcs)
    widths = [int(w) for w in re.findall(r"T\.vectorized\(T\.int64\((\d+)\)\)", scripts)]
    assert widths and max(widths) <= lanes, (widths, lanes)
    vm = tvm.relax.VirtualMachine(result.executable, tvm.cpu())
    out = vm["main"](tvm.runtime.tensor(feeds["x"])).numpy()
    ref = ort_run(model, feeds)
    assert np.abs(out - ref).max() / np.abs(ref).max() < 1e-5


def test_buffers_over_the_limit_stay_in_the_pool(built, monkeypatch):
    result, _, _ = built
    monkeypatch.setattr(stack, "MAX_FRAME_BYTES", 0)
    funcs = kernels(result)
    assert [workspace_calls(f, CPU_TIR_PIPELINE) for f in funcs] == [
        workspace_calls(f, "default") for f in funcs
    ]


def test_stack_buffers_give_the_same_numbers(built):
    result, model, feeds = built
    vm = tvm.relax.VirtualMachine(result.executable, tvm.cpu())
    out = vm["main"](tvm.runtime.tensor(feeds["x"])).numpy()
    ref = ort_run(model, feeds)
    assert np.abs(out - ref).max() / np.abs(ref).max() < 1e-5


def test_build_compiles_cpu_kernels_with_the_pass(monkeypatch):
    """``build`` itself must run the pass (not only a hand-made ``tirx.build``)."""
    annotated = []
    real = stack._Rewriter._alloc

    def spy(self, stmt, in_loop):
        new = real(self, stmt, in_loop)
        if not new.same_as(stmt):
            annotated.append(stmt.buffer.name)
        return new

    monkeypatch.setattr(stack._Rewriter, "_alloc", spy)
    model, _ = depthwise_then_pointwise()
    build(model, llvm_target(), name="dw_pw_spy", tuning_logs=None)
    assert any("phase" in name for name in annotated), annotated  # the depthwise task's rows


def test_only_cpu_builds_use_the_stack_pipeline():
    assert tir_pipeline(llvm_target()) == CPU_TIR_PIPELINE
    assert tir_pipeline({"kind": "cuda", "arch": "sm_80"}) == "default"
    assert StackAllocateLoopBuffers().info.name == "StackAllocateLoopBuffers"


def test_tuning_builds_candidates_like_the_build(built):
    """Meta-Schedule's candidates are timed as they will ship: built with the same TIR pipeline."""
    from tvm_fusion.tuning.workers import _worker_build

    result, _, _ = built
    target = tvm.target.Target(llvm_target())
    for func in kernels(result):
        lib = _worker_build(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target)
        assert "load ptr, ptr @__TVMBackendAllocWorkspace" not in lib.inspect_source("ll")

"""Strided 1×1 convs (legalize/strided_pointwise_conv.py): numerics vs ONNX Runtime over strides,
odd sizes and fused epilogues; the kernel's structure (subsample stage, then a stride-1 GEMM over
the plane, one kernel with its epilogue); which convs take the form."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from conftest import ort_run, run_executable
from tvm import tirx

import tvm_fusion
from tvm_fusion import models
from tvm_fusion.ir import tir_stmts
from tvm_fusion.targets import llvm_target

ZNVER3 = llvm_target("znver3")


def _model(cin, cout, size, strides, kernel=1, pads=0, epilogue="relu", seed=0):
    """x -> Conv (bias) -> epilogue: "none", "relu", or "residual" (ResNet's downsample branch:
    the conv's result plus a second input, then relu)."""
    g = models.GraphBuilder("pw", seed)
    x = g.input("x", (1, cin, size, size + 3))  # not square: both strides are checked
    w = g.weight("w", (cout, cin, kernel, kernel))
    b = g.const("b", g.rng.standard_normal(cout).astype(np.float32) * 0.1)
    y = g.op("Conv", [x, w, b], kernel_shape=[kernel, kernel], pads=[pads] * 4, strides=list(strides))
    if epilogue == "relu":
        y = g.relu(y)
    elif epilogue == "residual":
        oh = (size + 2 * pads - kernel) // strides[0] + 1
        ow = (size + 3 + 2 * pads - kernel) // strides[1] + 1
        y = g.relu(g.add(y, g.input("r", (1, cout, oh, ow))))
    return g.finish([y])


def _blocks(result) -> list[str]:
    return [
        s.name_hint
        for f in result.lowered.functions.values()
        if isinstance(f, tirx.PrimFunc)
        for s in tir_stmts(f.body)
        if isinstance(s, tvm.s_tir.SBlock)
    ]


@pytest.mark.parametrize(
    "cin,cout,size,strides,epilogue",
    [
        (32, 64, 16, (2, 2), "relu"),
        (24, 48, 15, (2, 2), "residual"),  # odd input: the last row / column is read
        (16, 40, 14, (3, 3), "none"),
        (16, 32, 12, (2, 1), "relu"),  # stride along H only
    ],
)
def test_strided_pointwise_conv_matches_onnxruntime(cin, cout, size, strides, epilogue):
    model = _model(cin, cout, size, strides, epilogue=epilogue)
    result = tvm_fusion.build(model, ZNVER3, tuning_logs=None)
    assert any(b.startswith("pointwise_subsample") for b in _blocks(result))  # it took the form
    feeds = models.random_inputs(model, seed=1)
    got, ref = run_executable(result.executable, feeds), ort_run(model, feeds)
    assert float(np.abs(got - ref).max() / np.abs(ref).max()) <= 1e-5


def test_strided_pointwise_conv_is_one_kernel_with_a_plane_gemm():
    """Conv + bias + residual add + relu stay one kernel; its conv reads the subsampled input over
    one flattened plane axis (a GEMM), no stride left in the reduction block."""
    result = tvm_fusion.build(_model(64, 128, 28, (2, 2), epilogue="residual"), ZNVER3, tuning_logs=None)
    funcs = [f for f in result.lowered.functions.values() if isinstance(f, tirx.PrimFunc)]
    assert len(funcs) == 1
    blocks = [s for s in tir_stmts(funcs[0].body) if isinstance(s, tvm.s_tir.SBlock)]
    (update,) = [b for b in blocks if b.name_hint.endswith("_update")]
    (read,) = [r for r in update.reads if "subsample" in r.source.name]
    assert len(read.region) == 3, read  # [batch, channel, plane]: H and W flattened into one axis


@pytest.mark.parametrize(
    "kernel,pads,strides",
    [(1, 0, (1, 1)), (3, 1, (2, 2)), (1, 1, (2, 2))],
    ids=["stride1", "3x3_stride2", "padded_1x1"],
)
def test_other_convs_keep_their_lowering(kernel, pads, strides):
    result = tvm_fusion.build(_model(16, 32, 12, strides, kernel, pads), ZNVER3, tuning_logs=None)
    assert not any(b.startswith("pointwise_subsample") for b in _blocks(result))

"""PadConvChannels: conv output channels padded to whole vectors on CPU (numerics vs ONNX Runtime,
the slice fused into the conv's kernel, which convs it leaves alone)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import HOST_HAS_AVX512, ort_run, run_executable
from tvm import relax, tirx

import tvm_fusion
from tvm_fusion import models
from tvm_fusion.frontend import import_onnx
from tvm_fusion.ir import op_name
from tvm_fusion.passes import PadConvChannels
from tvm_fusion.passes.pad_conv_channels import padded_channels
from tvm_fusion.targets import llvm_target

ZNVER3 = llvm_target("znver3")  # 8 lanes
SKYLAKE = llvm_target("skylake-avx512")  # 16 lanes


def _model(cin, cout, size, kernel=1, residual=False, seed=0):
    """x -> Conv (bias) -> relu [-> + r]: SqueezeNet's classifier conv, RegNet's 440-channel 1x1s."""
    g = models.GraphBuilder("pad", seed)
    x = g.input("x", (1, cin, size, size))
    w = g.weight("w", (cout, cin, kernel, kernel))
    b = g.const("b", g.rng.standard_normal(cout).astype(np.float32) * 0.1)
    y = g.relu(g.op("Conv", [x, w, b], kernel_shape=[kernel, kernel], pads=[kernel // 2] * 4))
    if residual:
        y = g.add(y, g.input("r", (1, cout, size, size)))
    return g.finish([y])


def _convs(mod):
    return [
        call
        for func in mod.functions.values()
        if isinstance(func, relax.Function)
        for call in relax.analysis.get_var2val(func).values()
        if op_name(call) == "relax.nn.conv2d"
    ]


@pytest.mark.parametrize("target", [ZNVER3, SKYLAKE], ids=["avx2", "avx512"])
@pytest.mark.parametrize(
    "cin,cout,size,kernel,residual",
    [(64, 1000, 13, 1, False), (32, 436, 7, 1, True), (16, 124, 9, 3, False)],
    ids=["squeezenet_1000", "1x1_436_residual", "3x3_124"],
)
def test_padded_conv_matches_onnxruntime(target, cin, cout, size, kernel, residual):
    model = _model(cin, cout, size, kernel, residual)
    with target:
        padded = PadConvChannels(target)(import_onnx(model).mod)
    (conv,) = _convs(padded)
    lanes = 16 if target is SKYLAKE else 8  # 1000 is whole 8-lane vectors: AVX2 keeps it
    padded = padded_channels(cout, lanes)
    assert int(conv.ty.shape[1]) == (padded or cout)
    result = tvm_fusion.build(model, target, tuning_logs=None)
    kernels = [g.name_hint for g, f in result.lowered.functions_items() if isinstance(f, tirx.PrimFunc)]
    # the slice is the conv's first epilogue op (then bias, relu, and the residual add: a slice
    # takes no room under max_fusion_depth 4)
    prefix = "fused_conv2d_strided_slice_add_relu" if padded else "fused_conv2d_add_relu"
    assert any(k.startswith(prefix) for k in kernels), kernels
    assert len(kernels) == 1, kernels
    if target is ZNVER3 or HOST_HAS_AVX512:
        feeds = models.random_inputs(model, seed=1)
        got, ref = run_executable(result.executable, feeds), ort_run(model, feeds)
        assert got.shape == ref.shape
        assert float(np.abs(got - ref).max() / np.abs(ref).max()) <= 1e-5


@pytest.mark.parametrize(
    "channels,lanes,padded",
    [(1000, 16, 1008), (440, 16, 448), (104, 16, 112), (72, 16, 80), (1000, 8, None), (512, 16, None)]
    + [(24, 16, None), (66, 16, None)],
)
def test_which_channel_counts_are_padded(channels, lanes, padded):
    """Left alone: whole vectors already, fewer than four vectors (24), or more than 1/8 extra
    filters (66 -> 80: 21 %)."""
    assert padded_channels(channels, lanes) == padded


def test_cuda_and_non_constant_weights_are_left_alone():
    mod = import_onnx(_model(64, 1000, 13)).mod
    cuda = tvm_fusion.targets.parse_target({"kind": "cuda", "arch": "sm_80"})
    assert PadConvChannels(cuda)(mod).same_as(mod)
    g = models.GraphBuilder("weights_as_input", 0)  # a weight the graph computes or takes as input
    x, w = g.input("x", (1, 64, 13, 13)), g.input("w", (1000, 64, 1, 1))
    with SKYLAKE:
        (conv,) = _convs(PadConvChannels(SKYLAKE)(import_onnx(g.finish([g.op("Conv", [x, w])])).mod))
    assert int(conv.ty.shape[1]) == 1000


@pytest.mark.parametrize("size", [16, 1], ids=["plane_of_whole_vectors", "squeeze_excitation_1x1"])
def test_convs_whose_plane_takes_the_lanes_or_is_a_gemv_are_left_alone(size):
    """16x16 = 256 outputs: the plane gets the vector lanes itself (MobileNet-V3's 72 channels at
    56x56 measured slower padded); a 1x1 plane is a GEMV whose crop costs more than it saves."""
    with SKYLAKE:
        (conv,) = _convs(PadConvChannels(SKYLAKE)(import_onnx(_model(64, 1000, size)).mod))
    assert int(conv.ty.shape[1]) == 1000

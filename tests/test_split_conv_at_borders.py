import numpy as np
import pytest
import tvm
from conftest import ort_run
from onnx import TensorProto, helper, numpy_helper
from test_trim_padding_taps import _conv1d, aspp_model, convs
from tvm import relax

from tvm_fusion import build
from tvm_fusion.frontend import import_onnx
from tvm_fusion.ir import op_calls
from tvm_fusion.passes import SplitConvAtBorders
from tvm_fusion.passes.split_conv_at_borders import tap_bands
from tvm_fusion.pipeline import pipeline_passes


def test_tap_bands_give_the_same_outputs_on_random_axes():
    """Brute force along one axis: each band, computed on its input slice with its taps and no
    padding, gives the padded conv's outputs of that band."""
    rng = np.random.default_rng(0)
    checked = 0
    for _ in range(2000):
        size, kernel, dilation, stride = (int(v) for v in rng.integers(1, [16, 6, 14, 4]))
        before, after = (int(p) for p in rng.integers(0, 15, 2))
        out = (size + before + after - dilation * (kernel - 1) - 1) // stride + 1
        if out < 1:
            continue
        bands = tap_bands(size, before, kernel, dilation, stride, out)
        if bands is None:
            continue
        x, w = rng.standard_normal(size), rng.standard_normal(kernel)
        expected = _conv1d(x, w, before, after, dilation, stride)
        assert bands[0][0] == 0 and bands[-1][1] == out
        for (begin, end, first, last), (next_begin, *_) in zip(bands, [*bands[1:], (out,)]):
            assert end == next_begin and 0 <= first <= last < kernel
            start = begin * stride - before + first * dilation
            stop = (end - 1) * stride - before + last * dilation + 1
            assert 0 <= start < stop <= size
            part = _conv1d(x[start:stop], w[first : last + 1], 0, 0, dilation, stride)
            np.testing.assert_allclose(part, expected[begin:end], rtol=1e-12, atol=1e-12)
        checked += 1
    assert checked > 300


def test_tap_bands_of_deeplab_aspp_on_a_14x14_map():
    """Dilation 12: the two border outputs on each side read through two taps, the middle ten
    through the centre tap only."""
    assert tap_bands(14, 12, 3, 12, 1, 14) == [(0, 2, 1, 2), (2, 12, 1, 1), (12, 14, 0, 1)]
    assert tap_bands(56, 1, 3, 1, 1, 56) == [(0, 1, 1, 2), (1, 55, 0, 2), (55, 56, 0, 1)]


def conv_model(size, kernel, dilation, pads, stride=1, groups=1, channels=8, batch=1, seed=0):
    """x -> Conv (bias) -> Relu, NCHW, square kernel; ``size`` and ``pads`` per axis."""
    rng = np.random.default_rng(seed)
    h, w = size
    weight = rng.standard_normal((16, channels // groups, kernel, kernel)).astype(np.float32)
    node = helper.make_node(
        "Conv",
        ["x", "w", "b"],
        ["c"],
        kernel_shape=[kernel, kernel],
        dilations=[dilation, dilation],
        pads=list(pads),
        strides=[stride, stride],
        group=groups,
    )
    out = [
        (n + p0 + p1 - dilation * (kernel - 1) - 1) // stride + 1
        for n, p0, p1 in zip(size, pads[:2], pads[2:])
    ]
    graph = helper.make_graph(
        [node, helper.make_node("Relu", ["c"], ["y"])],
        "conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, channels, h, w])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 16, *out])],
        [
            numpy_helper.from_array(weight, "w"),
            numpy_helper.from_array(rng.standard_normal(16).astype(np.float32), "b"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model, {"x": rng.standard_normal((batch, channels, h, w)).astype(np.float32)}


def _matches_ort(model, feeds):
    result = build(model, "llvm", tuning_logs=None)
    vm = relax.VirtualMachine(result.executable, tvm.cpu())
    ours = vm["main"](*[tvm.runtime.tensor(v) for v in feeds.values()]).numpy()
    reference = ort_run(model, feeds)
    assert ours.shape == reference.shape
    assert float(np.max(np.abs(ours - reference)) / np.max(np.abs(reference))) < 1e-5
    return result


def test_aspp_conv_becomes_nine_unpadded_region_convs():
    """DeepLabV3's dilation-12 conv on a 14x14 map: 1 + 4·2 + 4·4 taps over 9 regions, none padded."""
    model, feeds = aspp_model(12, size=14)
    mod = SplitConvAtBorders()(import_onnx(model).mod)
    found = convs(mod)
    assert len(found) == 9
    assert sorted(w[2] * w[3] for w, _, _ in found) == [1, 2, 2, 2, 2, 4, 4, 4, 4]
    assert sorted(out[2] * out[3] for _, _, out in found) == [4, 4, 4, 4, 20, 20, 20, 20, 100]
    for block in mod["main"].body.blocks:
        for binding in block.bindings:
            if isinstance(binding.value, relax.Call) and binding.value.op.name == "relax.nn.conv2d":
                assert [int(p) for p in binding.value.attrs.padding] == [0, 0, 0, 0]
    assert "SplitConvAtBorders" in [p.info.name for p in pipeline_passes("llvm")]
    assert "SplitConvAtBorders" not in [p.info.name for p in pipeline_passes("cuda")]
    result = _matches_ort(model, feeds)
    assert result.summary.layout_transforms == 0


def test_ordinary_padded_conv_is_left_whole():
    """A 3x3 conv padded by 1 keeps almost all its work at the borders: not worth nine kernels."""
    model, _ = conv_model((12, 12), 3, 1, [1, 1, 1, 1])
    assert convs(SplitConvAtBorders()(import_onnx(model).mod)) == [([16, 8, 3, 3], [1, 1], [1, 16, 12, 12])]


def test_undilated_conv_on_a_tiny_map_is_left_whole():
    """A 3x3 conv on 2x2 would keep 44 % of its work, but as four one-pixel convs, slices and
    concats; only dilated convs were measured to gain."""
    model, _ = conv_model((2, 2), 3, 1, [1, 1, 1, 1])
    assert len(convs(SplitConvAtBorders()(import_onnx(model).mod))) == 1


def _aspp_function(out_layout="NCHW", constant_weight=True):
    x = relax.Var("x", relax.TensorType([1, 8, 14, 14], "float32"))
    w_value = np.ones((16, 8, 3, 3), "float32")
    w = relax.Var("w", relax.TensorType([16, 8, 3, 3], "float32"))
    params = [x] if constant_weight else [x, w]
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            weight = relax.const(w_value) if constant_weight else w
            y = bb.emit_output(
                relax.op.nn.conv2d(x, weight, padding=[12] * 4, dilation=[12, 12], out_layout=out_layout)
            )
        bb.emit_func_output(y)
    return bb.get()


@pytest.mark.parametrize("out_layout, constant_weight", [("NHWC", True), ("NCHW", False)])
def test_convs_it_cannot_rewrite_are_left_whole(out_layout, constant_weight):
    """Regions are joined on NCHW's H and W axes and cut from a constant kernel."""

    def count(mod):
        return len(op_calls(mod["main"], ("relax.nn.conv2d",)))

    assert count(SplitConvAtBorders()(_aspp_function(out_layout, constant_weight))) == 1
    assert count(SplitConvAtBorders()(_aspp_function())) == 9


@pytest.mark.parametrize(
    "size, kernel, dilation, pads, stride, groups",
    [
        ((9, 11), 3, 5, [5, 5, 5, 5], 1, 1),  # H and W split differently
        ((14, 14), 3, 12, [12, 12, 12, 12], 2, 1),  # strided
        ((10, 10), 3, 6, [6, 6, 6, 6], 1, 8),  # depthwise (DeepLab's separable ASPP)
        ((8, 13), 3, 6, [6, 0, 6, 0], 1, 2),  # only H padded; grouped
        ((6, 6), 5, 3, [6, 6, 6, 6], 1, 1),  # 5x5
    ],
)
def test_split_convs_match_onnx_runtime(size, kernel, dilation, pads, stride, groups):
    model, feeds = conv_model(size, kernel, dilation, pads, stride, groups, batch=2)
    assert len(convs(SplitConvAtBorders()(import_onnx(model).mod))) > 1  # the case is split
    _matches_ort(model, feeds)

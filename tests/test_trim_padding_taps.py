import numpy as np
import pytest
import tvm
from conftest import ort_run
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

from tvm_fusion import build
from tvm_fusion.frontend import import_onnx
from tvm_fusion.passes import TrimPaddingTaps
from tvm_fusion.passes.trim_padding_taps import kept_taps
from tvm_fusion.pipeline import pipeline_passes


def _conv1d(x, w, pad_before, pad_after, dilation, stride):
    padded = np.concatenate([np.zeros(pad_before), x, np.zeros(pad_after)])
    out = (len(padded) - dilation * (len(w) - 1) - 1) // stride + 1
    return np.array(
        [sum(w[t] * padded[y * stride + t * dilation] for t in range(len(w))) for y in range(out)]
    )


def test_kept_taps_give_the_same_outputs_on_random_axes():
    """Brute force along one axis: the trimmed kernel and padding compute the same outputs."""
    rng = np.random.default_rng(0)
    trimmed = 0
    for _ in range(2000):
        size, kernel, dilation, stride = (
            rng.integers(1, 12),
            rng.integers(1, 6),
            rng.integers(1, 8),
            rng.integers(1, 4),
        )
        before, after = (int(p) for p in rng.integers(0, 15, 2))
        if size + before + after - dilation * (kernel - 1) - 1 < 0:
            continue
        kept = kept_taps(int(size), before, after, int(kernel), int(dilation), int(stride))
        if kept is None:
            continue
        lo, hi, new_before, new_after = kept
        assert 0 <= lo <= hi < kernel and hi - lo + 1 < kernel
        x, w = rng.standard_normal(size), rng.standard_normal(kernel)
        expected = _conv1d(x, w, before, after, dilation, stride)
        np.testing.assert_allclose(
            _conv1d(x, w[lo : hi + 1], new_before, new_after, dilation, stride), expected
        )
        trimmed += 1
    assert trimmed > 100


def test_kept_taps_of_deeplab_aspp_on_a_14x14_map():
    assert kept_taps(14, 12, 12, 3, 12, 1) is None  # every tap reads the input for some output
    assert kept_taps(14, 24, 24, 3, 24, 1) == (1, 1, 0, 0)  # only the centre: a 1x1 conv
    assert kept_taps(14, 36, 36, 3, 36, 1) == (1, 1, 0, 0)


def aspp_model(dilation: int, size: int = 6):
    """x -> conv 3x3, dilation = padding = ``dilation`` (DeepLabV3's ASPP branch) -> relu."""
    rng = np.random.default_rng(dilation)
    weight = numpy_helper.from_array(rng.standard_normal((16, 8, 3, 3)).astype(np.float32), "w")
    bias = numpy_helper.from_array(rng.standard_normal(16).astype(np.float32), "b")
    nodes = [
        helper.make_node(
            "Conv", ["x", "w", "b"], ["c"], kernel_shape=[3, 3], dilations=[dilation] * 2, pads=[dilation] * 4
        ),
        helper.make_node("Relu", ["c"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "aspp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, size, size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, size, size])],
        [weight, bias],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    feeds = {"x": rng.standard_normal((1, 8, size, size)).astype(np.float32)}
    return model, feeds


def convs(mod) -> list[tuple[list[int], list[int], list[int]]]:
    """(weight shape, dilation, output shape) of every conv2d binding in ``main``."""
    found = []
    for block in mod["main"].body.blocks:
        for binding in block.bindings:
            value = binding.value
            if (
                isinstance(value, relax.Call)
                and isinstance(value.op, tvm.ir.Op)
                and value.op.name == "relax.nn.conv2d"
            ):
                weight = [int(d) for d in value.args[1].value.shape]
                out = [int(d) for d in binding.var.ty.shape.values]
                found.append((weight, [int(d) for d in value.attrs.dilation], out))
    return found


@pytest.mark.parametrize(
    "dilation, kernel_after, dilation_after", [(6, [1, 1], [1, 1]), (2, [3, 3], [2, 2]), (4, [3, 3], [4, 4])]
)
def test_aspp_conv_keeps_only_taps_that_read_the_input(dilation, kernel_after, dilation_after):
    """A conv cut to its centre tap is a plain 1x1 conv (dilation 1: the undilated lowerings and
    horizontal fusion take it); the output shape stays."""
    model, feeds = aspp_model(dilation)
    mod = TrimPaddingTaps()(import_onnx(model).mod)
    assert convs(mod) == [([16, 8, *kernel_after], dilation_after, [1, 16, 6, 6])]
    assert "TrimPaddingTaps" in [p.info.name for p in pipeline_passes("llvm")]
    result = build(model, "llvm", tuning_logs=None)
    ours = relax.VirtualMachine(result.executable, tvm.cpu())["main"](tvm.runtime.tensor(feeds["x"])).numpy()
    reference = ort_run(model, feeds)
    assert float(np.max(np.abs(ours - reference)) / np.max(np.abs(reference))) < 1e-5

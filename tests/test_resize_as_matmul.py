import numpy as np
import pytest
import tvm
from conftest import ort_run
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

from tvm_fusion import build
from tvm_fusion.frontend import import_onnx
from tvm_fusion.passes import LinearResizeAsMatmul
from tvm_fusion.passes.resize_as_matmul import interpolation_matrix


def resize_model(size_in, size_out, mode: str, channels: int = 21, batch: int = 1):
    """x (N, C, in) -> bilinear Resize to out -> y, as torch's F.interpolate exports it (a size is
    an int for a square map or (rows, columns))."""
    h_in, w_in = (size_in, size_in) if isinstance(size_in, int) else size_in
    h_out, w_out = (size_out, size_out) if isinstance(size_out, int) else size_out
    nodes = [
        helper.make_node(
            "Resize",
            ["x", "", "", "sizes"],
            ["y"],
            mode="linear",
            coordinate_transformation_mode=mode,
        )
    ]
    sizes = numpy_helper.from_array(np.array([batch, channels, h_out, w_out], np.int64), "sizes")
    graph = helper.make_graph(
        nodes,
        "resize",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, channels, h_in, w_in])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, channels, h_out, w_out])],
        [sizes],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    rng = np.random.default_rng(h_in)
    feeds = {"x": rng.standard_normal((batch, channels, h_in, w_in)).astype(np.float32)}
    return model, feeds


def ops(mod) -> list[str]:
    found = []
    for block in mod["main"].body.blocks:
        for binding in block.bindings:
            if isinstance(binding.value, relax.Call) and isinstance(binding.value.op, tvm.ir.Op):
                found.append(binding.value.op.name)
    return found


@pytest.mark.parametrize(
    "size_in, size_out, mode",
    [
        (14, 224, "half_pixel"),  # DeepLabV3's logits
        (1, 14, "half_pixel"),  # its image-pooling branch
        (7, 20, "pytorch_half_pixel"),
        (9, 16, "align_corners"),
        (16, 9, "asymmetric"),  # a downscale
        ((7, 9), (20, 33), "half_pixel"),  # rows and columns differ (A_h and A_w not swapped)
        ((5, 6), (1, 4), "pytorch_half_pixel"),  # one output row (source 0)
    ],
)
@pytest.mark.parametrize("batch", [1, 2])
def test_small_bilinear_resize_is_two_matmuls_and_matches_ort(size_in, size_out, mode, batch):
    model, feeds = resize_model(size_in, size_out, mode, batch=batch)
    assert ops(LinearResizeAsMatmul()(import_onnx(model).mod)) == ["relax.matmul", "relax.matmul"]
    result = build(model, "llvm", tuning_logs=None)
    assert not any("resize" in gv.name_hint for gv, _ in result.lowered.functions_items())
    ours = relax.VirtualMachine(result.executable, tvm.cpu())["main"](tvm.runtime.tensor(feeds["x"])).numpy()
    reference = ort_run(model, feeds)
    assert float(np.max(np.abs(ours - reference)) / np.max(np.abs(reference))) < 1e-5


def test_a_large_map_keeps_its_resize():
    """Dense interpolation matrices cost in/2 times the multiplies: 64x64 inputs stay resizes."""
    model, _ = resize_model(64, 128, "half_pixel", channels=2)
    assert ops(LinearResizeAsMatmul()(import_onnx(model).mod)) == ["relax.image.resize2d"]


def test_interpolation_matrix_refuses_a_mode_it_does_not_know():
    with pytest.raises(ValueError, match="tf_crop_and_resize"):
        interpolation_matrix(4, 8, "tf_crop_and_resize")

"""ONNX ``Col2Im`` (``F.fold``) imported as a re-layout or a one-hot transposed conv (``onnx_col2im.py``)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import HAS_GPU, ort_run, run_outputs
from onnx import TensorProto, helper, numpy_helper

import tvm_fusion
from tvm_fusion.frontend import import_onnx
from tvm_fusion.ir import op_calls


def col2im_model(channels, image, block, strides=(1, 1), pads=(0, 0, 0, 0), dilations=(1, 1)):
    grid = [
        (image[i] + pads[i] + pads[i + 2] - dilations[i] * (block[i] - 1) - 1) // strides[i] + 1
        for i in range(2)
    ]
    shape = [1, channels * block[0] * block[1], grid[0] * grid[1]]
    inits = [
        numpy_helper.from_array(np.array(image, np.int64), "image_shape"),
        numpy_helper.from_array(np.array(block, np.int64), "block_shape"),
    ]
    node = helper.make_node(
        "Col2Im",
        ["x", "image_shape", "block_shape"],
        ["y"],
        name="/fold",
        strides=list(strides),
        pads=list(pads),
        dilations=list(dilations),
    )
    graph = helper.make_graph(
        [node],
        "col2im",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, channels, *image])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    return model, {"x": np.random.default_rng(0).standard_normal(shape).astype(np.float32)}


CASES = {
    "patches-tile-the-image": dict(channels=4, image=(8, 6), block=(2, 3), strides=(2, 3)),
    "overlapping": dict(channels=3, image=(7, 7), block=(3, 3)),
    "stride-2-padded": dict(channels=2, image=(9, 8), block=(3, 3), strides=(2, 2), pads=(1, 1, 1, 1)),
    "dilated": dict(channels=2, image=(9, 9), block=(2, 2), dilations=(2, 2)),
    # the image is not a whole number of strides past the last patch: output_padding [1, 2]
    "uneven-stride": dict(channels=2, image=(10, 9), block=(3, 3), strides=(2, 3), pads=(1, 0, 1, 2)),
    "pads-past-the-kernel": dict(channels=1, image=(4, 4), block=(2, 2), pads=(3, 0, 0, 3)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_col2im_matches_ort(case, cpu_target):
    model, feeds = col2im_model(**CASES[case])
    result = tvm_fusion.build(model, cpu_target, tuning_logs=None)
    np.testing.assert_allclose(
        run_outputs(result.executable, feeds)[0], ort_run(model, feeds), rtol=1e-5, atol=1e-6
    )


def test_patches_that_tile_the_image_are_a_relayout_not_a_conv():
    tiled = import_onnx(col2im_model(**CASES["patches-tile-the-image"])[0]).mod["main"]
    assert not op_calls(tiled, {"relax.nn.conv2d_transpose"}) and op_calls(tiled, {"relax.permute_dims"})
    overlapping = import_onnx(col2im_model(**CASES["overlapping"])[0]).mod["main"]
    assert op_calls(overlapping, {"relax.nn.conv2d_transpose"})


def test_col2im_builds_and_exports_for_cuda(tmp_path):
    model, feeds = col2im_model(**CASES["stride-2-padded"])
    path = tvm_fusion.build(model, {"kind": "cuda", "arch": "sm_80"}, tuning_logs=None).export(
        tmp_path / "fold.so"
    )
    assert path.stat().st_size > 10_000
    if HAS_GPU:
        np.testing.assert_allclose(
            tvm_fusion.load(path)(*feeds.values()), ort_run(model, feeds), rtol=1e-4, atol=1e-5
        )

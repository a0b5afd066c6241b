"""fold_pads_into_convs: a zero Pad of H and W feeding only Convs becomes their padding (TF "same"
padding as the TorchScript exporter writes it: Hugging Face MobileNetV2)."""

import numpy as np
import pytest
from conftest import ort_outputs, run_outputs
from onnx import TensorProto, helper, numpy_helper

import tvm_fusion
from tvm_fusion.frontend import import_onnx
from tvm_fusion.ir import op_calls
from tvm_fusion.onnx_fold_pads import fold_pads_into_convs


def _model(
    pads, opset=17, value=0.0, mode="constant", conv_pads=(1, 0, 0, 1), consumers=("conv",), axes=None
):
    """x [1, 4, 9, 10] -> Pad -> consumers (conv: 3x3 stride 2 + relu; pool: MaxPool) -> outputs."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((8, 4, 3, 3)).astype(np.float32), "w")]
    if opset < 11:
        pad = helper.make_node("Pad", ["x"], ["p"], pads=list(pads), value=value, mode=mode)
    else:
        inits += [
            numpy_helper.from_array(np.array(pads, np.int64), "pads"),
            numpy_helper.from_array(np.array(value, np.float32), "value"),
        ]
        names = ["x", "pads", "value"]
        if axes is not None:
            inits.append(numpy_helper.from_array(np.array(axes, np.int64), "axes"))
            names.append("axes")
        pad = helper.make_node("Pad", names, ["p"], mode=mode)
    nodes, outputs = [pad], []
    for i, kind in enumerate(consumers):
        if kind == "conv":
            nodes += [
                helper.make_node(
                    "Conv", ["p", "w"], [f"c{i}"], kernel_shape=[3, 3], strides=[2, 2], pads=list(conv_pads)
                ),
                helper.make_node("Relu", [f"c{i}"], [f"y{i}"]),
            ]
        else:
            nodes.append(helper.make_node("MaxPool", ["p"], [f"y{i}"], kernel_shape=[2, 2]))
        shape = [1, 8 if kind == "conv" else 4, 6, 6]  # with PADS: 12 x 13 padded
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, shape))
    graph = helper.make_graph(
        nodes,
        "pad_conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 9, 10])],
        outputs,
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


PADS = [0, 0, 1, 2, 0, 0, 2, 1]  # TF "same" for stride 2 is uneven: more after than before


@pytest.mark.parametrize(
    "opset, axes, consumers",
    [
        (10, None, ("conv",)),
        (13, None, ("conv",)),
        (18, [0, 1, 2, 3], ("conv",)),
        (17, None, ("conv", "conv")),
    ],
)
def test_zero_pad_becomes_the_convs_padding_and_matches_onnxruntime(opset, axes, consumers):
    model = _model(PADS, opset=opset, axes=axes, consumers=consumers)
    folded = fold_pads_into_convs(model)
    assert [n.op_type for n in folded.graph.node].count("Pad") == 0
    convs = [n for n in folded.graph.node if n.op_type == "Conv"]
    assert all(n.input[0] == "x" for n in convs)
    # ONNX pads [h_begin, w_begin, h_end, w_end]: (1, 0, 0, 1) + (1, 2, 2, 1)
    assert all(
        list(helper.get_attribute_value(a)) == [2, 2, 2, 2]
        for n in convs
        for a in n.attribute
        if a.name == "pads"
    )
    mod = import_onnx(model).mod  # the import folds it: no pad kernel left
    assert not [gv for gv, f in mod.functions_items() if not hasattr(f, "body") or "pad" in gv.name_hint]
    assert len(op_calls(mod["main"], ("relax.nn.conv2d",))) == len(consumers)
    feeds = {"x": np.random.default_rng(1).standard_normal((1, 4, 9, 10)).astype(np.float32)}
    got = run_outputs(tvm_fusion.build(model, "llvm", tuning_logs=None).executable, feeds)
    for ours, ref in zip(got, ort_outputs(model, feeds), strict=True):
        np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "case",
    [
        dict(value=1.0),  # not a zero pad
        dict(pads=[0, 1, 1, 1, 0, 0, 1, 1]),  # pads the channels
        dict(mode="reflect"),
        dict(consumers=("conv", "pool")),  # a max pool's padding is -inf, not 0
        dict(axes=[2, 3], pads=[1, 1, 1, 1]),  # opset-18 axes subset: left to the frontend
    ],
)
def test_other_pads_are_left_alone(case):
    args = {"pads": PADS, **case}
    if "axes" in case:
        args["opset"] = 18
    model = _model(**args)
    assert fold_pads_into_convs(model) is model

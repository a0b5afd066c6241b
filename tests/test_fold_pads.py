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
        shape = [1, 8 if kind == "conv" else 4, 6, 6]  # with PADS: 12 x 13 padded (+ the conv's own)
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


PADS = [0, 0, 1, 3, 0, 0, 2, 0]  # all four spatial pads differ: begins and ends cannot mix up


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
    # Conv pads [h_begin, w_begin, h_end, w_end]: its own (1, 0, 0, 1) + the Pad's (1, 3, 2, 0)
    assert [[list(a.ints) for a in n.attribute if a.name == "pads"] for n in convs] == [[[2, 3, 2, 1]]] * len(
        convs
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
        dict(axes=[0, 1, 2], pads=[0, 0, 1, 0, 0, 2]),  # a leading prefix: H only, the conv has 2
        dict(pads=[0, 0, -1, 0, 0, 0, 0, 0]),  # a crop
        dict(opset=10, value=0.5),
        dict(auto_pad=True),  # the conv's padding is SAME_UPPER, not a list to add to
        dict(pad_is_output=True),
    ],
)
def test_other_pads_are_left_alone(case):
    args = {"pads": PADS, **case}
    if "axes" in case:
        args["opset"] = 18
    auto_pad, pad_is_output = args.pop("auto_pad", False), args.pop("pad_is_output", False)
    model = _model(**args)
    if auto_pad:
        conv = next(n for n in model.graph.node if n.op_type == "Conv")
        kept = [a for a in conv.attribute if a.name != "pads"]
        del conv.attribute[:]
        conv.attribute.extend([*kept, helper.make_attribute("auto_pad", "SAME_UPPER")])
    if pad_is_output:
        model.graph.output.append(helper.make_tensor_value_info("p", TensorProto.FLOAT, [1, 4, 12, 13]))
    assert fold_pads_into_convs(model) is model


def test_pad_read_inside_a_subgraph_is_kept():
    """An If branch reading the Pad's output from the outer scope still finds it."""
    model = _model(PADS)
    out = helper.make_tensor_value_info("b", TensorProto.FLOAT, None)
    branch = helper.make_graph([helper.make_node("Identity", ["p"], ["b"])], "branch", [], [out])
    model.graph.node.append(helper.make_node("If", ["cond"], ["z"], then_branch=branch, else_branch=branch))
    assert fold_pads_into_convs(model) is model

"""RecognizeGroupNorm + DecomposeGroupNorm: torch's GroupNorm / InstanceNorm exports become one
``group_norm`` that follows a conv region into NHWC (CUDA), then mean / variance ops in that layout."""

import numpy as np
import pytest
import tvm
from conftest import ort_outputs, run_outputs
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

import tvm_fusion
from tvm_fusion.frontend import import_onnx
from tvm_fusion.ir import op_calls
from tvm_fusion.passes import RecognizeGroupNorm, count_layout_transforms
from tvm_fusion.pipeline import pipeline_stages
from tvm_fusion.targets import parse_target

CUDA = {"kind": "cuda", "arch": "sm_80"}
SHAPE = [1, 8, 6, 7]


def _model(kind: str, groups: int = 2, extra_output: bool = False):
    """x -> Conv 3x3 -> norm -> Relu -> Conv 1x1 -> y. ``kind``: ``torch`` (Reshape [N, G, -1],
    InstanceNormalization with per-group scale/bias, Reshape back, per-channel Mul/Add: what
    torch.onnx writes for nn.GroupNorm), ``instance`` (InstanceNormalization on x itself),
    ``instance_affine`` (the same after an identity Reshape, then a per-channel Mul/Add) or
    ``onnx21`` (the GroupNormalization op, per-channel scale/bias)."""
    rng = np.random.default_rng(0)
    channels = SHAPE[1]

    def const(name, array):
        inits.append(numpy_helper.from_array(np.asarray(array, np.float32), name))
        return name

    inits = []
    w1 = const("w1", rng.standard_normal((channels, channels, 3, 3)) * 0.3)
    w2 = const("w2", rng.standard_normal((4, channels, 1, 1)) * 0.3)
    # a large common offset (bias 30, spread ~2.5): E[x^2] - E[x]^2 (TOPI's group_norm) loses the
    # variance to rounding here; the mean, then the mean of squared deviations, does not
    b1 = const("b1", np.full(channels, 30.0))
    nodes = [helper.make_node("Conv", ["x", w1, b1], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1])]
    opset = 17
    if kind == "torch":
        inits += [
            numpy_helper.from_array(np.array([SHAPE[0], groups, -1], np.int64), "grouped"),
            numpy_helper.from_array(np.array(SHAPE, np.int64), "shape"),
        ]
        nodes += [
            helper.make_node("Reshape", ["c", "grouped"], ["r"]),
            helper.make_node(
                "InstanceNormalization",
                ["r", const("s", rng.uniform(0.5, 2, groups)), const("b", rng.standard_normal(groups))],
                ["i"],
                epsilon=1e-5,
            ),
            helper.make_node("Reshape", ["i", "shape"], ["back"]),
            helper.make_node("Mul", ["back", const("gamma", rng.uniform(0.5, 2, (channels, 1, 1)))], ["m"]),
            helper.make_node("Add", ["m", const("beta", rng.standard_normal((channels, 1, 1)))], ["n"]),
        ]
    elif kind == "instance":
        scale, bias = const("s", rng.uniform(0.5, 2, channels)), const("b", rng.standard_normal(channels))
        nodes.append(helper.make_node("InstanceNormalization", ["c", scale, bias], ["n"], epsilon=1e-5))
    elif kind == "instance_affine":  # the dynamo export of wav2vec2's GroupNorm(512, 512)
        inits.append(numpy_helper.from_array(np.array(SHAPE, np.int64), "shape"))
        scale, bias = const("s", rng.uniform(0.5, 2, channels)), const("b", rng.standard_normal(channels))
        nodes += [
            helper.make_node("Reshape", ["c", "shape"], ["same"]),
            helper.make_node("InstanceNormalization", ["same", scale, bias], ["i"], epsilon=1e-5),
            helper.make_node("Mul", ["i", const("gamma", rng.uniform(0.5, 2, (channels, 1, 1)))], ["m"]),
            helper.make_node("Add", ["m", const("beta", rng.standard_normal((channels, 1, 1)))], ["n"]),
        ]
    else:
        opset = 21
        scale, bias = const("s", rng.uniform(0.5, 2, channels)), const("b", rng.standard_normal(channels))
        nodes.append(helper.make_node("GroupNormalization", ["c", scale, bias], ["n"], num_groups=groups))
    nodes += [
        helper.make_node("Relu", ["n"], ["a"]),
        helper.make_node("Conv", ["a", w2], ["y"], kernel_shape=[1, 1]),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 6, 7])]
    if extra_output:  # the normalized (pre-affine) tensor is read outside the pattern too
        grouped = [SHAPE[0], groups, channels // groups * SHAPE[2] * SHAPE[3]]
        outputs.append(helper.make_tensor_value_info("i", TensorProto.FLOAT, grouped))
    graph = helper.make_graph(
        nodes, "norm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, SHAPE)], outputs, inits
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def _feeds():
    x = np.random.default_rng(1).standard_normal(SHAPE).astype(np.float32)
    return {"x": x}


def _ops(mod, name):
    return len(op_calls(mod["main"], (name,)))


@pytest.mark.parametrize(
    "kind, groups",
    [("torch", 1), ("torch", 2), ("torch", 8), ("instance", 8), ("instance_affine", 8), ("onnx21", 2)],
)
def test_norm_spellings_become_one_group_norm_and_match_onnxruntime(kind, groups):
    model = _model(kind, groups)
    mod = RecognizeGroupNorm()(relax.transform.FoldConstant()(import_onnx(model).mod))
    norms = op_calls(mod["main"], ("relax.nn.group_norm",))
    assert [int(n.attrs.num_groups) for n in norms] == [groups]
    assert _ops(mod, "relax.variance") == 0 and _ops(mod, "relax.reshape") == 0
    feeds = _feeds()
    for layout in (True, "NHWC"):  # NHWC: the channels-last decomposition, run on this CPU
        got = run_outputs(tvm_fusion.build(model, "llvm", tuning_logs=None, layout=layout).executable, feeds)
        np.testing.assert_allclose(got[0], ort_outputs(model, feeds)[0], rtol=1e-4, atol=1e-4)


def _rewritten(model, target, **options):
    target = parse_target(target)
    with target:
        return tvm.transform.Sequential(pipeline_stages(target, **options).rewrite)(import_onnx(model).mod)


@pytest.mark.parametrize("groups", [1, 2])
def test_cuda_region_crosses_the_norm(groups, tmp_path):
    model = _model("torch", groups)
    mod = _rewritten(model, CUDA)
    assert count_layout_transforms(mod) == 2  # the model's input and output only
    assert _ops(mod, "relax.nn.group_norm") == 0  # decomposed, in NHWC: a mean of the values,
    assert _ops(mod, "relax.mean") == 2  # then of the squared deviations
    assert _ops(mod, "relax.variance") == 0
    # without the pass, the exported spelling's reshapes cut the region: two more transforms
    stages = pipeline_stages(parse_target(CUDA))
    without = [p for p in stages.rewrite if p.info.name != "RecognizeGroupNorm"]
    with parse_target(CUDA):
        assert count_layout_transforms(tvm.transform.Sequential(without)(import_onnx(model).mod)) == 4
    result = tvm_fusion.build(model, CUDA, tuning_logs=None)
    assert result.summary.layout_transforms == 2
    result.export(tmp_path / "gn_cuda.so")
    assert (tmp_path / "gn_cuda.so").stat().st_size > 0


def test_cpu_groups_channels_without_flattening_the_map():
    """On CPU (NCHW) the decomposition reduces [N, G, C/G, H, W]: the exported model's groups, and
    a conv that takes the split as its epilogue still writes its output positions plainly."""
    mod = _rewritten(_model("torch", 2), "llvm")
    means = op_calls(mod["main"], ("relax.mean",))
    assert len(means) == 2  # of the values, then of the squared deviations (one reduction each)
    for mean in means:
        assert [int(d) for d in mean.args[0].ty.shape] == [1, 2, 4, 6, 7]
        assert [int(a) for a in mean.attrs.axis] == [2, 3, 4]


def test_intermediate_read_elsewhere_is_left_alone():
    model = _model("torch", 2, extra_output=True)
    mod = RecognizeGroupNorm()(import_onnx(model).mod)
    assert _ops(mod, "relax.nn.group_norm") == 0
    feeds = _feeds()
    got = run_outputs(tvm_fusion.build(model, "llvm", tuning_logs=None).executable, feeds)
    for ours, ref in zip(got, ort_outputs(model, feeds), strict=True):
        np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4)


def test_symbolic_batch_is_left_alone():
    """BindUnknownShapes gives data-dependent tensors symbolic dims: no match, and no error."""
    n = tvm.tirx.Var("n", "int64")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((n, 4, 5, 5), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            mean = bb.emit(relax.op.mean(x, axis=[2, 3], keepdims=True))
            var = bb.emit(relax.op.variance(x, axis=[2, 3], keepdims=True))
            eps = relax.const(np.float32(1e-5))
            scale = bb.emit(relax.op.sqrt(bb.emit(relax.op.add(var, eps))))
            out = bb.emit_output(relax.op.divide(bb.emit(relax.op.subtract(x, mean)), scale))
        bb.emit_func_output(out)
    mod = RecognizeGroupNorm()(bb.get())
    assert _ops(mod, "relax.nn.group_norm") == 0 and _ops(mod, "relax.variance") == 1


def test_rank3_group_norm_and_a_non_channel_constant():
    """wav2vec2's GroupNorm over [N, C, T] (Conv1d); a constant after it that varies along T is
    not a per-channel affine: it stays a multiply, the norm is still recognized."""
    rng = np.random.default_rng(0)
    c, t, groups = 8, 20, 4
    inits = [
        numpy_helper.from_array((rng.standard_normal((c, c, 3)) * 0.3).astype(np.float32), "w"),
        numpy_helper.from_array(np.array([1, groups, -1], np.int64), "grouped"),
        numpy_helper.from_array(np.array([1, c, t], np.int64), "shape"),
        numpy_helper.from_array(rng.uniform(0.5, 2, groups).astype(np.float32), "s"),
        numpy_helper.from_array(rng.standard_normal(groups).astype(np.float32), "b"),
        numpy_helper.from_array(rng.uniform(0.5, 2, t).astype(np.float32), "per_t"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], kernel_shape=[3], pads=[1, 1]),
        helper.make_node("Reshape", ["c", "grouped"], ["r"]),
        helper.make_node("InstanceNormalization", ["r", "s", "b"], ["i"], epsilon=1e-5),
        helper.make_node("Reshape", ["i", "shape"], ["back"]),
        helper.make_node("Mul", ["back", "per_t"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "gn1d",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, t])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, c, t])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    mod = RecognizeGroupNorm()(relax.transform.FoldConstant()(import_onnx(model).mod))
    assert [int(n.attrs.num_groups) for n in op_calls(mod["main"], ("relax.nn.group_norm",))] == [groups]
    assert _ops(mod, "relax.multiply") == 1  # the per-T constant, not folded into gamma
    feeds = {"x": np.random.default_rng(1).standard_normal((1, c, t)).astype(np.float32)}
    got = run_outputs(tvm_fusion.build(model, "llvm", tuning_logs=None).executable, feeds)
    np.testing.assert_allclose(got[0], ort_outputs(model, feeds)[0], rtol=1e-4, atol=1e-4)

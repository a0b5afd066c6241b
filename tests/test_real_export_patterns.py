"""Handwritten reproducers of what real torch exports write, each of which once failed to import or build.

Each graph copies a node pattern of a real TorchScript export (ops, constants and node names as the
exporter writes them, shrunk to a few channels); the test builds it with the whole pipeline and compares
with ONNX Runtime. The tests marked ``zoo`` run real exports (scripts/zoo.py) when torch is installed:
``pytest -m zoo``.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import tvm
from conftest import ort_run, requires_gpu
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

import tvm_fusion
from tvm_fusion.frontend import import_onnx, model_hash
from tvm_fusion.onnx_import import ImportNodeError, from_onnx
from tvm_fusion.onnx_prepare import FOLD_LIMIT, prepare_onnx

S = 8  # sequence length of the attention pattern


def _const(name: str, value, dtype=None) -> onnx.NodeProto:
    array = np.asarray(value, dtype=dtype)
    return helper.make_node("Constant", [], [name], name=name, value=numpy_helper.from_array(array))


def _model(nodes, inputs, outputs, initializers=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "pattern", inputs, outputs, initializer=list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def _weight(name: str, *shape, seed: int = 0) -> onnx.TensorProto:
    rng = np.random.default_rng(seed)
    return numpy_helper.from_array((rng.standard_normal(shape) * 0.3).astype(np.float32), name)


def _run_ours(model, feeds, target="llvm", kernels: int | None = None, **options) -> np.ndarray:
    result = tvm_fusion.build(model, target, tuning_logs=None, **options)
    if kernels is not None:
        assert result.summary.kernels == kernels
    vm = relax.VirtualMachine(result.executable, tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(v) for v in feeds.values()]).numpy()


def _assert_matches_ort(model, feeds, **options) -> None:
    ours, reference = _run_ours(model, feeds, **options), ort_run(model, feeds)
    assert ours.shape == reference.shape
    rel = float(np.max(np.abs(ours - reference)) / np.max(np.abs(reference)))
    assert rel <= 1e-5, f"max rel err {rel:.2e} against ONNX Runtime"


def hf_attention_mask() -> onnx.ModelProto:
    """The TorchScript exporter's Hugging Face attention-mask code (BERT/RoBERTa/GPT-2/T5).

    ``ConstantOfShape`` of an EMPTY shape (a scalar ``True``) ``And``-ed with the mask, then the
    exporter's ``Expand`` shape fix-up (``Where(Equal(shape, -1 * ones), ones, shape)``), a
    ``Where`` into an additive bias, added to attention scores and soft-maxed.
    """
    nodes = [
        helper.make_node("Cast", ["attention_mask"], ["mask_bool"], name="/model/Cast", to=TensorProto.BOOL),
        _const("/model/Constant_output_0", np.zeros(0, np.int64)),
        helper.make_node(
            "ConstantOfShape",
            ["/model/Constant_output_0"],
            ["always"],
            name="/model/ConstantOfShape",
            value=helper.make_tensor("value", TensorProto.BOOL, [1], [True]),
        ),
        _const("/model/Constant_1_output_0", np.int64(3)),
        _const("/model/Constant_2_output_0", np.int64(0)),
        helper.make_node(
            "GreaterOrEqual",
            ["/model/Constant_1_output_0", "/model/Constant_2_output_0"],
            ["ge"],
            name="/model/GreaterOrEqual",
        ),
        helper.make_node("Cast", ["ge"], ["ge_bool"], name="/model/Cast_1", to=TensorProto.BOOL),
        helper.make_node("And", ["always", "ge_bool"], ["scalar_and"], name="/model/And"),
        _const("/model/Constant_3_output_0", np.array([1, 1, 1, S], np.int64)),
        helper.make_node(
            "Reshape", ["mask_bool", "/model/Constant_3_output_0"], ["mask4"], name="/model/Reshape"
        ),
        helper.make_node("And", ["scalar_and", "mask4"], ["keep"], name="/model/And_1"),
        _const("/model/Constant_7_output_0", np.array([1, -1, S, S], np.int64)),
        _const("/model/Constant_8_output_0", np.array([4], np.int64)),
        helper.make_node(
            "ConstantOfShape",
            ["/model/Constant_8_output_0"],
            ["ones4"],
            name="/model/ConstantOfShape_1",
            value=helper.make_tensor("value", TensorProto.INT64, [1], [1]),
        ),
        _const("/model/Constant_9_output_0", np.int64(-1)),
        helper.make_node("Mul", ["ones4", "/model/Constant_9_output_0"], ["neg"], name="/model/Mul_1"),
        helper.make_node("Equal", ["/model/Constant_7_output_0", "neg"], ["is_free"], name="/model/Equal"),
        helper.make_node(
            "Where", ["is_free", "ones4", "/model/Constant_7_output_0"], ["expand_shape"], name="/model/Where"
        ),
        helper.make_node("Expand", ["keep", "expand_shape"], ["keep_full"], name="/model/Expand"),
        _const("/model/zero", np.float32(0.0)),
        _const("/model/minus_big", np.float32(-1e4)),
        helper.make_node(
            "Where", ["keep_full", "/model/zero", "/model/minus_big"], ["bias"], name="/model/Where_1"
        ),
        helper.make_node("Add", ["scores", "bias"], ["masked"], name="/model/Add"),
        helper.make_node("Softmax", ["masked"], ["probs"], name="/model/Softmax", axis=-1),
    ]
    return _model(
        nodes,
        [
            helper.make_tensor_value_info("scores", TensorProto.FLOAT, [1, 1, S, S]),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, [1, S]),
        ],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, [1, 1, S, S])],
    )


def attention_feeds():
    rng = np.random.default_rng(1)
    mask = np.ones((1, S), np.int64)
    mask[0, -3:] = 0  # padding: the mask must change the result
    return {"scores": rng.standard_normal((1, 1, S, S)).astype(np.float32), "attention_mask": mask}


def shufflenet_chunk(height="6", axis: int = 1) -> onnx.ModelProto:
    """torchvision ShuffleNetV2's ``x.chunk(2, dim=1)`` + channel shuffle, as TorchScript writes it.

    The split point is computed at run time: ``Shape`` -> ``Gather`` -> ``Add`` -> ``Div`` ->
    ``Mul`` feeding ``Slice`` ends, then a conv branch, ``Concat`` and the reshape/transpose shuffle.
    ``height`` is "6" (static, as exported) or "h" (symbolic); with ``axis=2`` the split is along
    the symbolic height, so its point is known only at run time.
    """
    c = 8
    half = c // 2 if axis == 1 else c
    nodes = [
        helper.make_node("Conv", ["x", "w0", "b0"], ["y"], name="/stage2.0/Conv", kernel_shape=[1, 1]),
        helper.make_node("Relu", ["y"], ["r"], name="/stage2.0/Relu"),
        helper.make_node("Shape", ["r"], ["shape"], name="/stage2.1/Shape"),
        _const("/stage2.1/Constant_output_0", np.array([axis], np.int64)),
        helper.make_node(
            "Gather", ["shape", "/stage2.1/Constant_output_0"], ["ch"], name="/stage2.1/Gather", axis=0
        ),
        _const("/stage2.1/Constant_1_output_0", np.array([0], np.int64)),
        _const("/stage2.1/Constant_2_output_0", np.array([1], np.int64)),
        helper.make_node("Add", ["ch", "/stage2.1/Constant_2_output_0"], ["ch1"], name="/stage2.1/Add"),
        _const("/stage2.1/Constant_3_output_0", np.array([2], np.int64)),
        helper.make_node("Div", ["ch1", "/stage2.1/Constant_3_output_0"], ["split"], name="/stage2.1/Div"),
        _const("/stage2.1/Constant_4_output_0", np.array([1], np.int64)),
        helper.make_node("Mul", ["split", "/stage2.1/Constant_4_output_0"], ["end0"], name="/stage2.1/Mul"),
        helper.make_node(
            "Slice",
            ["r", "/stage2.1/Constant_1_output_0", "end0", "/stage2.1/Constant_output_0"],
            ["left"],
            name="/stage2.1/Slice",
        ),
        _const("/stage2.1/Constant_5_output_0", np.array([2], np.int64)),
        helper.make_node("Mul", ["split", "/stage2.1/Constant_5_output_0"], ["end1"], name="/stage2.1/Mul_1"),
        helper.make_node(
            "Slice", ["r", "end0", "end1", "/stage2.1/Constant_output_0"], ["right"], name="/stage2.1/Slice_1"
        ),
        helper.make_node(
            "Conv", ["right", "w1", "b1"], ["branch"], name="/branch2.0/Conv", kernel_shape=[1, 1]
        ),
        helper.make_node("Relu", ["branch"], ["branch_r"], name="/branch2.2/Relu"),
        helper.make_node("Concat", ["left", "branch_r"], ["cat"], name="/stage2.1/Concat", axis=axis),
    ]
    if axis == 1 and height == "6":  # the shuffle, with the static shapes the exporter writes
        nodes += [
            _const("/stage2.1/Constant_6_output_0", np.array([1, 2, half, 6, 6], np.int64)),
            helper.make_node(
                "Reshape", ["cat", "/stage2.1/Constant_6_output_0"], ["grouped"], name="/stage2.1/Reshape"
            ),
            helper.make_node(
                "Transpose", ["grouped"], ["shuffled"], name="/stage2.1/Transpose", perm=[0, 2, 1, 3, 4]
            ),
            _const("/stage2.1/Constant_7_output_0", np.array([1, c, 6, 6], np.int64)),
            helper.make_node(
                "Reshape", ["shuffled", "/stage2.1/Constant_7_output_0"], ["out"], name="/stage2.1/Reshape_1"
            ),
        ]
    else:
        nodes.append(helper.make_node("Relu", ["cat"], ["out"], name="/stage2.1/Relu"))
    dims = [1, c, height if height != "6" else 6, 6]
    return _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, dims)],
        [_weight("w0", c, c, 1, 1), _weight("b0", c, seed=1), _weight("w1", half, half, 1, 1, seed=2)]
        + [_weight("b1", half, seed=3)],
    )


def conv_unfold(channels_in: int, kernel: int) -> onnx.ModelProto:
    """MobileViT's unfold into 2x2 patches: a conv, then ``Reshape [1, C, H, W] -> [C·H/2, 2,
    W/2, 2]`` (torch's ``x.reshape(B·C·H/2, 2, W/2, 2)``), fused into the conv's kernel. The reshape
    scatters a conv tile (several channels x one row) over rows far apart."""
    channels_out, size = 24, 16
    nodes = [
        _const("patches", [channels_out * size // 2, 2, size // 2, 2], np.int64),
        helper.make_node("Conv", ["x", "w"], ["c"], kernel_shape=[kernel, kernel], pads=[kernel // 2] * 4),
        helper.make_node("Reshape", ["c", "patches"], ["y"]),
    ]
    return _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, channels_in, size, size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [channels_out * size // 2, 2, size // 2, 2])],
        [_weight("w", channels_out, channels_in, kernel, kernel)],
    )


def constant_index_gathers() -> onnx.ModelProto:
    """Mamba's dynamo export picks rows and columns with constant, often negative, Gather indices
    (4,098 of them); the frontend wraps each in a run-time negative-index fix-up."""
    indices = {"last": -1, "second": 2, "pair": [0, -2]}
    nodes = [_const(name, value, np.int64) for name, value in indices.items()]
    nodes.append(_const("axes", [1], np.int64))
    nodes += [
        helper.make_node("Gather", ["x", "last"], ["row"], name="/mixer/Gather", axis=1),  # [1, 6]
        helper.make_node("Gather", ["x", "pair"], ["rows"], name="/mixer/Gather_1", axis=1),  # [1, 2, 6]
        helper.make_node("Gather", ["rows", "second"], ["col"], name="/mixer/Gather_2", axis=-1),
        helper.make_node("ReduceSum", ["rows", "axes"], ["summed"], keepdims=0),
        helper.make_node("Mul", ["summed", "row"], ["prod"]),
        helper.make_node("ReduceSum", ["col", "axes"], ["col2"], keepdims=1),  # [1, 1]
        helper.make_node("Add", ["prod", "col2"], ["y"]),
    ]
    return _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 5, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 6])],
    )


def gather_feeds():
    return {"x": np.random.default_rng(3).standard_normal((1, 5, 6)).astype(np.float32)}


def weight_standardized_conv() -> onnx.ModelProto:
    """BiT's StdConv2d as the dynamo exporter writes it: the weight normalized per output channel
    by a BatchNormalization whose mean and variance are ReduceMeans of the weight itself. The
    weight (73,728 elements) is above ``prepare_onnx``'s ``FOLD_LIMIT``, so Relax folds it."""
    cout, cin = 64, 128
    assert cout * cin * 9 > FOLD_LIMIT
    nodes = [
        _const("flat", [1, cout, -1], np.int64),
        _const("oihw", [cout, cin, 3, 3], np.int64),
        _const("ones", np.ones(cout), np.float32),
        _const("zeros", np.zeros(cout), np.float32),
        helper.make_node("Reshape", ["w", "flat"], ["view"], allowzero=1),
        helper.make_node("ReduceMean", ["view"], ["mean"], axes=[0, 2], keepdims=0),
        helper.make_node("ReduceMean", ["view"], ["mean_k"], axes=[0, 2], keepdims=1),
        helper.make_node("Sub", ["view", "mean_k"], ["centered"]),
        helper.make_node("Mul", ["centered", "centered"], ["squared"]),
        helper.make_node("ReduceMean", ["squared"], ["var"], axes=[0, 2], keepdims=0),
        helper.make_node(
            "BatchNormalization", ["view", "ones", "zeros", "mean", "var"], ["std"], epsilon=1e-8
        ),
        helper.make_node("Reshape", ["std", "oihw"], ["w_std"], allowzero=1),
        helper.make_node("Conv", ["x", "w_std"], ["conv"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["conv"], ["y"]),
    ]
    return _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, cin, 6, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, cout, 6, 6])],
        [_weight("w", cout, cin, 3, 3)],
    )


def standardized_feeds():
    return {"x": np.random.default_rng(2).standard_normal((1, 128, 6, 6)).astype(np.float32)}


def image_feeds(height=6):
    return {"x": np.random.default_rng(2).standard_normal((1, 8, height, 6)).astype(np.float32)}


# -- the patterns fail in stock TVM 0.27 ----------------------------------------------------------
def test_stock_frontend_fails_on_the_attention_mask_pattern():
    """The TVM defect the fix is for (if a TVM upgrade fixes it, this test says so)."""
    from tvm.relax.frontend.onnx import from_onnx as stock_from_onnx

    with pytest.raises(Exception, match="broadcast_to"):
        stock_from_onnx(hf_attention_mask(), keep_params_in_input=False)


def test_stock_import_of_the_chunk_pattern_leaves_a_dynamic_slice():
    from tvm.relax.frontend.onnx import from_onnx as stock_from_onnx

    assert "dynamic_strided_slice" in stock_from_onnx(shufflenet_chunk(), keep_params_in_input=False).script()


# -- and match ONNX Runtime through tvm_fusion ----------------------------------------------------
def test_hf_attention_mask_pattern_matches_ort():
    _assert_matches_ort(hf_attention_mask(), attention_feeds())


def test_constant_of_shape_converter_alone_handles_an_empty_shape():
    """Without the ONNX-level folding, the corrected converter still imports the scalar fill."""
    mod = from_onnx(hf_attention_mask())
    ours = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())["main"](
        *[tvm.runtime.tensor(v) for v in attention_feeds().values()]
    )
    np.testing.assert_allclose(
        ours.numpy(), ort_run(hf_attention_mask(), attention_feeds()), rtol=1e-5, atol=1e-6
    )


def test_shufflenet_chunk_pattern_matches_ort():
    _assert_matches_ort(shufflenet_chunk(), image_feeds())


@pytest.mark.parametrize(
    "channels_in, kernel",
    [(16, 1), (16, 3), (3, 3)],
    ids=["pointwise-contraction", "3x3-contraction", "rgb-stem-depthwise-rule"],
)
def test_a_reshape_that_scatters_the_conv_tile_matches_ort(channels_in, kernel):
    """The rules computed such an epilogue per conv tile, over the box around the tile's image:
    values of other tiles, not yet computed (MobileViT: relative error 1.3; NaN on some shapes).
    Now it is computed apart; the conv and reshape stay one kernel."""
    feeds = {"x": np.random.default_rng(4).standard_normal((1, channels_in, 16, 16)).astype(np.float32)}
    _assert_matches_ort(conv_unfold(channels_in, kernel), feeds, kernels=1, conv_algorithms="direct")


@pytest.mark.parametrize("epilogue", ["Relu", "Flatten"])
def test_an_epilogue_within_the_tile_is_still_computed_per_tile(epilogue):
    """The check that keeps a scattering reshape apart lets an elementwise epilogue and a reshape
    that keeps the tile whole (H, W -> H·W) through: one parallel loop computes the conv's tile and
    writes the output from it."""
    from tvm_fusion.ir import tir_stmts

    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], kernel_shape=[1, 1]),
        helper.make_node("Reshape", ["c", "plane"], ["y"])
        if epilogue == "Flatten"
        else helper.make_node("Relu", ["c"], ["y"]),
    ]
    out = [1, 24, 256] if epilogue == "Flatten" else [1, 24, 16, 16]
    model = _model(
        [_const("plane", out, np.int64), *nodes],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, out)],
        [_weight("w", 24, 16, 1, 1)],
    )
    result = tvm_fusion.build(model, "llvm", tuning_logs=None)
    kernels = [f for _, f in result.lowered.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert len(kernels) == 1
    output = kernels[0].params[-1].name

    def stored(loop):
        return {node.buffer.name for node in tir_stmts(loop) if isinstance(node, tvm.tirx.BufferStore)}

    tasks = [
        n
        for n in tir_stmts(kernels[0])
        if isinstance(n, tvm.tirx.For) and n.kind == tvm.tirx.ForKind.PARALLEL
    ]
    assert any(output in stored(t) and any("conv2d" in name for name in stored(t)) for t in tasks)
    feeds = {"x": np.random.default_rng(5).standard_normal((1, 16, 16, 16)).astype(np.float32)}
    _assert_matches_ort(model, feeds)


def test_shape_arithmetic_is_folded_into_a_static_slice():
    imported = import_onnx(shufflenet_chunk())
    text = imported.mod.script()
    assert "dynamic_strided_slice" not in text and "R.strided_slice" in text


def test_static_dims_of_a_partly_symbolic_shape_fold():
    """Channels of a tensor with a symbolic height are still known: the chunk becomes static."""
    model = shufflenet_chunk(height="h")
    assert "dynamic_strided_slice" not in import_onnx(model).mod.script()
    for height in (6, 10):
        feeds = image_feeds(height)
        np.testing.assert_allclose(_run_ours(model, feeds), ort_run(model, feeds), rtol=1e-5, atol=1e-5)


def test_a_genuinely_dynamic_slice_builds_and_runs():
    """A split point computed from a symbolic dim stays dynamic; the pipeline must not crash on it."""
    model = shufflenet_chunk(height="h", axis=2)
    assert "dynamic_strided_slice" in import_onnx(model).mod.script()
    for height in (6, 10):
        feeds = image_feeds(height)
        ours, reference = _run_ours(model, feeds), ort_run(model, feeds)
        np.testing.assert_allclose(ours, reference, rtol=1e-5, atol=1e-5)


PATTERNS = {
    "attention_mask": (hf_attention_mask, attention_feeds),
    "shufflenet_chunk": (shufflenet_chunk, image_feeds),
    "dynamic_slice": (lambda: shufflenet_chunk(height="h", axis=2), image_feeds),
    "constant_index_gathers": (constant_index_gathers, gather_feeds),
    "weight_standardized_conv": (weight_standardized_conv, standardized_feeds),
}


@pytest.fixture(scope="module", params=sorted(PATTERNS))
def cuda_pattern(request, tmp_path_factory):
    make_model, make_feeds = PATTERNS[request.param]
    model = make_model()
    result = tvm_fusion.build(model, {"kind": "cuda", "arch": "sm_80"}, tuning_logs=None)
    path = result.export(tmp_path_factory.mktemp("cuda") / f"{request.param}.so")
    return model, make_feeds(), path


def test_patterns_build_and_export_for_cuda(cuda_pattern):
    _, _, path = cuda_pattern
    assert path.stat().st_size > 10_000


@requires_gpu
def test_patterns_match_ort_on_cuda(cuda_pattern):
    model, feeds, path = cuda_pattern
    loaded = tvm_fusion.load(path)
    np.testing.assert_allclose(loaded(*feeds.values()), ort_run(model, feeds), rtol=1e-4, atol=1e-5)


# -- the preparation step ----------------------------------------------------------------------
def test_relative_position_bias_gather_is_folded_before_import():
    """BEiT's relative position bias: a small table gathered over every query/key pair, then
    reshaped and transposed. Its result (here 3 x 197 x 197) is larger than the small values
    prepare_onnx keeps, but computed from small ones only: folded in numpy, not left to Relax's
    FoldConstant (one LLVM build per op of the chain: 20 s of BEiT's build)."""
    rng = np.random.default_rng(0)
    n = 197
    index = rng.integers(0, 40, (n * n,)).astype(np.int64)
    nodes = [
        helper.make_node("Gather", ["table", "index"], ["gathered"]),  # [n*n, 3]
        helper.make_node("Reshape", ["gathered", "shape"], ["bias_nnh"]),
        helper.make_node("Transpose", ["bias_nnh"], ["bias"], perm=[2, 0, 1]),  # [3, n, n]
        helper.make_node("Add", ["scores", "bias"], ["y"]),
    ]
    model = _model(
        nodes,
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, [1, 3, n, n])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, n, n])],
        [
            _weight("table", 40, 3),
            numpy_helper.from_array(index, "index"),
            numpy_helper.from_array(np.array([n, n, 3], np.int64), "shape"),
        ],
    )
    prepared = prepare_onnx(model)
    assert [node.op_type for node in prepared.graph.node] == ["Add"]
    feeds = {"scores": rng.standard_normal((1, 3, n, n)).astype(np.float32)}
    result = tvm_fusion.build(model, "llvm", tuning_logs=None)
    ours = relax.VirtualMachine(result.executable, tvm.cpu())["main"](
        tvm.runtime.tensor(feeds["scores"])
    ).numpy()
    np.testing.assert_allclose(ours, ort_run(model, feeds), rtol=1e-6, atol=1e-6)


def test_prepare_returns_a_model_with_nothing_to_fold_unchanged():
    model = _model(
        [helper.make_node("Relu", ["x"], ["y"], name="relu")],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
    )
    assert prepare_onnx(model) is model


def test_prepare_folds_shape_arithmetic_but_not_weights_and_leaves_the_input_model_alone():
    model = shufflenet_chunk()
    before = model.SerializeToString()
    prepared = prepare_onnx(model)
    assert model.SerializeToString() == before
    ops = [n.op_type for n in prepared.graph.node]
    assert not {"Shape", "Gather", "Div", "Constant"} & set(ops)
    assert ops.count("Conv") == 2 and ops.count("Slice") == 2
    assert {i.name for i in model.graph.initializer} <= {i.name for i in prepared.graph.initializer}


def test_model_hash_is_the_users_model():
    """Tuning records are keyed by the hash of the file the user has, not of the folded model."""
    model = hf_attention_mask()
    assert import_onnx(model).model_hash == model_hash(model)


def test_constant_gather_indices_are_resolved_at_import():
    """No run-time fix-up for FoldConstant to build one LLVM module each (Mamba: 253 s of 259)."""
    from tvm.relax.frontend.onnx import from_onnx as stock_from_onnx

    model = constant_index_gathers()
    assert "R.less" in stock_from_onnx(model, keep_params_in_input=False).script()
    ours = from_onnx(model).script()
    assert not [op for op in ("R.less", "R.where", "R.shape_to_tensor") if op in ours]
    assert ours.count("R.take") == 3
    _assert_matches_ort(model, gather_feeds())


def test_a_standardized_weight_is_a_constant_the_conv_packs():
    """The frontend folds the weight's BatchNormalization to a tuple of constants; the conv must
    read a constant (packed at compile time), not a run-time reshape of a tuple field: 34 of BiT's
    53 convs ran unpacked, its Winograd convs transforming their weights at every call."""
    model = weight_standardized_conv()
    result = tvm_fusion.build(model, "llvm", tuning_logs=None)
    (conv,) = [gv.name_hint for gv in result.lowered.functions if "conv2d" in gv.name_hint]
    assert conv.endswith("_prepacked")
    _assert_matches_ort(model, standardized_feeds())


def test_out_of_range_gather_index_is_named():
    model = _model(
        [
            _const("index", 3, np.int64),
            helper.make_node("Gather", ["x", "index"], ["y"], name="/embed/Gather", axis=1),
        ],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    with pytest.raises(ImportNodeError, match=r"'/embed/Gather' \(Gather.*index 3 out of range"):
        import_onnx(model)


def test_frontend_failure_names_the_node():
    model = _model(
        [
            _const("target_shape", np.array([5], np.int64)),
            helper.make_node("Reshape", ["x", "target_shape"], ["y"], name="/encoder/bad_reshape"),
        ],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [5])],
    )
    with pytest.raises(ImportNodeError, match=r"node '/encoder/bad_reshape' \(Reshape, outputs \['y'\]\)"):
        import_onnx(model)


def test_frontend_failure_names_an_unnamed_node_by_its_outputs():
    """Unnamed nodes are common; the error must point at the failing one, not another unnamed node."""
    model = _model(
        [
            _const("target_shape", np.array([5], np.int64)),
            helper.make_node("Reshape", ["x", "target_shape"], ["bad"]),
            helper.make_node("Relu", ["bad"], ["y"]),
        ],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [5])],
    )
    with pytest.raises(ImportNodeError, match=r"node '<unnamed>' \(Reshape, outputs \['bad'\]\)"):
        import_onnx(model)


# -- real exports (torch installed: pytest -m zoo) ----------------------------------------------
def _zoo_script():
    path = Path(__file__).resolve().parent.parent / "scripts" / "zoo.py"
    spec = importlib.util.spec_from_file_location("zoo_script", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.zoo
@pytest.mark.parametrize(
    "name, exporter",
    [
        ("shufflenet_v2_x1_0", "torchscript"),
        ("distilbert", "torchscript"),
        ("squeezenet1_1", "dynamo"),
        ("t5_encoder", "dynamo"),  # torch 2.14 exports it only with eager attention (zoo.export)
    ],
)
def test_real_export_builds_and_matches_ort(name, exporter, tmp_path):
    pytest.importorskip("torch", reason="the zoo extra (torch, torchvision, transformers) is not installed")
    pytest.importorskip("transformers", reason="the zoo extra (transformers) is not installed")
    zoo = _zoo_script()
    path = zoo.export(name, exporter, tmp_path)
    model = onnx.load(str(path))
    _assert_matches_ort(model, zoo.feeds_for(model))


def test_zoo_run_of_one_target_keeps_the_other_targets_columns(tmp_path):
    """``zoo.py run --targets llvm`` re-measures the CPU columns and keeps the CUDA ones (they were
    dropped: a CPU-only re-run showed "CUDA build + export: 18/32"); a CUDA run replaces them."""
    zoo = _zoo_script()
    cache = tmp_path / "onnx"  # results.json lives next to it
    zoo.store_result(cache, {"model": "m", "exporter": "e", "ms_ours": 1.0, "cuda_build_s": 3.0})
    zoo.store_result(cache, {"model": "m", "exporter": "e", "ms_ours": 2.0}, ("llvm",))
    row = zoo.load_results(cache)["m.e"]
    assert (row["ms_ours"], row["cuda_build_s"]) == (2.0, 3.0)
    zoo.store_result(cache, {"model": "m", "exporter": "e", "cuda_error": "boom"}, ("cuda",))
    row = zoo.load_results(cache)["m.e"]
    assert (row["ms_ours"], row["cuda_error"]) == (2.0, "boom") and "cuda_build_s" not in row


def test_zoo_report_shows_how_a_file_had_to_be_exported(tmp_path):
    """A model that torch.onnx exported only with eager attention says so in its row's note (the
    note travels in the ONNX file's metadata), and the report lists it."""
    zoo = _zoo_script()
    model = _model(
        [helper.make_node("Relu", ["x"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    assert zoo.export_note(model) == ""
    helper.set_model_props(model, {zoo.EXPORT_NOTE: "exported with eager attention"})
    assert zoo.export_note(model) == "exported with eager attention"
    row = {"model": "t5_encoder", "exporter": "dynamo", "export_note": zoo.export_note(model)}
    md = tmp_path / "zoo.md"
    zoo.write_report({"t5_encoder.dynamo": row}, md, tmp_path / "zoo.png")
    assert "## Export notes\n\n- t5_encoder (dynamo): exported with eager attention" in md.read_text()


def test_zoo_report_keeps_its_measurement_history(tmp_path):
    """Each ``--note`` becomes a dated history entry, newest first, and a rewrite of the report
    without one (``zoo.py run`` writes it too) keeps the entries: they used to be a sentence in the
    header, which the next ``run`` dropped."""
    zoo = _zoo_script()
    rows = {"bert.dynamo": {"model": "bert", "exporter": "dynamo"}}
    md = tmp_path / "zoo.md"
    zoo.write_report(rows, md, tmp_path / "zoo.png", note="bert timed again")
    zoo.write_report(rows, md, tmp_path / "zoo.png")
    zoo.write_report(rows, md, tmp_path / "zoo.png", note="all rows timed again")
    history = md.read_text().split(zoo.HISTORY_HEADING + "\n\n", 1)[1].splitlines()
    today = datetime.date.today().isoformat()
    assert history == [f"- {today}: all rows timed again", f"- {today}: bert timed again"]


def test_zoo_report_shows_the_rate_each_model_ran_at(tmp_path):
    """The zoo table's GFLOP/s column: the model's counted FLOPs over our latency, blank where either
    is missing, and the % of the FMA peak stored with the rows; ``model_gflop`` counts a matmul's
    2·M·N·K."""
    zoo = _zoo_script()
    m, k, n = 512, 1024, 1024
    model = _model(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [m, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [m, n])],
        [numpy_helper.from_array(np.ones((k, n), np.float32), "w")],
    )
    assert zoo.model_gflop(model) == 1.074  # 2 * 512 * 1024 * 1024 / 1e9
    timed = {"model": "bert", "exporter": "dynamo", "gflop": 22.0, "ms_ours": 110.0, "ms_ort": 130.0}
    timed["fma_peak_gflops"] = 250.0
    untimed = {"model": "gpt2", "exporter": "dynamo", "gflop": 22.0}
    md = tmp_path / "zoo.md"
    zoo.write_report({"bert.dynamo": timed, "gpt2.dynamo": untimed}, md, tmp_path / "zoo.png")
    text = md.read_text()
    assert "| ms ours | × ORT | GFLOP/s ours | % peak |" in text
    assert "| bert | dynamo | — | — | — | 130.00 | 110.00 | 0.85 | 200 | 80 | — | — |" in text
    assert "| gpt2 | dynamo | — | — | — | — | — | — | — | — | — | — |" in text
    assert "FMA peak: 250 GFLOP/s, the median of the peaks stored with the rows (1)" in text


def test_more_models_report_counts_only_rows_that_built_and_matched(tmp_path):
    """``more_models.py``'s table: a failed row shows its one-line error, a row over the numerics
    tolerance is not counted as a pass, an export ONNX Runtime rejects is counted apart (built, not
    checked), and the ratio summary covers the timed rows only."""
    path = Path(__file__).resolve().parent.parent / "scripts" / "more_models.py"
    spec = importlib.util.spec_from_file_location("more_models_script", path)
    more = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(more)  # it imports scripts/zoo.py by path
    ok = {"model": "a", "exporter": "dynamo", "ops": 5, "kernels": 2, "build_s": 1.0, "rel_err": 1e-6}
    rows = [
        {**ok, "ms_ort": 2.0, "ms_ours": 1.0},
        {**ok, "model": "b", "rel_err": 2e-4, "ms_ort": 1.0, "ms_ours": 3.0},
        {"model": "c", "exporter": "torchscript", "error": "killed (out of memory?): "},
        {**ok, "model": "d", "reference_error": "Fail: [ONNXRuntimeError] Tile"},  # built, unchecked
    ]
    md = tmp_path / "more.md"
    more.write_report(rows, md)
    text = md.read_text()
    assert "**1/3**" in text and "median 1.75, max 3.00" in text
    assert "1 more built but not checked: ONNX Runtime rejects the export" in text
    assert "| c | torchscript | failed: `killed (out of memory?): ` |" in text
    assert "| d | dynamo | 5 → 2 | 1.0 | no reference: ONNX Runtime rejects the export: `Fail:" in text
    # a run's note is a dated history entry, kept when the report is written again without one
    more.write_report(rows, md, note="llama timed again")
    more.write_report(rows, md)
    assert md.read_text().endswith(f"- {datetime.date.today().isoformat()}: llama timed again\n")
    # the results file: a re-run row replaces its earlier one, the others stay, in the table's order
    results = tmp_path / "more.json"
    llama, swin = {**ok, "model": "llama"}, {**ok, "model": "swin_t"}
    for row in (llama, swin, {**llama, "rel_err": 3e-6}):
        more.store_row(results, row)
    stored = json.loads(results.read_text())
    assert [(r["model"], r["rel_err"]) for r in stored] == [("swin_t", 1e-6), ("llama", 3e-6)]


@pytest.mark.parametrize("scale, message", [(0.0, "all zeros"), (1e-40, "subnormal")])
def test_zoo_comparison_refuses_a_reference_that_checks_nothing(scale, message):
    """A network whose activations vanished (HF MobileViT with uncalibrated BatchNorms: ~1e-40)
    differs by 10-100 % between any two fp32 runs; the scripts must say so, not report an error."""
    zoo = _zoo_script()
    reference = np.full((2, 3), scale, np.float32)
    vm = {"main": lambda: tvm.runtime.tensor(reference)}
    with pytest.raises(RuntimeError, match=message):
        zoo.relative_error(vm, [], reference)
    normal = reference + 1.0
    assert zoo.relative_error({"main": lambda: tvm.runtime.tensor(normal)}, [], normal) == 0.0

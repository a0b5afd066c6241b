import numpy as np
import onnx
import pytest
from conftest import ort_outputs, relax_main, run_outputs
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

from tvm_fusion import build
from tvm_fusion.frontend import import_onnx
from tvm_fusion.ir import op_calls, static_shape
from tvm_fusion.passes import SliceBeforeRowwiseOps

TOKENS, DIM, HEADS = 6, 16, 2


class _Graph:
    """Nodes and initializers of a small ONNX graph, built in order."""

    def __init__(self):
        self.rng = np.random.default_rng(0)
        self.nodes, self.inits = [], []

    def weight(self, name, *shape):
        return self.const(name, self.rng.standard_normal(shape).astype("float32") * 0.3)

    def const(self, name, value):
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def __call__(self, op, inputs, output, **attrs):
        self.nodes.append(helper.make_node(op, inputs, [output], **attrs))
        return output


def classifier_model(*, head: str = "class-token", hidden_output: bool = False):
    """A one-layer ViT-style encoder (attention, residual, layer norm, MLP, residual, layer norm)
    and a head that reads some of its tokens: "class-token" / "last-token" (Gather index 0 / -1 on
    the token axis),
    "two-tokens" (Slice 0:2 on it), "one-feature" (Gather on the feature axis, which the layer
    norm reduces). ``hidden_output``: the encoder's output is a model output too."""
    g = _Graph()
    d = DIM // HEADS

    def heads(t):  # [1, T, D] -> [1, H, T, d]
        t = g("Reshape", [t, g.const(t + "_shape", np.array([1, TOKENS, HEADS, d]))], t + "_h")
        return g("Transpose", [t], t + "_t", perm=[0, 2, 1, 3])

    q, k, v = (heads(g("MatMul", ["x", g.weight("w" + n, DIM, DIM)], n)) for n in "qkv")
    scores = g("MatMul", [q, g("Transpose", [k], "kt", perm=[0, 1, 3, 2])], "qk")
    probs = g(
        "Softmax", [g("Mul", [scores, g.const("scale", np.float32(d**-0.5))], "scaled")], "probs", axis=-1
    )
    ctx = g("Transpose", [g("MatMul", [probs, v], "pv")], "ctx_t", perm=[0, 2, 1, 3])
    ctx = g("Reshape", [ctx, g.const("merged", np.array([1, TOKENS, DIM]))], "ctx")
    x = g("Add", ["x", g("MatMul", [ctx, g.weight("wo", DIM, DIM)], "proj")], "attn_out")
    normed = g("LayerNormalization", [x, g.weight("g1", DIM), g.weight("b1", DIM)], "ln1", axis=-1)
    hidden = g(
        "Add", [g("MatMul", [normed, g.weight("w1", DIM, 4 * DIM)], "fc1"), g.weight("c1", 4 * DIM)], "h1"
    )
    mlp = g("MatMul", [g("Relu", [hidden], "act"), g.weight("w2", 4 * DIM, DIM)], "fc2")
    encoded = g("Add", [x, mlp], "res")
    encoded = g("LayerNormalization", [encoded, g.weight("g2", DIM), g.weight("b2", DIM)], "encoded", axis=-1)
    if head in ("class-token", "last-token"):
        index = g.const("index", np.array(0 if head == "class-token" else -1))
        picked = g("Gather", [encoded, index], "picked", axis=1)
    elif head == "two-tokens":
        bounds = [g.const(n, np.array([v])) for n, v in (("begin", 0), ("end", 2), ("axis", 1))]
        picked = g("Slice", [encoded, *bounds], "picked")
    else:
        picked = g("Gather", [encoded, g.const("feature", np.array(DIM - 1))], "picked", axis=2)
    g("Mul", [picked, g.const("two", np.float32(2.0))], "y")
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if hidden_output:
        outputs.append(helper.make_tensor_value_info("encoded", TensorProto.FLOAT, None))
    x_info = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, TOKENS, DIM])
    graph = helper.make_graph(g.nodes, "classifier", [x_info], outputs, g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    model = onnx.shape_inference.infer_shapes(model)
    feeds = {"x": np.random.default_rng(1).standard_normal((1, TOKENS, DIM)).astype("float32")}
    return model, feeds


def imported(model):
    return relax.transform.FoldConstant()(import_onnx(model).mod)


def rows_of(mod, op) -> list[int]:
    """The token-axis length (axis -2) of the first input of every ``op`` call in ``main``."""
    return [static_shape(call.args[0])[-2] for call in op_calls(mod["main"], {op})]


@pytest.mark.parametrize("head, kept", [("class-token", 1), ("last-token", 1), ("two-tokens", 2)])
def test_only_the_kept_tokens_go_through_the_mlp_and_the_attention_queries(cpu_target, head, kept):
    model, feeds = classifier_model(head=head)
    mod = imported(model)
    moved = SliceBeforeRowwiseOps()(mod)
    # before: every layer norm, the MLP and the Q.K^T scores run over all tokens
    assert set(rows_of(mod, "relax.nn.layer_norm")) == {TOKENS}
    assert set(rows_of(mod, "relax.nn.softmax")) == {TOKENS}
    # after: the layer norms and the softmax see the kept tokens only (keys and values stay whole)
    assert set(rows_of(moved, "relax.nn.layer_norm")) == {kept}
    assert set(rows_of(moved, "relax.nn.softmax")) == {kept}
    assert [static_shape(c)[-1] for c in op_calls(moved["main"], {"relax.nn.softmax"})] == [TOKENS]
    reference = ort_outputs(model, feeds)
    np.testing.assert_allclose(run_outputs(moved, feeds)[0], reference[0], rtol=1e-5, atol=1e-5)
    result = build(model, cpu_target, name="classifier", tuning_logs=None)
    np.testing.assert_allclose(run_outputs(result.executable, feeds)[0], reference[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "options",
    [{"hidden_output": True}, {"head": "one-feature"}],
    ids=["all-tokens-needed-too", "reduced-axis"],
)
def test_left_alone_where_every_row_is_needed(options):
    model, _ = classifier_model(**options)
    mod = imported(model)
    assert SliceBeforeRowwiseOps()(mod).same_as(mod)


def test_a_slice_after_a_conv_moves_past_its_bias_only(cpu_target):
    """wav2vec2's positional conv drops its last frame (``x[:, :, :-1]``) after the bias add: the
    slice moves in front of the add and stops at the conv, which mixes frames."""
    g = _Graph()
    conv = g("Conv", ["x", g.weight("w", 8, 4, 4)], "conv", pads=[2, 2], group=2)
    biased = g("Add", [conv, g.weight("b", 8, 1)], "biased")
    bounds = [g.const(n, np.array([v])) for n, v in (("begin", 0), ("end", -1), ("axis", 2))]
    g("Relu", [g("Slice", [biased, *bounds], "cropped")], "y")
    graph = helper.make_graph(
        g.nodes,
        "pos_conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 10])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 10])],
        g.inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    mod = imported(model)
    moved = SliceBeforeRowwiseOps()(mod)
    (add,) = op_calls(moved["main"], {"relax.add"})
    assert static_shape(add) == (1, 8, 10)  # the bias is added to the kept frames only
    (cut,) = op_calls(moved["main"], {"relax.strided_slice"})
    assert static_shape(cut.args[0]) == (1, 8, 11)  # the conv still computes every frame
    feeds = {"x": np.random.default_rng(2).standard_normal((1, 8, 10)).astype("float32")}
    reference = ort_outputs(model, feeds)[0]
    np.testing.assert_allclose(run_outputs(moved, feeds)[0], reference, rtol=1e-5, atol=1e-5)
    result = build(model, cpu_target, name="pos_conv", tuning_logs=None)
    np.testing.assert_allclose(run_outputs(result.executable, feeds)[0], reference, rtol=1e-5, atol=1e-5)


def _index(value):
    return relax.const(value, "int64")


@pytest.mark.parametrize(
    "shapes, body, moves",
    [
        (  # a batch axis of a batched matmul, seen through a transpose: both operands sliced
            [(3, 4, 5), (3, 5, 2)],
            lambda bb, a, b: relax.op.take(
                bb.emit(relax.op.permute_dims(bb.emit(relax.op.matmul(a, b)), [1, 0, 2])), _index(2), axis=1
            ),
            True,
        ),
        (  # a vector right operand: the output's first axis is a batch axis of the left one
            [(3, 4, 5), (5,)],
            lambda bb, a, b: relax.op.take(bb.emit(relax.op.matmul(a, b)), _index(1), axis=0),
            False,
        ),
        (  # -1 in wrap mode counts from the end ...
            [(4, 6)],
            lambda bb, x: relax.op.take(bb.emit(relax.op.nn.relu(x)), _index(-1), axis=0, mode="wrap"),
            True,
        ),
        (  # ... in clip mode it is row 0: left alone
            [(4, 6)],
            lambda bb, x: relax.op.take(bb.emit(relax.op.nn.relu(x)), _index(-1), axis=0, mode="clip"),
            False,
        ),
        (  # no axis (a 1-D input)
            [(6,)],
            lambda bb, x: relax.op.take(bb.emit(relax.op.nn.relu(x)), _index(4)),
            False,
        ),
    ],
    ids=[
        "batched-matmul-transposed",
        "vector-operand",
        "wrap-negative",
        "clip-negative",
        "no-axis",
    ],
)
def test_moves_only_where_exact_and_keeps_the_values(shapes, body, moves):
    mod = relax_main({f"p{i}": shape for i, shape in enumerate(shapes)}, body)
    moved = SliceBeforeRowwiseOps()(mod)
    assert moved.same_as(mod) != moves
    feeds = [np.random.default_rng(3).standard_normal(s).astype("float32") for s in shapes]
    np.testing.assert_allclose(run_outputs(moved, feeds)[0], run_outputs(mod, feeds)[0], rtol=1e-6)

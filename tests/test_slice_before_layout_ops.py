import numpy as np
import onnx
import pytest
from conftest import ort_outputs, relax_main, run_outputs
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

from tvm_fusion import build
from tvm_fusion.frontend import import_onnx
from tvm_fusion.ir import op_calls
from tvm_fusion.passes import SliceBeforeLayoutOps

TOKENS, DIM = 5, 8


def _model(nodes, inits, outputs, x_shape):
    graph = helper.make_graph(
        nodes,
        "layout_takes",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in outputs],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    feeds = {"x": np.random.default_rng(1).standard_normal(x_shape).astype("float32")}
    return onnx.shape_inference.infer_shapes(model), feeds


def packed_projection_model():
    """``nn.MultiheadAttention``'s packed in-projection, as torch exports it (ViT): one GEMM to
    ``[S, 1, 3E]``, then unflatten, unsqueeze, transpose, squeeze, and Q / K / V taken out of the
    stacked axis."""
    rng = np.random.default_rng(0)
    const = lambda name, value: numpy_helper.from_array(np.asarray(value), name)  # noqa: E731
    inits = [
        const("w", rng.standard_normal((DIM, 3 * DIM)).astype("float32")),
        const("b", rng.standard_normal(3 * DIM).astype("float32")),
        const("split", np.array([TOKENS, 1, 3, DIM])),
        const("zero", np.array([0])),
        const("stacked", np.array([3])),
        *(const(f"i{i}", np.array(i)) for i in range(3)),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["xw"]),
        helper.make_node("Add", ["xw", "b"], ["qkv"]),
        helper.make_node("Reshape", ["qkv", "split"], ["unflat"]),
        helper.make_node("Unsqueeze", ["unflat", "zero"], ["unsq"]),
        helper.make_node("Transpose", ["unsq"], ["moved"], perm=[3, 1, 2, 0, 4]),
        helper.make_node("Squeeze", ["moved", "stacked"], ["stack"]),
        *(helper.make_node("Gather", ["stack", f"i{i}"], [name], axis=0) for i, name in enumerate("qkv")),
    ]
    return _model(nodes, inits, ["q", "k", "v"], [TOKENS, 1, DIM])


def test_qkv_out_of_a_packed_projection_are_slices_of_it_and_nothing_is_transposed(cpu_target):
    model, feeds = packed_projection_model()
    mod = relax.transform.FoldConstant()(import_onnx(model).mod)
    assert op_calls(mod["main"], {"relax.permute_dims"}) and len(op_calls(mod["main"], {"relax.take"})) == 3
    rewritten = SliceBeforeLayoutOps()(mod)
    assert not op_calls(rewritten["main"], {"relax.permute_dims", "relax.take"})
    slices = op_calls(rewritten["main"], {"relax.strided_slice"})
    # each one a block of the projection's last axis: Q, K and V side by side
    assert sorted(tuple(int(v) for v in call.args[2]) for call in slices) == [(0,), (DIM,), (2 * DIM,)]
    reference = ort_outputs(model, feeds)
    for got, want in zip(run_outputs(rewritten, feeds), reference):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    result = build(model, cpu_target, name="packed", tuning_logs=None)
    kernels = [gv.name_hint for gv in result.lowered.functions]
    assert not any(op in name for name in kernels for op in ("permute", "transpose", "take")), kernels
    for got, want in zip(run_outputs(result.executable, feeds), reference):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_take_that_reads_every_other_element_is_a_stepped_slice(cpu_target):
    """``[4, 6] -> [4, 3, 2] -> transpose -> take(0)`` reads ``x[:, 0::2]``: a slice with a step,
    and the transpose (a copy of all of ``x``) is left unread."""
    inits = [
        numpy_helper.from_array(np.array([4, 3, 2]), "pairs"),
        numpy_helper.from_array(np.array(0), "first"),
    ]
    nodes = [
        helper.make_node("Reshape", ["x", "pairs"], ["paired"]),
        helper.make_node("Transpose", ["paired"], ["moved"], perm=[2, 0, 1]),
        helper.make_node("Gather", ["moved", "first"], ["y"], axis=0),
    ]
    model, feeds = _model(nodes, inits, ["y"], [4, 6])
    mod = relax.transform.FoldConstant()(import_onnx(model).mod)
    rewritten = SliceBeforeLayoutOps()(mod)
    assert not op_calls(rewritten["main"], {"relax.take", "relax.permute_dims"})
    (call,) = op_calls(rewritten["main"], {"relax.strided_slice"})
    assert [int(v) for arg in call.args[1:5] for v in arg] == [1, 0, 5, 2]  # axis, begin, end, step
    result = build(model, cpu_target, name="strided", tuning_logs=None)
    np.testing.assert_allclose(run_outputs(result.executable, feeds)[0], ort_outputs(model, feeds)[0])


def interleaved_pairs(also_read_whole: bool):
    """``matmul(x, w)`` by a constant ``w`` whose columns are (real, imaginary) pairs, viewed as
    ``[..., 4, 2]``, and the real parts taken (an ONNX DFT then ``.real``); optionally the pairs
    are an output too."""

    def body(bb, x):
        w = relax.const(np.random.default_rng(0).standard_normal((6, 8)).astype("float32"))
        pairs = bb.emit(relax.op.reshape(bb.emit(relax.op.matmul(x, w)), (3, 4, 2)))
        real = relax.op.take(pairs, relax.const(0, "int64"), axis=2)
        return relax.Tuple([bb.emit(real), pairs]) if also_read_whole else real

    return relax_main({"x": (3, 6)}, body)


def test_real_parts_of_a_matmul_by_a_constant_compute_only_those_columns():
    mod = interleaved_pairs(also_read_whole=False)
    rewritten = SliceBeforeLayoutOps()(mod)
    assert not op_calls(rewritten["main"], {"relax.take", "relax.strided_slice"})
    (matmul,) = op_calls(rewritten["main"], {"relax.matmul"})
    assert [int(d) for d in matmul.args[1].ty.shape] == [6, 4]
    data = np.random.default_rng(1).standard_normal((3, 6)).astype("float32")
    np.testing.assert_allclose(run_outputs(rewritten, [data])[0], run_outputs(mod, [data])[0], rtol=1e-6)


def test_a_matmul_read_elsewhere_too_is_computed_whole_and_sliced():
    mod = interleaved_pairs(also_read_whole=True)
    rewritten = SliceBeforeLayoutOps()(mod)
    (matmul,) = op_calls(rewritten["main"], {"relax.matmul"})
    assert [int(d) for d in matmul.args[1].ty.shape] == [6, 8]
    assert op_calls(rewritten["main"], {"relax.strided_slice"})
    data = np.random.default_rng(1).standard_normal((3, 6)).astype("float32")
    for got, want in zip(run_outputs(rewritten, [data]), run_outputs(mod, [data])):
        np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize(
    "shape, layout, index, axis, mode, block",
    [
        ((4, 6), [lambda v: relax.op.reshape(v, (4, 2, 3))], 1, 1, "fast", (1, 3, 6, 1)),  # x[:, 3:6]
        ((1, 3, 4), [relax.op.permute_dims], -1, 0, "wrap", (2, 3, 4, 1)),  # reversed axes: x[:, :, 3]
        ((2, 3, 4), [relax.op.permute_dims], -1, 0, "wrap", (2, 3, 4, 1)),  # x[:, :, 3], transposed
        (
            (3, 8),
            [lambda v: relax.op.reshape(v, (3, 4, 2)), relax.op.permute_dims],
            1,
            0,
            "fast",
            (1, 1, 8, 2),
        ),  # x[:, 1::2], transposed
        (
            (3, 4),
            [lambda v: relax.op.expand_dims(v, 0), relax.op.squeeze],
            2,
            -2,
            "clip",
            (0, 2, 3, 1),
        ),  # x[2, :]
        ((2, 3), [relax.op.flatten], 4, 0, "fast", None),  # one element: no axis block to slice
    ],
)
def test_layout_chains_replayed_on_indices(shape, layout, index, axis, mode, block):
    """Reshapes, ``permute_dims`` without axes, expand / squeeze, flatten, a negative axis and a
    wrap-mode negative index: the take becomes the slice it reads, or stays, and the function
    computes the same values either way."""

    def body(bb, view):
        for op in layout:
            view = bb.emit(op(view))
        return relax.op.take(view, relax.const(index, "int64"), axis=axis, mode=mode)

    mod = relax_main({"x": shape}, body)
    rewritten = SliceBeforeLayoutOps()(mod)
    slices = op_calls(rewritten["main"], {"relax.strided_slice"})
    if block is None:
        assert not slices and op_calls(rewritten["main"], {"relax.take"})
    else:
        assert not op_calls(rewritten["main"], {"relax.take"})
        (call,) = slices
        strides = [int(v) for v in call.args[4]] if len(call.args) > 4 else [1]
        assert (*(int(v) for arg in call.args[1:4] for v in arg), *strides) == block
    data = np.arange(np.prod(shape), dtype="float32").reshape(shape)
    np.testing.assert_array_equal(run_outputs(rewritten, [data])[0], run_outputs(mod, [data])[0])

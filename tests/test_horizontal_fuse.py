"""HorizontalFuse: sibling matmul/conv2d (and opt-in elementwise) merging, numerics and guards."""

import numpy as np
import pytest
import tvm
import tvm_ffi
from conftest import ort_outputs, run_outputs
from tvm import relax

from tvm_fusion import models
from tvm_fusion.frontend import import_onnx
from tvm_fusion.passes.horizontal_fuse import ATTR_KEY, HorizontalFuse, count_horizontal_groups

F32 = "float32"


# -- helpers ----------------------------------------------------------------------------------------
def count_op(mod, name):
    n = 0
    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            for value in relax.analysis.get_var2val(func).values():
                if (
                    isinstance(value, relax.Call)
                    and isinstance(value.op, tvm.ir.Op)
                    and value.op.name == name
                ):
                    n += 1
    return n


def split_arities(mod):
    return sorted(
        len(v.ty.fields)
        for v in relax.analysis.get_var2val(mod["main"]).values()
        if isinstance(v, relax.Call) and isinstance(v.op, tvm.ir.Op) and v.op.name == "relax.split"
    )


def run(mod, *arrays):
    return run_outputs(mod, arrays)


def max_err(a, b):
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


def folded(model):
    return relax.transform.FoldConstant()(import_onnx(model).mod)


def rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(F32)


def build(params, body):
    """Tiny BlockBuilder wrapper: ``body(bb, *params)`` emits dataflow bindings, returns outputs."""
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            outs = body(bb, *params)
            gv = bb.emit_output(relax.Tuple(outs) if isinstance(outs, (list, tuple)) else outs)
        bb.emit_func_output(gv)
    return bb.get()


def tvar(name, shape, dtype=F32):
    return relax.Var(name, relax.TensorType(shape, dtype))


def inception_model(with_3x3=True):
    """Three 1x1 conv branches (+ a 3x3 one that must stay separate) on one input."""
    g = models.GraphBuilder("inception", seed=3)
    x = g.input("input", (1, 8, 10, 10))
    outs = [g.relu(g.conv(x, 8, c, k=1)) for c in (4, 6, 2)]
    if with_3x3:
        outs.append(g.conv(x, 8, 5, k=3))
    return g.finish(outs)


def gemm_model():
    """Two ONNX Gemm (transB=1) siblings: imports as matmul(x, permute_dims(W)) + add(b)."""
    g = models.GraphBuilder("gemms", seed=4)
    x = g.input("input", (3, 8))
    outs = []
    for n in (5, 7):
        w = g.weight("w", (n, 8))
        b = g.const("b", g.rng.standard_normal(n).astype(F32))
        outs.append(g.op("Gemm", [x, w, b], transB=1))
    return g.finish(outs)


# -- transformer block: Q/K/V -------------------------------------------------------------------------
def test_transformer_qkv_become_one_matmul_and_match_reference():
    model = models.transformer_block()
    before = folded(model)
    after = HorizontalFuse()(before)
    relax.analysis.well_formed(after)
    assert relax.analysis.check_well_formed(after)
    assert count_op(after, "relax.matmul") == count_op(before, "relax.matmul") - 2
    assert split_arities(after) == [3]
    # the three bias adds are carried into one add before the split
    assert count_op(after, "relax.add") == count_op(before, "relax.add") - 2
    assert count_horizontal_groups(after) == {
        "groups": 1,
        "branches": 3,
        "matmul": 1,
        "conv2d": 0,
        "elementwise": 0,
    }

    feeds = models.random_inputs(model)
    x = feeds["input"]
    ref_tvm, got = run(before, x), run(after, x)
    assert max_err(got, ref_tvm) < 1e-5
    assert max_err(got, ort_outputs(model, feeds)) < 1e-4


def test_stock_combine_parallel_matmul_leaves_constant_weights_unfused():
    """The difference this pass exists for: stock fuses nothing once weights are Constants."""
    before = folded(models.transformer_block())
    stock = relax.transform.CombineParallelMatmul()(before)
    assert count_op(stock, "relax.matmul") == count_op(before, "relax.matmul")
    assert count_op(stock, "relax.split") == 0
    ours = HorizontalFuse()(stock)
    assert count_op(ours, "relax.matmul") == count_op(before, "relax.matmul") - 2


def test_onnx_gemm_form_unfolded_import():
    """Raw import (no FoldConstant): weights behind permute_dims, biases as plain constants."""
    model = gemm_model()
    before = import_onnx(model).mod
    assert count_op(before, "relax.permute_dims") == 2
    assert count_op(relax.transform.CombineParallelMatmul()(before), "relax.matmul") == 2  # stock: no
    after = HorizontalFuse()(before)
    assert relax.analysis.check_well_formed(after)
    assert count_op(after, "relax.matmul") == 1
    assert count_op(after, "relax.add") == 1  # biases carried
    assert count_op(after, "relax.permute_dims") == 0  # folded into the concatenated weight, dead
    feeds = models.random_inputs(model)
    assert max_err(run(after, feeds["input"]), ort_outputs(model, feeds)) < 1e-5


# -- conv2d ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fold", [True, False], ids=["folded", "raw_import"])
def test_three_1x1_conv_branches_fuse(fold):
    model = inception_model()
    before = folded(model) if fold else import_onnx(model).mod
    after = HorizontalFuse()(before)
    assert relax.analysis.check_well_formed(after)
    assert count_op(before, "relax.nn.conv2d") == 4
    assert count_op(after, "relax.nn.conv2d") == 2  # three 1x1 -> one; the 3x3 stays
    assert split_arities(after) == [3]
    assert count_op(after, "relax.add") == count_op(before, "relax.add") - 2  # conv biases carried
    assert count_op(before, "relax.nn.relu") == 3 and count_op(after, "relax.nn.relu") == 1  # relu too
    for info in (count_horizontal_groups(after), count_horizontal_groups(after.without_attr(ATTR_KEY))):
        assert (info["groups"], info["conv2d"], info["branches"]) == (1, 1, 3)
    if fold:  # one numeric check is enough for both forms
        feeds = models.random_inputs(model)
        got = run(after, feeds["input"])
        assert max_err(got, run(before, feeds["input"])) < 1e-5
        assert max_err(got, ort_outputs(model, feeds)) < 1e-4


def test_conv_mismatched_attrs_not_fused():
    x = tvar("x", (1, 4, 8, 8))
    w = [relax.const(rand(3, 4, 1, 1, seed=i)) for i in range(3)]

    def body(bb, x):
        a = bb.emit(relax.op.nn.conv2d(x, w[0]))
        b = bb.emit(relax.op.nn.conv2d(x, w[1], strides=2))  # different stride
        c = bb.emit(relax.op.nn.conv2d(x, relax.const(rand(3, 4, 3, 3)), padding=1))  # different kernel
        d = bb.emit(relax.op.nn.conv2d(x, w[2], dilation=1, padding=0, groups=1))  # matches a
        return [a, b, c, d]

    after = HorizontalFuse()(build([x], body))
    assert count_op(after, "relax.nn.conv2d") == 3  # only a + d merged
    assert split_arities(after) == [2]


# -- guards ---------------------------------------------------------------------------------------------
def test_different_inputs_or_weight_ranks_not_fused():
    x1, x2 = tvar("x1", (2, 8)), tvar("x2", (2, 12))

    def body(bb, x1, x2):
        a = bb.emit(relax.op.matmul(x1, relax.const(rand(8, 4))))  # K = 8
        b = bb.emit(relax.op.matmul(x2, relax.const(rand(12, 4))))  # K = 12, other input
        c = bb.emit(relax.op.matmul(x1, relax.const(rand(3, 8, 4))))  # batched weight: other rank
        return [a, b, c]

    mod = build([x1, x2], body)
    after = HorizontalFuse()(mod)
    assert count_op(after, "relax.matmul") == 3
    assert tvm_ffi.structural_equal(after, mod)
    assert ATTR_KEY not in (after.attrs or {})


def test_nonconstant_weight_not_fused():
    x, w = tvar("x", (2, 8)), tvar("w", (8, 4))

    def body(bb, x, w):
        a = bb.emit(relax.op.matmul(x, w))  # weight is a parameter
        b = bb.emit(relax.op.matmul(x, relax.const(rand(8, 4))))
        return [a, b]

    after = HorizontalFuse()(build([x, w], body))
    assert count_op(after, "relax.matmul") == 2
    assert count_op(after, "relax.split") == 0


def test_min_branches():
    x = tvar("x", (2, 8))

    def body(bb, x):
        return [bb.emit(relax.op.matmul(x, relax.const(rand(8, n, seed=n)))) for n in (3, 5)]

    mod = build([x], body)
    assert count_op(HorizontalFuse(min_branches=3)(mod), "relax.matmul") == 2
    assert count_op(HorizontalFuse(min_branches=2)(mod), "relax.matmul") == 1
    with pytest.raises(ValueError):
        HorizontalFuse(min_branches=1)


def test_bias_carried_with_zeros_for_a_branch_without_one_or_whose_result_is_reused():
    x = tvar("x", (2, 8))
    ws = [rand(8, n, seed=n) for n in (3, 4, 5)]
    bs = [rand(n, seed=10 + n) for n in (3, 4, 5)]

    def body(bb, x):
        m = [bb.emit(relax.op.matmul(x, relax.const(w))) for w in ws]
        a0 = bb.emit(relax.op.add(m[0], relax.const(bs[0])))
        a1 = bb.emit(relax.op.add(relax.const(bs[1]), m[1]))  # commuted form
        return [a0, a1, m[2]]  # branch 2 has no bias

    mod = build([x], body)
    after = HorizontalFuse()(mod)
    assert relax.analysis.check_well_formed(after)
    assert count_op(after, "relax.matmul") == 1
    assert count_op(after, "relax.add") == 1  # [b0, b1, 0] added once, before the split
    xv = rand(2, 8, seed=99)
    ref = [xv @ ws[0] + bs[0], xv @ ws[1] + bs[1], xv @ ws[2]]
    assert max_err(run(after, xv), ref) < 1e-5

    def body_reuse(bb, x):
        m = [bb.emit(relax.op.matmul(x, relax.const(w))) for w in ws[:2]]
        a = [bb.emit(relax.op.add(mi, relax.const(b))) for mi, b in zip(m, bs)]
        return [a[0], a[1], bb.emit(relax.op.nn.relu(m[0]))]  # m[0] also read elsewhere

    after = HorizontalFuse()(build([x], body_reuse))
    # branch 1's bias is carried ([0, b1]); branch 0's add stays after the split (m[0] is read
    # by the relu too)
    assert count_op(after, "relax.matmul") == 1 and count_op(after, "relax.add") == 2
    ref = [xv @ ws[0] + bs[0], xv @ ws[1] + bs[1], np.maximum(xv @ ws[0], 0)]
    assert max_err(run(after, xv), ref) < 1e-5

    def body_none(bb, x):
        return [bb.emit(relax.op.matmul(x, relax.const(w))) for w in ws]

    after = HorizontalFuse()(build([x], body_none))
    assert count_op(after, "relax.matmul") == 1 and count_op(after, "relax.add") == 0


def test_commuted_bias_and_output_var_member_carried():
    x = tvar("x", (4, 8))
    ws = [rand(8, n, seed=n) for n in (2, 6)]
    bs = [rand(1, n, seed=20 + n) for n in (2, 6)]  # (1, N) biases also broadcast cleanly
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            m0 = bb.emit(relax.op.matmul(x, relax.const(ws[0])))
            m1 = bb.emit(relax.op.matmul(x, relax.const(ws[1])))
            a0 = bb.emit(relax.op.add(relax.const(bs[0]), m0))
            a1 = bb.emit_output(relax.op.add(m1, relax.const(bs[1])))  # a non-dataflow member
            gv = bb.emit_output(relax.Tuple([a0, a1]))
        bb.emit_func_output(gv)
    after = HorizontalFuse()(bb.get())
    assert relax.analysis.check_well_formed(after)
    assert count_op(after, "relax.matmul") == 1 and count_op(after, "relax.add") == 1
    xv = rand(4, 8, seed=5)
    assert max_err(run(after, xv), [xv @ w + b for w, b in zip(ws, bs)]) < 1e-5


def test_deterministic_and_idempotent():
    mod = folded(inception_model())
    once = HorizontalFuse()(mod)
    assert tvm_ffi.structural_equal(once, HorizontalFuse()(mod))
    twice = HorizontalFuse()(once)
    assert count_op(twice, "relax.nn.conv2d") == count_op(once, "relax.nn.conv2d")
    assert count_op(twice, "relax.split") == 1


def test_structural_count_without_attr():
    after = HorizontalFuse()(folded(models.transformer_block()))
    stripped = after.without_attr(ATTR_KEY)
    assert count_horizontal_groups(stripped)["matmul"] == 1
    assert count_horizontal_groups(stripped)["branches"] == 3


# -- elementwise (opt-in) ----------------------------------------------------------------------------
def _elementwise_mod(shape=(2, 8)):
    x, y = tvar("x", shape), tvar("y", shape)

    def body(bb, x, y):
        a = bb.emit(relax.op.multiply(x, relax.const(2.0, F32)))
        b = bb.emit(relax.op.add(y, relax.const(1.0, F32)))
        ra = bb.emit(relax.op.sigmoid(a))
        rb = bb.emit(relax.op.sigmoid(b))
        chained = bb.emit(relax.op.sigmoid(ra))  # depends on ra: can never join ra's group
        return [ra, rb, chained]

    return build([x, y], body)


def test_elementwise_off_by_default_and_fused_when_enabled():
    mod = _elementwise_mod()
    assert tvm_ffi.structural_equal(HorizontalFuse()(mod), mod)
    after = HorizontalFuse(fuse_elementwise=True)(mod)
    assert relax.analysis.check_well_formed(after)
    assert count_op(after, "relax.sigmoid") == 2  # {ra, rb} merged, chained one stays
    assert count_op(after, "relax.concat") == 1 and split_arities(after) == [2]
    assert count_horizontal_groups(after)["elementwise"] == 1
    xv, yv = rand(2, 8, seed=1), rand(2, 8, seed=2)
    assert max_err(run(after, xv, yv), run(mod, xv, yv)) == 0.0


def test_elementwise_size_rule():
    mod = _elementwise_mod(shape=(64, 64))  # 4096 elements each
    assert (
        count_op(HorizontalFuse(fuse_elementwise=True, elementwise_max_numel=1024)(mod), "relax.concat") == 0
    )
    assert (
        count_op(HorizontalFuse(fuse_elementwise=True, elementwise_max_numel=4096)(mod), "relax.concat") == 1
    )


# -- output form ---------------------------------------------------------------------------------------
def test_strided_slice_output_form():
    model = models.transformer_block()
    before = folded(model)
    after = HorizontalFuse(output_op="strided_slice")(before)
    assert relax.analysis.check_well_formed(after)
    assert count_op(after, "relax.split") == 0
    assert count_op(after, "relax.strided_slice") == 3
    assert count_op(after, "relax.matmul") == count_op(before, "relax.matmul") - 2
    assert count_horizontal_groups(after.without_attr(ATTR_KEY))["branches"] == 3
    x = models.random_inputs(model)["input"]
    assert max_err(run(after, x), run(before, x)) < 1e-5
    with pytest.raises(ValueError):
        HorizontalFuse(output_op="slice")


def test_elementwise_and_matmul_groups_sharing_an_anchor():
    """The elementwise group lands right before a matmul group that reads its output."""
    x, y = tvar("x", (2, 8)), tvar("y", (2, 8))
    ws = [rand(8, n, seed=30 + n) for n in (3, 4)]

    def body(bb, x, y):
        a = bb.emit(relax.op.multiply(x, relax.const(2.0, F32)))
        sa = bb.emit(relax.op.sigmoid(a))
        b = bb.emit(relax.op.add(y, relax.const(1.0, F32)))
        m = [bb.emit(relax.op.matmul(sa, relax.const(w))) for w in ws]
        sb = bb.emit(relax.op.sigmoid(b))
        return m + [sb]

    mod = build([x, y], body)
    after = HorizontalFuse(fuse_elementwise=True)(mod)
    assert relax.analysis.check_well_formed(after)
    info = count_horizontal_groups(after)
    assert (info["elementwise"], info["matmul"]) == (1, 1)
    xv, yv = rand(2, 8, seed=7), rand(2, 8, seed=8)
    assert max_err(run(after, xv, yv), run(mod, xv, yv)) < 1e-6


def test_symbolic_batch_matmul_siblings():
    n = tvm.tirx.Var("n", "int64")
    x = tvar("x", (n, 8))
    ws = [rand(8, k, seed=40 + k) for k in (3, 5)]
    bs = [rand(k, seed=50 + k) for k in (3, 5)]

    def body(bb, x):
        return [
            bb.emit(relax.op.add(bb.emit(relax.op.matmul(x, relax.const(w))), relax.const(b)))
            for w, b in zip(ws, bs)
        ]

    after = HorizontalFuse()(build([x], body))
    assert relax.analysis.check_well_formed(after)
    assert count_op(after, "relax.matmul") == 1 and count_op(after, "relax.add") == 1
    xv = rand(3, 8, seed=9)
    assert max_err(run(after, xv), [xv @ w + b for w, b in zip(ws, bs)]) < 1e-5


def test_auto_output_op_slices_only_before_injective_consumers():
    # transformer Q/K/V feed reshape -> transpose: slices
    after = HorizontalFuse(output_op="auto")(folded(models.transformer_block()))
    assert count_op(after, "relax.split") == 0 and count_op(after, "relax.strided_slice") == 3
    # branch outputs feeding GEMMs: keep the single split
    x = tvar("x", (2, 8))

    def body(bb, x):
        m = [bb.emit(relax.op.matmul(x, relax.const(rand(8, 4, seed=i)))) for i in range(2)]
        return [bb.emit(relax.op.matmul(mi, relax.const(rand(4, 3, seed=9 + i)))) for i, mi in enumerate(m)]

    after = HorizontalFuse(output_op="auto")(build([x], body))
    assert split_arities(after) == [2] and count_op(after, "relax.strided_slice") == 0


def test_max_fused_width_cuts_groups():
    x = tvar("x", (2, 8))
    ws = [rand(8, n, seed=60 + n) for n in (4, 4, 4, 4, 6)]

    def body(bb, x):
        return [bb.emit(relax.op.matmul(x, relax.const(w))) for w in ws]

    mod = build([x], body)
    after = HorizontalFuse(max_fused_width=8)(mod)  # runs: [4,4] [4,4] [6] -> 3 matmuls
    assert count_op(after, "relax.matmul") == 3 and split_arities(after) == [2, 2]
    assert count_op(HorizontalFuse()(mod), "relax.matmul") == 1
    xv = rand(2, 8, seed=3)
    assert max_err(run(after, xv), [xv @ w for w in ws]) < 1e-5

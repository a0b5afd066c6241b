"""FoldBatchNorm: numerics vs the unfolded module / onnxruntime, and structural facts."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import tvm
from conftest import ort_outputs, run_outputs
from tvm import relax
from tvm.relax.frontend.onnx import from_onnx

from tvm_fusion import models
from tvm_fusion.models import GraphBuilder
from tvm_fusion.passes.fold_batch_norm import FoldBatchNorm

TOL = 1e-4


# -- helpers ----------------------------------------------------------------------------------
def _import(model: onnx.ModelProto) -> tvm.IRModule:
    return from_onnx(model, keep_params_in_input=False)


def _calls(mod: tvm.IRModule, op_name: str, func: str = "main") -> list[relax.Call]:
    return [
        v
        for v in relax.analysis.get_var2val(mod[func]).values()
        if isinstance(v, relax.Call) and isinstance(v.op, tvm.ir.Op) and v.op.name == op_name
    ]


def _n(mod, op_name):
    return len(_calls(mod, "relax." + op_name))


def _check_onnx(model: onnx.ModelProto, expect_bn_left_by_stock: bool | None = None):
    """Fold, FoldConstant, compare against the unfolded module and onnxruntime; return mods."""
    mod = _import(model)
    ours = relax.transform.FoldConstant()(FoldBatchNorm()(mod))
    assert _n(mod, "nn.batch_norm") > 0
    assert _n(ours, "nn.batch_norm") == 0
    for op in ("nn.conv2d", "matmul"):
        assert _n(ours, op) == _n(mod, op)
    feeds = models.random_inputs(model)
    args = list(feeds.values())
    ref, got, ort = run_outputs(mod, args), run_outputs(ours, args), ort_outputs(model, feeds)
    for r, g, o in zip(ref, got, ort):
        assert np.abs(r - g).max() <= TOL
        assert np.abs(o - g).max() <= TOL
    if expect_bn_left_by_stock is not None:
        stock = relax.transform.FoldBatchnormToConv2D()(mod)
        assert (_n(stock, "nn.batch_norm") > 0) == expect_bn_left_by_stock
    return mod, ours


def _weights_are_single_constants(mod):
    for op in ("relax.nn.conv2d", "relax.matmul"):
        for call in _calls(mod, op):
            assert isinstance(call.args[1], tvm.ir.Constant), f"{op} weight is not one constant"


def _bn_model(build, name="t", seed=0):
    """build(g) -> list of output names."""
    g = GraphBuilder(name, seed)
    return g.finish(build(g))


def _const_np(expr) -> np.ndarray:
    return expr.value.numpy()


# -- ONNX-imported producers ------------------------------------------------------------------
def test_conv_bn_no_bias():
    def build(g):
        x = g.input("input", (1, 3, 8, 8))
        return [g.batch_norm(g.conv(x, 3, 4, bias=False), 4)]

    mod, ours = _check_onnx(_bn_model(build), expect_bn_left_by_stock=False)
    _weights_are_single_constants(ours)
    assert _n(ours, "multiply") == 0


def test_conv_bias_bn_stock_misses_ours_folds():
    def build(g):
        x = g.input("input", (1, 3, 8, 8))
        return [g.relu(g.batch_norm(g.conv(x, 3, 4, k=3, stride=2), 4))]

    mod, ours = _check_onnx(_bn_model(build), expect_bn_left_by_stock=True)
    _weights_are_single_constants(ours)
    assert _n(ours, "multiply") == 0 and _n(ours, "add") == 1  # one folded bias add


def test_depthwise_conv_bias_bn():
    def build(g):
        x = g.input("input", (1, 4, 6, 6))
        return [g.batch_norm(g.conv(x, 4, 4, k=3, groups=4), 4)]

    _, ours = _check_onnx(_bn_model(build), expect_bn_left_by_stock=True)
    assert _n(ours, "multiply") == 0


def test_matmul_bn_2d():
    def build(g):
        x = g.input("input", (4, 8))
        return [g.batch_norm(g.linear(x, 8, 6, bias=False), 6)]

    _, ours = _check_onnx(_bn_model(build), expect_bn_left_by_stock=True)
    _weights_are_single_constants(ours)
    assert _n(ours, "multiply") == 0


def test_matmul_add_bn_2d():
    def build(g):
        x = g.input("input", (4, 8))
        return [g.batch_norm(g.linear(x, 8, 6, bias=True), 6)]

    _, ours = _check_onnx(_bn_model(build), expect_bn_left_by_stock=True)
    assert _n(ours, "multiply") == 0 and _n(ours, "add") == 1


def test_gemm_bn_mlp_bn():
    model = models.mlp_bn(batch=4, din=8, hidden=16, dout=5)
    mod, ours = _check_onnx(model, expect_bn_left_by_stock=True)
    _weights_are_single_constants(ours)
    assert _n(ours, "multiply") == 0
    # Before FoldConstant the Gemm form is kept: permute_dims over the new (single) constant.
    folded = FoldBatchNorm()(mod)
    perms = _calls(folded, "relax.permute_dims")
    assert len(perms) == 2 and all(isinstance(p.args[0], tvm.ir.Constant) for p in perms)


def test_resnet_block_net_all_folded_stock_none():
    model = models.resnet_block_net(size=8, width=4)
    mod, ours = _check_onnx(model, expect_bn_left_by_stock=True)
    stock = relax.transform.FoldBatchnormToConv2D()(mod)
    assert _n(mod, "nn.batch_norm") == 6
    assert _n(stock, "nn.batch_norm") == 6  # every conv has a bias: stock folds none
    _weights_are_single_constants(ours)
    assert _n(ours, "multiply") == 0


# -- BN before a conv -------------------------------------------------------------------------
def _bn_then_conv(k, pads, groups=1, stride=1, bias=True):
    def build(g):
        x = g.input("input", (1, 4, 7, 7))
        h = g.batch_norm(x, 4)
        ins = [h, g.weight("w", (6, 4 // groups, k, k))]
        if bias:
            ins.append(g.const("b", g.rng.standard_normal(6).astype(np.float32)))
        return [g.op("Conv", ins, kernel_shape=[k, k], pads=pads, strides=[stride] * 2, group=groups)]

    return _bn_model(build, seed=3)


@pytest.mark.parametrize(
    "k,groups,stride,bias", [(1, 1, 1, False), (3, 2, 2, True)], ids=["1x1", "3x3-nopad-g2-s2"]
)
def test_bn_before_unpadded_conv_folds_into_conv(k, groups, stride, bias):
    model = _bn_then_conv(k, [0, 0, 0, 0], groups, stride, bias)
    mod, ours = _check_onnx(model, expect_bn_left_by_stock=True)
    # Folded into the conv's weights and a bias, not lowered to an elementwise affine.
    assert _n(ours, "multiply") == 0
    (conv,) = _calls(ours, "relax.nn.conv2d")
    assert isinstance(conv.args[0], relax.Var) and conv.args[0].name == "input"
    assert not np.allclose(_const_np(conv.args[1]), _const_np(_calls(mod, "relax.nn.conv2d")[0].args[1]))


def test_bn_before_padded_conv_not_folded_into_conv():
    model = _bn_then_conv(3, [1, 1, 1, 1])
    mod = _import(model)
    w0 = _const_np(_calls(mod, "relax.nn.conv2d")[0].args[1])
    # Without lowering, the BN is left alone: folding it into a padded conv would be wrong.
    kept = FoldBatchNorm(lower_unfoldable=False)(mod)
    tvm.ir.assert_structural_equal(kept, mod)
    # Default: lowered to a per-channel multiply+add; the conv weight is the original one.
    _, ours = _check_onnx(model)
    (conv,) = _calls(ours, "relax.nn.conv2d")
    np.testing.assert_array_equal(_const_np(conv.args[1]), w0)
    assert _n(ours, "multiply") == 1


def test_bn_conv_bn_chain():
    def build(g):
        x = g.input("input", (1, 4, 5, 5))
        h = g.batch_norm(x, 4)
        h = g.op("Conv", [h, g.weight("w", (6, 4, 1, 1))], kernel_shape=[1, 1], pads=[0] * 4)
        return [g.batch_norm(h, 6)]

    _, ours = _check_onnx(_bn_model(build, seed=5))
    assert _n(ours, "multiply") == 0 and _n(ours, "add") == 1


# -- multi-consumer safety -------------------------------------------------------------------
@pytest.mark.parametrize("bias", [False, True], ids=["conv", "conv+bias"])
def test_multi_consumer_producer_not_changed(bias):
    """The conv (or conv+bias) output also feeds a second output: that consumer must still see
    the original conv, so we do not fold its weights (no duplicate conv either): the BN is
    lowered to a multiply+add instead."""

    def build(g):
        x = g.input("input", (1, 3, 6, 6))
        c = g.conv(x, 3, 4, bias=bias)
        return [g.batch_norm(c, 4), g.relu(c)]

    model = _bn_model(build, seed=7)
    mod = _import(model)
    w0 = _const_np(_calls(mod, "relax.nn.conv2d")[0].args[1])
    _, ours = _check_onnx(model, expect_bn_left_by_stock=bias)
    (conv,) = _calls(ours, "relax.nn.conv2d")
    np.testing.assert_array_equal(_const_np(conv.args[1]), w0)  # original weights kept
    assert _n(ours, "multiply") == 1
    # The ReLU still reads the (unscaled) conv output, or the original bias add.
    (relu,) = _calls(ours, "relax.nn.relu")
    v2v = relax.analysis.get_var2val(ours["main"])
    src = v2v[relu.args[0]]
    if bias:
        assert src.op.name == "relax.add" and v2v[src.args[0]].same_as(conv)
    else:
        assert src.same_as(conv)


def test_multi_consumer_bn_output_before_conv():
    """BN output used by an unpadded conv and by another op: cannot fold into the conv."""

    def build(g):
        x = g.input("input", (1, 4, 5, 5))
        h = g.batch_norm(x, 4)
        c = g.op("Conv", [h, g.weight("w", (6, 4, 1, 1))], kernel_shape=[1, 1], pads=[0] * 4)
        return [c, g.relu(h)]

    model = _bn_model(build, seed=8)
    w0 = _const_np(_calls(_import(model), "relax.nn.conv2d")[0].args[1])
    _, ours = _check_onnx(model)
    np.testing.assert_array_equal(_const_np(_calls(ours, "relax.nn.conv2d")[0].args[1]), w0)
    assert _n(ours, "multiply") == 1


# -- left alone -------------------------------------------------------------------------------
def test_non_constant_params_untouched():
    model = models.resnet_block_net(size=8, width=4)
    mod = from_onnx(model, keep_params_in_input=True)
    tvm.ir.assert_structural_equal(FoldBatchNorm()(mod), mod)


def _bb_conv_bn(dtype="float32", const_weight=True, layout="NCHW", training=False, seed=0):
    rng = np.random.default_rng(seed)
    c_in, c_out = 3, 4
    if layout == "NCHW":
        x_shape, w_shape, k_layout, axis = (1, c_in, 6, 6), (c_out, c_in, 3, 3), "OIHW", 1
    else:
        x_shape, w_shape, k_layout, axis = (1, 6, 6, c_in), (3, 3, c_in, c_out), "HWIO", 3
    w = (rng.standard_normal(w_shape) * 0.3).astype(dtype)
    gamma, beta, mean = (
        rng.uniform(0.5, 1.5, c_out),
        rng.standard_normal(c_out) * 0.1,
        rng.standard_normal(c_out) * 0.1,
    )
    var = rng.uniform(0.5, 1.5, c_out)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(x_shape, dtype))
    params = [x]
    if const_weight:
        wexpr = relax.const(w, dtype)
    else:
        wexpr = relax.Var("w", relax.TensorType(w_shape, dtype))
        params.append(wexpr)
    with bb.function("main", params):
        with bb.dataflow():
            c = bb.emit(relax.op.nn.conv2d(x, wexpr, padding=1, data_layout=layout, kernel_layout=k_layout))
            consts = [relax.const(a.astype(dtype), dtype) for a in (gamma, beta, mean, var)]
            bn = bb.emit(relax.op.nn.batch_norm(c, *consts, axis=axis, training=training))
            out = bb.emit_output(relax.TupleGetItem(bn, 0))
        bb.emit_func_output(out)
    rng_x = rng.standard_normal(x_shape).astype(dtype)
    return bb.get(), [rng_x] + ([] if const_weight else [w])


def test_non_constant_weight_keeps_weight_param():
    mod, args = _bb_conv_bn(const_weight=False)
    tvm.ir.assert_structural_equal(FoldBatchNorm(lower_unfoldable=False)(mod), mod)
    ours = FoldBatchNorm()(mod)
    assert _n(ours, "nn.batch_norm") == 0
    (conv,) = _calls(ours, "relax.nn.conv2d")
    assert conv.args[1].same_as(mod["main"].params[1])
    assert np.abs(run_outputs(mod, args)[0] - run_outputs(ours, args)[0]).max() <= TOL


def test_bn_axis_not_matching_producer_not_folded_into_weights():
    """BN over axis 0 of a matmul output (rows) is not a per-output-feature scale of W."""
    rng = np.random.default_rng(2)
    w = rng.standard_normal((8, 6)).astype("float32")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((6, 8), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            h = bb.emit(relax.op.matmul(x, relax.const(w)))
            p = [
                relax.const(a.astype("float32"))
                for a in (
                    rng.uniform(0.5, 1.5, 6),
                    rng.standard_normal(6),
                    rng.standard_normal(6),
                    rng.uniform(0.5, 1.5, 6),
                )
            ]
            bn = bb.emit(relax.op.nn.batch_norm(h, *p, axis=0, training=False))
            out = bb.emit_output(relax.TupleGetItem(bn, 0))
        bb.emit_func_output(out)
    mod = bb.get()
    ours = FoldBatchNorm()(mod)
    assert _n(ours, "nn.batch_norm") == 0 and _n(ours, "multiply") == 1
    np.testing.assert_array_equal(_const_np(_calls(ours, "relax.matmul")[0].args[1]), w)
    a = rng.standard_normal((6, 8)).astype("float32")
    assert np.abs(run_outputs(mod, [a])[0] - run_outputs(ours, [a])[0]).max() <= TOL


def test_training_mode_bn_untouched():
    mod, _ = _bb_conv_bn(training=True)
    tvm.ir.assert_structural_equal(FoldBatchNorm()(mod), mod)


def test_nhwc_conv_bn():
    mod, args = _bb_conv_bn(layout="NHWC")
    ours = FoldBatchNorm()(mod)
    assert _n(ours, "nn.batch_norm") == 0 and _n(ours, "multiply") == 0
    assert np.abs(run_outputs(mod, args)[0] - run_outputs(ours, args)[0]).max() <= TOL


def test_fp16_conv_bn():
    mod16, args16 = _bb_conv_bn(dtype="float16", seed=1)
    mod32, args32 = _bb_conv_bn(dtype="float32", seed=1)
    ours16 = relax.transform.FoldConstant()(FoldBatchNorm()(mod16))
    assert _n(ours16, "nn.batch_norm") == 0
    (conv,) = _calls(ours16, "relax.nn.conv2d")
    assert str(conv.args[1].ty.dtype) == "float16"
    ref = run_outputs(mod32, [args16[0].astype("float32")])[0]
    got = run_outputs(ours16, args16)[0].astype("float32")
    assert np.abs(ref - got).max() <= 2e-2 * max(1.0, np.abs(ref).max())


def test_idempotent():
    mod = _import(models.resnet_block_net(size=8, width=4))
    once = FoldBatchNorm()(mod)
    tvm.ir.assert_structural_equal(FoldBatchNorm()(once), once)
    assert FoldBatchNorm().info.name == "FoldBatchNorm"


def test_moving_stats_outputs_become_the_constants():
    """Inference batch_norm returns (y, moving_mean, moving_var): reads of items 1/2 are
    replaced by the mean/var constants, so the batch_norm itself can go."""
    rng = np.random.default_rng(4)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 6), "float32"))
    mean = rng.standard_normal(6).astype("float32")
    with bb.function("main", [x]):
        with bb.dataflow():
            h = bb.emit(relax.op.matmul(x, relax.const(rng.standard_normal((6, 6)).astype("float32"))))
            p = [
                relax.const(a.astype("float32"))
                for a in (rng.uniform(0.5, 1.5, 6), rng.standard_normal(6), mean, rng.uniform(0.5, 1.5, 6))
            ]
            bn = bb.emit(relax.op.nn.batch_norm(h, *p, axis=1, training=False))
            y = bb.emit(relax.TupleGetItem(bn, 0))
            m = bb.emit(relax.TupleGetItem(bn, 1))
            out = bb.emit_output(relax.Tuple([y, m]))
        bb.emit_func_output(out)
    ours = FoldBatchNorm()(bb.get())
    assert _n(ours, "nn.batch_norm") == 0 and _n(ours, "multiply") == 0
    v2v = relax.analysis.get_var2val(ours["main"])
    ret = [v for v in v2v.values() if isinstance(v, relax.Tuple)][0]
    np.testing.assert_array_equal(_const_np(v2v[ret.fields[1]]), mean)


@pytest.mark.parametrize("scale", [np.float32(0.125), np.linspace(0.5, 2.0, 6, dtype=np.float32)])
@pytest.mark.parametrize("bias", [True, False])
def test_scale_after_linear_folds_into_its_weights(scale, bias):
    """OPT/BART's ``q_proj(h) * scaling``: a constant scale (scalar or per feature) after a
    linear becomes part of its weight and bias; a scale whose input has another reader stays."""

    def build(shared: bool):
        g = GraphBuilder("scaled_linear", seed=0)
        y = g.linear(g.input("input", (3, 5, 8)), 8, 6, bias=bias)
        out = [g.op("Mul", [y, g.const("scale", scale)])]
        return g.finish(out + ([g.op("Relu", [y])] if shared else []))

    for shared in (False, True):
        model = build(shared)
        mod = _import(model)
        ours = relax.transform.FoldConstant()(FoldBatchNorm()(mod))
        assert _n(ours, "multiply") == (1 if shared else 0)
        assert _n(ours, "matmul") == 1
        feeds = models.random_inputs(model)
        for got, want in zip(run_outputs(ours, list(feeds.values())), ort_outputs(model, feeds)):
            assert np.abs(got - want).max() <= TOL

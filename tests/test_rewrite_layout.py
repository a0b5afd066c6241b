"""RewriteLayout: conv regions in NCHW8c (LLVM) / NHWC (CUDA), transforms only at the edges."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import tvm
from conftest import ort_outputs, ort_run, run_relax
from tvm import relax
from tvm.relax.dpl import is_const, is_op, is_tuple_get_item, rewrite_call, wildcard

from tvm_fusion import models
from tvm_fusion.frontend import import_onnx
from tvm_fusion.legalize import stock_legalization
from tvm_fusion.legalize.nchwc_conv import legalize_conv2d_nchwc
from tvm_fusion.passes import explain
from tvm_fusion.passes import rewrite_layout as rl
from tvm_fusion.passes.rewrite_layout import RewriteLayout, choose_layout, count_layout_transforms
from tvm_fusion.targets import llvm_target

ZNVER3 = {"kind": "llvm", "mcpu": "znver3", "num-cores": 2}
CUDA = {"kind": "cuda", "arch": "sm_80"}


# -- helpers ------------------------------------------------------------------------------------
def _fold_bn(mod: tvm.IRModule) -> tvm.IRModule:
    """Inference BN -> per-channel multiply/add with constants (what BN folding leaves at least)."""
    x, g, b, m, v = wildcard(), is_const(), is_const(), is_const(), is_const()
    bn = is_op("relax.nn.batch_norm")(x, g, b, m, v)
    pat = is_tuple_get_item(bn, 0)

    def rewrite(expr, matches):
        eps = float(matches[bn].attrs.epsilon)
        gamma, beta, mean, var = (matches[p].value.numpy() for p in (g, b, m, v))
        scale = gamma / np.sqrt(var + eps)
        shift = beta - mean * scale
        c = scale.shape[0]
        y = relax.op.multiply(matches[x], relax.const(scale.reshape(1, c, 1, 1)))
        return relax.op.add(y, relax.const(shift.reshape(1, c, 1, 1)))

    for gv, func in list(mod.functions.items()):
        if isinstance(func, relax.Function):
            mod[gv] = rewrite_call(pat, rewrite, func)
    return relax.transform.FoldConstant()(relax.transform.DeadCodeElimination()(mod))


# layout transforms left: the input's, and the output's where it is a real 4-D tensor (resnet ends
# in a global mean: [1, C, 1, 1] from NHWC / NCHW{b}c only moves unit dims, a free reshape)
EDGE_TRANSFORMS = {"resnet": 1, "mobilenet": 2}


def _model(name: str):
    return models.resnet_block_net() if name == "resnet" else models.mobilenet_block(size=16)


def _prepared(name: str):
    model = _model(name)
    return _fold_bn(import_onnx(model).mod), models.random_inputs(model)


@functools.cache
def _reference(name: str) -> np.ndarray:
    """The unconverted model's output (onnxruntime: cheaper than compiling the NCHW module)."""
    model = _model(name)
    return ort_run(model, models.random_inputs(model))


def _run(mod, feeds):
    return run_relax(mod, feeds, tvm.target.Target(ZNVER3))


def _calls(mod, op_name, func_name="main"):
    found = []

    def visit(e):
        if isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op) and e.op.name == op_name:
            found.append(e)

    for gv, func in mod.functions.items():
        if isinstance(func, relax.Function) and (func_name is None or gv.name_hint == func_name):
            relax.analysis.post_order_visit(func, visit)
    return found


def _lt_of_constant(mod) -> int:
    return sum(
        isinstance(c.args[0], tvm.ir.expr.Constant) for c in _calls(mod, "relax.layout_transform", None)
    )


def _module(build):
    """A one-function module from ``build(bb, x) -> out`` on a (1, 16, 8, 8) input."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 16, 8, 8), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(build(bb, x))
        bb.emit_func_output(out)
    return bb.get()


def _aliases(mod) -> list[str]:
    """Vars of ``main`` bound to another var (``y = x``)."""
    blocks = mod["main"].body.blocks
    return [b.var.name for block in blocks for b in block.bindings if isinstance(b.value, relax.Var)]


def _rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype("float32")


# -- layout choice -------------------------------------------------------------------------------
def test_choose_layout_per_target():
    assert choose_layout(ZNVER3) == "NCHW8c"  # AVX2: 256-bit / fp32
    assert choose_layout({"kind": "llvm", "mcpu": "skylake-avx512"}) == "NCHW16c"
    assert choose_layout(CUDA) == "NHWC"
    assert choose_layout(CUDA, layout="NCHW4c") == "NCHW4c"
    assert choose_layout(ZNVER3, layout="NCHW") == "NCHW"
    with tvm.target.Target(CUDA):
        assert choose_layout() == "NHWC"
    with pytest.raises(ValueError):
        RewriteLayout(layout="NCWH")(_module(lambda bb, x: relax.op.nn.relu(x)))


# -- the models on CPU --------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["resnet", "mobilenet"])
def test_cpu_nchw8c_models(name):
    mod, feeds = _prepared(name)
    assert count_layout_transforms(mod) == 0
    new = RewriteLayout(target=ZNVER3)(mod)
    assert new.get_global_var("main").name_hint == "main"

    convs = _calls(new, "relax.nn.conv2d")
    assert len(convs) == len(_calls(mod, "relax.nn.conv2d")) > 0
    for conv in convs:
        assert str(conv.attrs.out_layout) == "NCHW8c"
        assert str(conv.attrs.kernel_layout).startswith("OIHW")
        in_ch = conv.args[0].ty.shape.values[1]
        # the RGB stem reads NCHW3c (one chunk of 3 channels); every other conv reads NCHW8c
        assert str(conv.attrs.data_layout) == ("NCHW3c" if int(in_ch) == 1 and name == "resnet" else "NCHW8c")
    # every other 4-D op of the conv region follows (no NCHW relu / add / clip left in between)
    assert all(len(c.ty.shape.values) == 5 for c in _calls(new, "relax.nn.relu"))

    # one transform at the input, one at the output (resnet: a reshape after the global mean)
    edges = EDGE_TRANSFORMS[name]
    assert count_layout_transforms(new) == edges
    assert _lt_of_constant(new) == 0
    folded = relax.transform.FoldConstant()(new)
    assert _lt_of_constant(folded) == 0 and count_layout_transforms(folded) == edges
    # the same after legalization / the zero pipeline (call_tir to te_layout_transform)
    zero = relax.get_pipeline("zero")(new)
    assert count_layout_transforms(zero) == edges
    assert not _calls(zero, "relax.nn.conv2d", None)

    np.testing.assert_allclose(_run(zero, feeds), _reference(name), atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet", "mobilenet"])
def test_cpu_nhwc_override_models(name):
    mod, feeds = _prepared(name)
    new = RewriteLayout(target=ZNVER3, layout="NHWC")(mod)
    for conv in _calls(new, "relax.nn.conv2d"):
        assert (str(conv.attrs.data_layout), str(conv.attrs.kernel_layout)) == ("NHWC", "OHWI")
    assert count_layout_transforms(new) == EDGE_TRANSFORMS[name]
    np.testing.assert_allclose(_run(new, feeds), _reference(name), atol=1e-4, rtol=0)


def test_with_fold_batch_norm_pipeline():
    """The order it runs in: FoldBatchNorm + FoldConstant, then RewriteLayout."""
    fold_batch_norm = pytest.importorskip("tvm_fusion.passes.fold_batch_norm")
    model = models.resnet_block_net()
    mod = relax.transform.FoldConstant()(fold_batch_norm.FoldBatchNorm()(import_onnx(model).mod))
    new = RewriteLayout(target=ZNVER3)(mod)
    assert count_layout_transforms(new) == EDGE_TRANSFORMS["resnet"]
    np.testing.assert_allclose(
        _run(new, models.random_inputs(model)), _reference("resnet"), atol=1e-4, rtol=0
    )


@pytest.mark.slow
def test_standalone_on_raw_import():
    """Unfolded batch_norm is a region boundary: more transforms, same numbers."""
    model = _model("mobilenet")
    new = RewriteLayout(target=ZNVER3)(import_onnx(model).mod)
    assert all(str(c.attrs.data_layout) == "NCHW8c" for c in _calls(new, "relax.nn.conv2d"))
    assert count_layout_transforms(new) > 2  # in/out of each batch_norm
    np.testing.assert_allclose(
        _run(new, models.random_inputs(model)), _reference("mobilenet"), atol=1e-4, rtol=0
    )


# -- op coverage, broadcasting, fallback --------------------------------------------------------
def _pool_and_broadcast_module():
    w1, w2 = _rand(16, 16, 3, 3, seed=1) * 0.2, _rand(16, 16, 1, 1, seed=2) * 0.2
    per_channel_rank3 = _rand(16, 1, 1, seed=3)  # broadcasts as (1, 16, 1, 1)
    along_w = _rand(1, 1, 1, 8, seed=4)  # broadcasts along W: must not land on the c axis

    def build(bb, x):
        y = bb.emit(relax.op.nn.conv2d(x, relax.const(w1), padding=1))
        y = bb.emit(relax.op.multiply(y, relax.const(per_channel_rank3)))
        y = bb.emit(relax.op.add(y, relax.const(along_w)))
        y = bb.emit(relax.op.clip(y, 0.0, 6.0))
        y = bb.emit(relax.op.nn.max_pool2d(y, pool_size=3, strides=1, padding=1))
        y = bb.emit(relax.op.nn.conv2d(y, relax.const(w2)))
        y = bb.emit(relax.op.nn.avg_pool2d(y, pool_size=2, strides=2))
        y = bb.emit(relax.op.subtract(y, relax.const(np.float32(0.5))))
        y = bb.emit(relax.op.nn.adaptive_avg_pool2d(y, output_size=(1, 1)))
        return relax.op.reshape(y, (1, 16))

    return _module(build)


@pytest.mark.parametrize("layout", ["NCHW8c", "NHWC"])
def test_pools_and_broadcast_constants(layout):
    mod = _pool_and_broadcast_module()
    new = RewriteLayout(target=ZNVER3, layout=layout)(mod)
    for op in ("relax.nn.max_pool2d", "relax.nn.avg_pool2d", "relax.nn.adaptive_avg_pool2d"):
        (call,) = _calls(new, op)
        assert str(call.attrs.layout) == layout
    # the input's; the pooled [1, 16, 1, 1] goes back to NCHW by a reshape (only unit dims move)
    assert count_layout_transforms(new) == 1
    assert _lt_of_constant(new) == 0
    x = {"x": _rand(1, 16, 8, 8, seed=5)}
    np.testing.assert_allclose(_run(new, x), _run(mod, x), atol=1e-4, rtol=0)


def test_fallback_when_block_does_not_divide_channels():
    w1, w2, w3 = _rand(16, 16, 3, 3, seed=1) * 0.2, _rand(12, 16, 1, 1, seed=2), _rand(16, 12, 1, 1, seed=3)

    def build(bb, x):
        y = bb.emit(relax.op.nn.relu(bb.emit(relax.op.nn.conv2d(x, relax.const(w1), padding=1))))
        y = bb.emit(relax.op.nn.relu(bb.emit(relax.op.nn.conv2d(y, relax.const(w2)))))  # 12 out
        return relax.op.nn.conv2d(y, relax.const(w3))  # 12 in

    mod = _module(build)
    new = RewriteLayout(target=ZNVER3)(mod)
    assert [str(c.attrs.data_layout) for c in _calls(new, "relax.nn.conv2d")] == ["NCHW8c", "NCHW", "NCHW"]
    assert count_layout_transforms(new) == 2  # into the first conv's region, and out of it
    x = {"x": _rand(1, 16, 8, 8, seed=5)}
    np.testing.assert_allclose(_run(new, x), _run(mod, x), atol=1e-4, rtol=0)


# -- transform cleanup ----------------------------------------------------------------------------
def test_hand_written_pair_is_cancelled():
    to_c = rl._Layout(8).to_map()
    from_c = rl._Layout(8).from_map()

    def build(bb, x):
        y = bb.emit(relax.op.nn.relu(x))
        y = bb.emit(relax.op.layout_transform(y, to_c))
        y = bb.emit(relax.op.layout_transform(y, from_c))
        return relax.op.sigmoid(y)

    mod = _module(build)
    assert count_layout_transforms(mod) == 2
    for layout in ("NCHW", None):  # also when the pass would otherwise leave the graph alone
        new = RewriteLayout(target=ZNVER3, layout=layout)(mod)
        assert count_layout_transforms(new) == 0
        # the sigmoid reads the relu's var: no `y = x` binding is left for the cancelled pair
        # (ApplyFusionPolicy resolves one too, so the group is the same either way)
        assert not _aliases(new)
        assert "fused_relu_sigmoid" in explain(new, target=ZNVER3)
        assert count_layout_transforms(mod) == 2  # the pass's input is left as it was
    x = {"x": _rand(1, 16, 8, 8)}
    np.testing.assert_allclose(_run(new, x), _run(mod, x), atol=0, rtol=0)


def test_non_identity_pair_is_kept_where_stock_optimize_layout_transform_drops_it():
    """Two NCHW->NHWC transposes of a 'square' (1, 8, 8, 8) tensor: shapes match, maps do not."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 8, 8, 8), "float32"))
    nhwc = rl._Layout(0).to_map()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.layout_transform(x, nhwc))
            y = bb.emit(relax.op.layout_transform(y, nhwc))
            out = bb.emit_output(relax.op.nn.relu(y))
        bb.emit_func_output(out)
    mod = bb.get()
    ours = RewriteLayout(layout="NCHW")(mod)
    stock = relax.transform.OptimizeLayoutTransform()(mod)
    assert count_layout_transforms(ours) == 2
    assert count_layout_transforms(stock) == 0  # stock compares shapes only: wrong here
    feeds = {"x": _rand(1, 8, 8, 8)}
    np.testing.assert_allclose(_run(ours, feeds), _run(mod, feeds), atol=0, rtol=0)
    assert np.abs(_run(stock, feeds) - _run(mod, feeds)).max() > 0.1


def test_transform_of_constant_is_folded():
    c = _rand(1, 16, 8, 8, seed=7)
    to_c = rl._Layout(8).to_map()

    def build(bb, x):
        xc = bb.emit(relax.op.layout_transform(x, to_c))
        cc = bb.emit(relax.op.layout_transform(relax.const(c), to_c))
        return relax.op.add(xc, cc)

    mod = _module(build)
    assert _lt_of_constant(mod) == 1
    new = RewriteLayout(layout="NCHW")(mod)
    assert _lt_of_constant(new) == 0 and count_layout_transforms(new) == 1
    x = {"x": _rand(1, 16, 8, 8)}
    np.testing.assert_allclose(_run(new, x), _run(mod, x), atol=0, rtol=0)


# -- against the stock passes ---------------------------------------------------------------------
def test_stock_convert_layout_leaves_transforms_between_regions():
    mod, _ = _prepared("mobilenet")
    stock = relax.transform.ConvertLayout({"relax.nn.conv2d": ["NHWC", "OHWI"]})(mod)
    ours = RewriteLayout(target=CUDA)(mod)
    # stock transposes around every Clip (a call_tir from the importer) and twice at the input
    assert count_layout_transforms(stock, include_permute_dims=True) >= 6
    assert count_layout_transforms(ours, include_permute_dims=True) == 2


def test_stock_conv2d_legalization_refuses_nchwc():
    """Why we register a legalization: the stock one returns NCHWc conv2d unchanged."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 2, 8, 8, 8), "float32"))
    w = relax.const(_rand(2, 2, 3, 3, 8, 8))
    call = relax.op.nn.conv2d(x, w, padding=1, data_layout="NCHW8c", kernel_layout="OIHW8i8o")
    with bb.function("main", [x]):
        with bb.dataflow():
            call = bb.normalize(call)
            assert stock_legalization("relax.nn.conv2d")(bb, call).same_as(call)
            out = bb.emit_output(legalize_conv2d_nchwc(bb, call))
        bb.emit_func_output(out)
    mod = bb.get()
    (prim,) = [f for gv, f in mod.functions.items() if gv.name_hint == "conv2d_NCHWc"]
    assert isinstance(prim, tvm.tirx.PrimFunc)
    # reference: NCHW conv of the unblocked tensors
    xn = _rand(1, 2, 8, 8, 8, seed=3)
    got = _run(mod, {"x": xn})
    wn = w.value.numpy()
    x_nchw = xn.transpose(0, 1, 4, 2, 3).reshape(1, 16, 8, 8)
    w_oihw = wn.transpose(0, 5, 1, 4, 2, 3).reshape(16, 16, 3, 3)
    ref = _run(_module(lambda bb, v: relax.op.nn.conv2d(v, relax.const(w_oihw), padding=1)), {"x": x_nchw})
    np.testing.assert_allclose(got, ref.reshape(1, 2, 8, 8, 8).transpose(0, 1, 3, 4, 2), atol=1e-4, rtol=0)


# -- CUDA: compile only ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["resnet", "mobilenet"])
def test_cuda_nhwc_builds(name):
    import tvm.s_tir.dlight as dl

    from tvm_fusion.targets import parse_target

    mod, _ = _prepared(name)
    target = parse_target(CUDA)
    new = RewriteLayout(target=target)(mod)
    for conv in _calls(new, "relax.nn.conv2d"):
        assert (str(conv.attrs.data_layout), str(conv.attrs.kernel_layout)) == ("NHWC", "OHWI")
    assert count_layout_transforms(new) == EDGE_TRANSFORMS[name]
    lowered = relax.get_pipeline("zero")(new)
    with target:
        lowered = dl.ApplyDefaultSchedule(
            dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(), dl.gpu.Fallback()
        )(lowered)
    ex = tvm.compile(lowered, target=target)
    assert ex is not None
    assert count_layout_transforms(lowered) == EDGE_TRANSFORMS[name]


def test_default_target_is_host_cpu():
    mod, _ = _prepared("resnet")
    new = RewriteLayout()(mod)
    expected = choose_layout(llvm_target())
    assert {str(c.attrs.out_layout) for c in _calls(new, "relax.nn.conv2d")} == {expected}


# -- ops real exports put inside conv regions -----------------------------------------------------
def _fire_module():
    """SqueezeNet's fire module: squeeze 1x1, expand 1x1 and 3x3, concat on channels, then a pool."""
    g = models.GraphBuilder("fire", 0)
    x = g.input("input", (1, 16, 8, 8))
    s = g.relu(g.conv(x, 16, 8, k=1))
    h = g.op("Concat", [g.relu(g.conv(s, 8, 16, k=1)), g.relu(g.conv(s, 8, 16, k=3))], axis=1)
    h = g.op("MaxPool", [h], kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1)
    return g.finish([g.relu(g.conv(h, 32, 16, k=1))])


def _shuffle_unit(chunk_as_slices=False):
    """ShuffleNet-V2's unit: split channels, one branch convolved, concat, channel shuffle
    (reshape C -> (2, C/2), swap, reshape back), then a spatial mean without keepdims. The
    dynamo exporter writes ``torch.chunk`` as a Split, the TorchScript exporter as two Slices."""
    g = models.GraphBuilder("shuffle", 0)
    x = g.input("input", (1, 16, 8, 8))
    h = g.relu(g.conv(x, 16, 16, k=1))
    if chunk_as_slices:
        a, b = (
            g.op(
                "Slice",
                [
                    h,
                    g.const(f"start{i}", np.array([lo], np.int64)),
                    g.const(f"end{i}", np.array([hi], np.int64)),
                    g.const(f"axes{i}", np.array([1], np.int64)),
                ],
            )
            for i, (lo, hi) in enumerate([(0, 8), (8, 16)])
        )
    else:
        a, b = g.op("Split", [h, g.const("split", np.array([8, 8], np.int64))], n_out=2, axis=1)
    b = g.relu(g.conv(g.conv(g.relu(g.conv(b, 8, 8, k=1)), 8, 8, k=3, groups=8), 8, 8, k=1))
    h = g.reshape(g.op("Concat", [a, b], axis=1), [1, 2, 8, 8, 8])
    h = g.reshape(g.transpose(h, [0, 2, 1, 3, 4]), [1, 16, 8, 8])
    h = g.relu(g.conv(h, 16, 16, k=1))
    return g.finish([g.op("ReduceMean", [h], axes=[2, 3], keepdims=0)])


def _convnext_block():
    """ConvNeXt's block: depthwise 7x7, permute to NHWC, layer norm, MLP, permute back, layer
    scale, residual."""
    g = models.GraphBuilder("convnext", 0)
    x = g.input("input", (1, 16, 8, 8))
    h = g.conv(x, 16, 16, k=3)
    y = g.transpose(g.conv(h, 16, 16, k=7, groups=16), [0, 2, 3, 1])
    y = g.linear(g.gelu(g.linear(g.layer_norm(y, 16), 16, 64)), 64, 16)
    y = g.op("Mul", [g.transpose(y, [0, 3, 1, 2]), g.weight("scale", (16, 1, 1))])
    return g.finish([g.conv(g.add(y, h), 16, 16, k=1)])


def test_a_channels_last_model_builds_in_nhwc_on_cpu():
    """The CPU pipeline keeps NCHW, but a model whose convs sit between its own NHWC permutes
    (ConvNeXt) goes NHWC: its permutes become the identity, and the only transforms left are the
    model input's and output's (in NCHW: a transpose and a transposing layer-scale kernel in
    every block). A conv net without such permutes stays NCHW. The permute that became the
    identity leaves no ``y = x`` binding: the layer scale and the residual add fuse into the
    second linear's epilogue (with the binding, the fusion chain ended at the linear's bias)."""
    import tvm_fusion

    model = _convnext_block()
    assert choose_layout(ZNVER3, rl.AS_MODEL, import_onnx(model).mod) == "NHWC"
    assert choose_layout(ZNVER3, rl.AS_MODEL, import_onnx(_fire_module()).mod) == "NCHW"
    assert not _aliases(RewriteLayout(target=ZNVER3, layout="NHWC")(import_onnx(model).mod))
    result = tvm_fusion.build(model, llvm_target(), tuning_logs=None)
    kernels = [gv.name_hint for gv, f in result.lowered.functions.items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert not [k for k in kernels if "transpose" in k or "permute" in k]
    assert len([k for k in kernels if "layout_transform" in k]) == 2  # the input's, the output's
    assert [k for k in kernels if k.startswith("fused_matmul_add_multiply_add")]
    assert not [k for k in kernels if k.startswith("fused_multiply_add")]
    feeds = models.random_inputs(model)
    vm = relax.VirtualMachine(result.executable, tvm.cpu())
    ours = vm["main"](*[tvm.runtime.tensor(v) for v in feeds.values()]).numpy()
    np.testing.assert_allclose(ours, ort_run(model, feeds), atol=1e-4, rtol=1e-4)


def _conv_then_permute(plain_convs: int, relus: int):
    """``plain_convs`` 3x3 convs, then one more whose output reaches an NCHW -> NHWC permute
    through its bias add and ``relus`` ReLUs."""
    g = models.GraphBuilder("conv_permute", 0)
    h = g.input("input", (1, 16, 8, 8))
    for _ in range(plain_convs):
        h = g.conv(h, 16, 16, k=3)
    h = g.conv(h, 16, 16, k=1)
    for _ in range(relus):
        h = g.relu(h)
    return g.finish([g.layer_norm(g.transpose(h, [0, 2, 3, 1]), 16)])


@pytest.mark.parametrize(
    "plain_convs, relus, channels_last",
    [(0, 0, True), (0, 2, True), (0, 3, False), (1, 0, False), (3, 0, False)],
)
def test_channels_last_model_needs_most_convs_next_to_the_models_permutes(plain_convs, relus, channels_last):
    """A majority of the convs (1 of 2 is not one), each within three elementwise ops of the
    permute (the bias add is one)."""
    mod = import_onnx(_conv_then_permute(plain_convs, relus)).mod
    assert rl.channels_last_model(mod) is channels_last
    assert choose_layout(ZNVER3, rl.AS_MODEL, mod) == ("NHWC" if channels_last else "NCHW")
    with pytest.raises(ValueError, match="as-model"):
        choose_layout(ZNVER3, rl.AS_MODEL)


def _patch_embedding():
    """ViT's patch embedding: a 4x4/4 conv, the feature map flattened to [N, C, H*W] and
    transposed to tokens [N, H*W, C], then a layer norm."""
    g = models.GraphBuilder("patches", 0)
    x = g.input("input", (1, 3, 16, 16))
    w = g.weight("patch_w", (32, 3, 4, 4))
    h = g.op("Conv", [x, w], kernel_shape=[4, 4], strides=[4, 4])
    tokens = g.transpose(g.reshape(h, [1, 32, 16]), [0, 2, 1])
    return g.finish([g.layer_norm(tokens, 32)])


def _tokens_to_image():
    """SegFormer's hand-over from a transformer stage to a conv: tokens [N, H*W, C] transposed to
    [N, C, H*W], reshaped to [N, C, H, W]; after the conv, back to tokens the ViT way."""
    g = models.GraphBuilder("tokens", 0)
    tokens = g.input("input", (1, 36, 16))
    image = g.reshape(g.transpose(tokens, [0, 2, 1]), [1, 16, 6, 6])
    h = g.relu(g.conv(image, 16, 16, k=3))
    return g.finish([g.transpose(g.reshape(h, [1, 16, 36]), [0, 2, 1])])


def test_tokens_as_image_that_is_also_an_output_goes_back_to_nchw():
    """The adopted NHWC image is also a model output: it is handed back through one permute (the
    model's own layout, no layout_transform), and the values match ONNX Runtime."""
    g = models.GraphBuilder("tokens_out", 0)
    tokens = g.input("input", (1, 36, 16))
    image = g.reshape(g.transpose(tokens, [0, 2, 1]), [1, 16, 6, 6])
    model = g.finish([g.relu(g.conv(image, 16, 16, k=3)), image])
    feeds = models.random_inputs(model)
    new = RewriteLayout(target=ZNVER3, layout="NHWC")(import_onnx(model).mod)
    assert count_layout_transforms(new) == 1  # the conv output's; the image needs only a permute
    assert [[int(a) for a in p.attrs.axes] for p in _calls(new, "relax.permute_dims")] == [[0, 3, 1, 2]]
    for ours, ref in zip(_run(new, feeds), ort_outputs(model, feeds), strict=True):
        np.testing.assert_allclose(ours, ref, atol=1e-5, rtol=1e-5)


def _upsample_concat(mode="linear"):
    """SegFormer's decode head: a smaller map resized up to the larger one, concatenated, fused by a conv."""
    g = models.GraphBuilder("upsample", 0)
    x = g.input("input", (1, 3, 8, 8))
    big = g.conv(x, 3, 16, k=3)
    small = g.conv(big, 16, 16, k=3, stride=2)
    sizes = g.const("sizes", np.array([1, 16, 8, 8], np.int64))
    up = g.op("Resize", [small, "", "", sizes], mode=mode, coordinate_transformation_mode="half_pixel")
    return g.finish([g.conv(g.op("Concat", [up, big], axis=1), 32, 8, k=1)])


@pytest.mark.parametrize(
    "builder,layout,edges",
    [
        (_fire_module, "NHWC", 2),
        (_fire_module, "NCHW8c", 2),
        (_shuffle_unit, "NHWC", 1),
        (functools.partial(_shuffle_unit, chunk_as_slices=True), "NHWC", 1),
        (_convnext_block, "NHWC", 2),
        (_patch_embedding, "NHWC", 1),
        (_tokens_to_image, "NHWC", 0),
        (_upsample_concat, "NHWC", 2),
        (functools.partial(_upsample_concat, mode="nearest"), "NHWC", 2),
    ],
    ids=[
        "fire_concat_nhwc",
        "fire_concat_nchw8c",
        "channel_shuffle_nhwc",
        "channel_shuffle_slices_nhwc",
        "convnext_permute_nhwc",
        "vit_patch_tokens_nhwc",
        "segformer_tokens_to_image_nhwc",
        "resize_linear_nhwc",
        "resize_nearest_nhwc",
    ],
)
def test_concat_split_shuffle_and_permutes_stay_in_the_region(builder, layout, edges):
    """Only the input's transform and the 4-D output's are left (the 2-D output of a spatial mean
    needs none): concat / split / channel shuffle / the model's own NHWC permutes do not end the
    region, as they did (squeezenet 26, shufflenet 37, convnext_tiny 44 transforms on CUDA)."""
    import onnxruntime as ort

    model = builder()
    feeds = models.random_inputs(model)
    mod = import_onnx(model).mod
    new = RewriteLayout(target=ZNVER3, layout=layout)(mod)
    assert count_layout_transforms(new) == edges
    if layout == "NHWC":
        assert not _calls(new, "relax.permute_dims") or "shuffle" in model.graph.name  # the shuffle's own
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, feeds
    )[0]
    np.testing.assert_allclose(_run(new, feeds), ref, atol=1e-4, rtol=1e-4)

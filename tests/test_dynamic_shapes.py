"""Symbolic batch / sequence length: generic entry plus specialised shape buckets, both correct."""

import numpy as np
import pytest
import tvm_ffi
from conftest import max_abs_err, ort_run, run_executable

from tvm_fusion import TvmFusionError, build, import_onnx, load, models
from tvm_fusion.shape_cache import add_shape_buckets, parse_bucket, symbolic_dims


def dyn_convnet():
    g = models.GraphBuilder("dyn_convnet")
    x = g.input("input", ("batch", 3, 16, 16))
    h = g.conv_bn(x, 3, 8)
    h = g.relu(g.add(g.conv_bn(h, 8, 8, act=None), h))
    return g.finish([g.op("Flatten", [g.op("GlobalAveragePool", [h])], axis=1)])


def dyn_mlp():
    g = models.GraphBuilder("dyn_mlp")
    x = g.input("input", ("batch", "seq", 32))
    h = g.layer_norm(x, 32)
    h = g.relu(g.linear(h, 32, 64))
    return g.finish([g.linear(h, 64, 16)])


@pytest.fixture(
    scope="module", params=[("dyn_convnet", [{"batch": 2}]), ("dyn_mlp", [{"batch": 1, "seq": 8}])]
)
def bucketed(request, tmp_path_factory):
    name, buckets = request.param
    model = {"dyn_convnet": dyn_convnet, "dyn_mlp": dyn_mlp}[name]()
    result = build(model, "llvm", name=name, tuning_logs=None, shape_buckets=buckets)
    path = result.export(tmp_path_factory.mktemp("dyn") / f"{name}.so")
    return model, result, load(path)


def _inputs(model, **dims):
    shape = [dims.get(d.dim_param, d.dim_value) for d in model.graph.input[0].type.tensor_type.shape.dim]
    return np.random.default_rng(0).standard_normal(shape).astype(np.float32)


def test_bucket_entry_is_static_and_generic_stays_symbolic(bucketed):
    _, result, _ = bucketed
    (bucket,) = result.buckets
    mod = result.lowered
    assert symbolic_dims(mod, bucket["function"]) == []
    assert set(symbolic_dims(mod, "main")) == set(bucket["bindings"])


@pytest.mark.parametrize(
    "dims,expect_bucket", [({"batch": 2, "seq": 8}, True), ({"batch": 3, "seq": 5}, False)]
)
def test_both_paths_match_onnxruntime(bucketed, dims, expect_bucket):
    model, result, loaded = bucketed
    (bucket,) = result.buckets
    dims = {**dims, **(bucket["bindings"] if expect_bucket else {})}
    x = _inputs(model, **dims)
    got = loaded(x)
    assert loaded.last_function == (bucket["function"] if expect_bucket else "main")
    assert max_abs_err(got, ort_run(model, {"input": x})) < 1e-4


def test_bucket_errors():
    mod = import_onnx(dyn_mlp()).mod
    with pytest.raises(TvmFusionError, match="symbolic dims are \\['batch', 'seq'\\]"):
        add_shape_buckets(mod, [{"length": 4}])
    with pytest.raises(TvmFusionError, match="bad shape bucket"):
        parse_bucket("batch:4")
    assert parse_bucket("batch=1, seq=128") == {"batch": 1, "seq": 128}
    untouched = tvm_ffi.structural_hash(mod)
    add_shape_buckets(mod, [{"batch": 1}])
    assert tvm_ffi.structural_hash(mod) == untouched


def _callees(mod, entry):
    import tvm
    from tvm import relax

    names = []

    def visit(e):
        if isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.Op) and e.op.name == "relax.call_tir":
            names.append(e.args[0].name_hint)

    relax.analysis.post_order_visit(mod[entry], visit)
    return names


def test_bucket_kernels_are_the_static_builds_and_the_generic_ones_are_packed():
    """A bucket entry calls the very PrimFuncs a static build of that shape has; the generic entry's
    convs get our kernels too (symbolic batch as an outer parallel loop): the packed-weight
    micro-kernel, or for the RGB stem the depthwise form, where they used to fall back to plain
    loops (ResNet-18 at batch 4: ~4.5 s instead of ~0.27 s)."""
    import onnx
    import tvm
    from test_depthwise import _stages as depthwise_stages

    model = dyn_convnet()
    bucketed = build(model, "llvm", tuning_logs=None, shape_buckets=[{"batch": 2}]).lowered
    static_model = onnx.ModelProto()
    static_model.CopyFrom(model)
    static_model.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 2
    static = build(static_model, "llvm", tuning_logs=None).lowered
    pairs = list(zip(_callees(bucketed, "main__batch2"), _callees(static, "main")))
    assert pairs and len(pairs) == len(_callees(static, "main"))
    for ours, theirs in pairs:
        assert tvm_ffi.structural_equal(bucketed[ours], static[theirs]), (ours, theirs)
    assert not [n for n in _callees(bucketed, "main") if "batch_norm" in n]  # folded with a symbolic batch
    generic = [n for n in _callees(bucketed, "main") if "conv2d" in n]
    # the RGB stem takes the depthwise form (weights broadcast, not packed); the other conv is packed
    stems = [n for n in generic if "conv" in depthwise_stages(bucketed[n])]
    assert len(generic) == 2 and len(stems) == 1, generic
    assert all(n.endswith("_prepacked") for n in generic if n not in stems), generic
    for name in generic:
        kinds = {loop.kind for loop in _loops(bucketed[name].body)}
        assert tvm.tirx.ForKind.PARALLEL in kinds and tvm.tirx.ForKind.VECTORIZED in kinds, name


def dyn_conv_forms():
    """A dynamic batch through each of our CPU conv lowerings and the pooling window rule: RGB
    stem, max pool, depthwise (stride 2, then stride 1 at width 16), Winograd (F(2): 64 tiles of
    2x2), strided 1x1."""
    g = models.GraphBuilder("dyn_conv_forms")
    x = g.input("input", ("batch", 3, 128, 128))
    h = g.conv_bn(x, 3, 16, stride=2)
    h = g.op("MaxPool", [h], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    h = g.conv_bn(h, 16, 16, stride=2, groups=16)
    h = g.conv_bn(h, 16, 16, groups=16)
    h = g.conv_bn(h, 16, 32)
    h = g.conv_bn(h, 32, 64, k=1, stride=2)
    return g.finish([g.op("Flatten", [g.op("GlobalAveragePool", [h])], axis=1)])


def test_generic_entry_keeps_winograd_and_depthwise_forms():
    """With a symbolic batch, 3x3 convs still become Winograd kernels, stems / depthwise convs
    the depthwise form and pools the window rule's kernel (the batch an outer loop), as in a
    static build: ResNet-18's generic entry ran 1.7x its bucket when only direct convs took a
    symbolic batch, and its max pool 4.4x (0.41 vs 0.09 ms) before the window rule did."""
    from test_depthwise import _stages as depthwise_stages
    from test_winograd import _stages as winograd_stages
    from tvm import tirx

    from tvm_fusion.pipeline import unscheduled_module
    from tvm_fusion.schedules import Depthwise, WindowReduction, Winograd
    from tvm_fusion.targets import parse_target

    model = dyn_conv_forms()
    target = parse_target("llvm")
    fused = unscheduled_module(import_onnx(model).mod, target)
    kernels = {gv.name_hint: f for gv, f in fused.functions_items() if isinstance(f, tirx.PrimFunc)}
    with target:  # each rule schedules its kernels (a declining rule would leave them to a fallback)
        taken = {
            rule: sorted(n for n, f in kernels.items() if rule().apply(f, target, False) is not None)
            for rule in (WindowReduction, Winograd, Depthwise)
        }
    assert len(taken[WindowReduction]) == 1 and "max_pool" in taken[WindowReduction][0], taken
    assert len(taken[Winograd]) == 1 and len(taken[Depthwise]) == 3, taken
    result = build(model, "llvm", tuning_logs=None)
    convs = {n: result.lowered[n] for n in _callees(result.lowered, "main") if "conv2d" in n}
    assert any("gemm" in winograd_stages(f) for f in convs.values()), list(convs)
    assert sum("conv" in depthwise_stages(f) for f in convs.values()) == 3, list(convs)
    assert any("pointwise_subsample" in f.script() for f in convs.values()), list(convs)
    assert symbolic_dims(result.lowered, "main") == ["batch"]
    for batch in (1, 3):
        x = _inputs(model, batch=batch)
        got = run_executable(result.executable, {"input": x})
        assert max_abs_err(got, ort_run(model, {"input": x})) < 1e-4, batch


def _loops(stmt):
    from tvm_fusion.schedules._util import collect_loops

    return collect_loops(stmt)


def test_kernels_keep_noalias_next_to_the_shape_function():
    """TVM 0.27's LLVM codegen generates every function with the noalias setting of the last one
    declared; in a module with symbolic shapes that is VMShapeLower's ``shape_func``, which had
    none, and every kernel lost ``noalias`` (bucket entries ran 2x slower than static builds)."""
    import re

    result = build(dyn_convnet(), "llvm", tuning_logs=None, shape_buckets=[{"batch": 2}])
    (llvm,) = [m for m in [result.executable.mod, *result.executable.mod.imports] if m.kind == "llvm"]
    ir = llvm.inspect_source("ll")
    computes = re.findall(r"^define internal fastcc i32 @(\w+_compute_)\(([^)]*)\)", ir, re.M)
    kernels = [(name, params) for name, params in computes if "conv2d" in name]
    assert kernels, "no kernel compute functions (inlined: noalias lost)"
    for name, params in kernels:
        assert "noalias" in params, name

"""ApplyFusionPolicy: groups follow the policy table, depth cap, unique-consumer rule, cost model."""

import json

import numpy as np
import pytest
import tvm
from conftest import max_abs_err, ort_run, run_relax
from tvm import relax

from tvm_fusion import FusionPolicy, Roofline, models
from tvm_fusion.errors import TvmFusionError
from tvm_fusion.frontend import import_onnx
from tvm_fusion.legalize import LegalizeOps
from tvm_fusion.passes import ApplyFusionPolicy, explain, plan_module
from tvm_fusion.pipeline import pipeline
from tvm_fusion.report import kernel_calls, kernel_count, op_counts

LOWER = tvm.transform.Sequential(
    [
        LegalizeOps(),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        relax.transform.FuseTIR(),
        relax.transform.DeadCodeElimination(),
    ]
)


def imported(model):
    return relax.transform.FoldConstant()(import_onnx(model).mod)


def group_sizes(mod, policy=None, target="llvm"):
    (report,) = plan_module(mod, policy, target)
    return [len(g.nodes) for g in report.groups]


def primitive_functions(mod):
    return [
        gv.name_hint
        for gv, f in mod.functions.items()
        if isinstance(f, relax.Function) and f.attrs is not None and "Primitive" in f.attrs.keys()
    ]


def activation_chain(n=6, shape=(1, 64)):
    g = models.GraphBuilder("chain")
    h = g.input("input", shape)
    for op in (["Relu", "Sigmoid", "Tanh"] * n)[:n]:
        h = g.op(op, [h])
    return g.finish([h])


@pytest.mark.parametrize("depth,expected", [(4, [4, 2]), (2, [2, 2, 2]), (1, [1] * 6), (8, [6])])
def test_max_fusion_depth_caps_group_size(depth, expected):
    mod = imported(activation_chain(6))
    assert group_sizes(mod, FusionPolicy(max_fusion_depth=depth)) == expected


def test_views_do_not_count_toward_the_depth():
    """Reshapes are free index remaps: a GEMM's bias add, reshape, residual add and activation
    are one group at depth 4 (the reshape took the activation's slot before)."""
    g = models.GraphBuilder("view_chain")
    x = g.input("input", (8, 32))
    shape = g.const("shape", np.array([2, 4, 32], np.int64))
    h = g.op("MatMul", [x, g.weight("w", (32, 32))])
    h = g.op("Add", [h, g.weight("b", (32,))])
    h = g.op("Reshape", [h, shape])
    h = g.op("Add", [h, g.weight("r", (2, 4, 32))])
    h = g.op("Relu", [h])
    (report,) = plan_module(imported(g.finish([h])), None, "llvm")
    assert [[n.op_name for n in grp.nodes] for grp in report.groups] == [
        ["matmul", "add", "reshape", "add", "nn.relu"]
    ]


def test_concats_do_not_count_toward_the_depth():
    """A concat in front of a conv writes nothing once fused (the conv reads its pieces): the conv's
    bias add, residual add and relu still join it at depth 4."""
    g = models.GraphBuilder("concat_chain")
    pieces = [g.input(f"p{i}", (1, 8, 6, 6)) for i in range(2)]
    h = g.conv(g.op("Concat", pieces, axis=1), 16, 8, k=1)
    h = g.relu(g.add(h, g.input("residual", (1, 8, 6, 6))))
    (report,) = plan_module(imported(g.finish([h])), None, "llvm")
    assert [[n.op_name for n in grp.nodes] for grp in report.groups] == [
        ["concat", "nn.conv2d", "add", "add", "nn.relu"]
    ]


def test_slices_do_not_count_toward_the_depth():
    """A crop after a conv (PadConvChannels' filters padded to whole vectors, RegNet's blocks) writes
    nothing once fused: the bias add, residual add and relu still join the conv at depth 4 (the
    relu was a kernel of its own when the slice counted)."""
    g = models.GraphBuilder("slice_chain")
    x = g.input("input", (1, 8, 6, 6))
    h = g.conv(x, 8, 16, k=1, bias=False)
    crop = [g.const(n, np.array([v], np.int64)) for n, v in (("start", 0), ("end", 12), ("axis", 1))]
    h = g.op("Slice", [h, *crop])
    h = g.add(h, g.weight("bias", (1, 12, 1, 1)))
    h = g.relu(g.add(h, g.input("residual", (1, 12, 6, 6))))
    (report,) = plan_module(imported(g.finish([h])), None, "llvm")
    assert [[n.op_name for n in grp.nodes] for grp in report.groups] == [
        ["nn.conv2d", "strided_slice", "add", "add", "nn.relu"]
    ]


def test_depth_groups_run_correctly_and_become_one_kernel_each():
    model = activation_chain(6)
    feeds = models.random_inputs(model)
    fused = ApplyFusionPolicy(FusionPolicy(max_fusion_depth=4), "llvm")(imported(model))
    assert len(primitive_functions(fused)) == 2
    lowered = LOWER(fused)
    assert kernel_count(lowered) == 2
    assert max_abs_err(run_relax(lowered, feeds), ort_run(model, feeds)) < 1e-6


def test_unique_consumer_rule_keeps_shared_producer_unfused():
    g = models.GraphBuilder("diamond")
    x = g.input("input", (1, 8, 8, 8))
    c = g.conv(x, 8, 8, bias=False)
    out = g.add(g.relu(c), g.op("Sigmoid", [c]))
    model = g.finish([out])
    mod = imported(model)
    (report,) = plan_module(mod, None, "llvm")
    conv_group = next(gr for gr in report.groups if gr.nodes[0].op_name == "nn.conv2d")
    assert len(conv_group.nodes) == 1
    assert any("2 consumers (unique-consumer rule)" in d.reason for d in report.decisions)
    feeds = models.random_inputs(model)
    assert max_abs_err(run_relax(LOWER(ApplyFusionPolicy()(mod)), feeds), ort_run(model, feeds)) < 1e-5


def test_user_policy_table_is_obeyed():
    model = models.mlp_bn()
    mod = imported(model)
    default_groups = primitive_functions(ApplyFusionPolicy()(mod))
    assert any(name.startswith("fused_matmul_add") for name in default_groups)
    no_gemm = FusionPolicy.from_dict({"vertical": {"binary": ["activation"]}})
    fused = ApplyFusionPolicy(no_gemm)(mod)
    assert not any("matmul" in name for name in primitive_functions(fused))
    assert "pair gemm -> binary is not in the policy table" in tvm_fusion_explain(mod, no_gemm)


def tvm_fusion_explain(mod, policy):
    from tvm_fusion import explain

    return explain(mod, policy, "llvm")


def test_benefit_threshold_rejects_everything_when_high():
    mod = imported(activation_chain(4))
    policy = FusionPolicy(benefit_threshold_us=1e6)
    assert group_sizes(mod, policy) == [1, 1, 1, 1]
    assert "cost model: benefit" in tvm_fusion_explain(mod, policy)
    assert group_sizes(mod, policy.replace(use_cost_model=False)) == [4]


def _relu_then_matmul(n_out):
    g = models.GraphBuilder("relu_matmul")
    x = g.input("input", (64, 256))
    y = g.op("MatMul", [g.relu(x), g.weight("w", (256, n_out))])
    return g.finish([y])


def test_cost_model_prices_prologue_recompute_by_reuse():
    """relu -> matmul fused as a prologue recomputes relu once per output column (N times)."""
    policy = FusionPolicy.from_dict({"vertical": {"activation": ["gemm"]}})
    narrow = imported(_relu_then_matmul(2))  # each relu output read twice: cheap to recompute
    wide = imported(_relu_then_matmul(4096))  # read 4096 times: recompute costs more than it saves
    assert group_sizes(narrow, policy) == [2]
    assert group_sizes(wide, policy) == [1, 1]
    assert "recomputes" in tvm_fusion_explain(wide, policy)


def test_layer_norm_feeds_matmul_as_prologue(example):
    model, feeds = example("transformer_block")
    mod = imported(model)
    names = primitive_functions(ApplyFusionPolicy()(mod))
    assert any(n.startswith("fused_layer_norm_matmul") for n in names), names


def test_resnet_kernel_count_beats_stock_and_halves_ops(example, cpu_target):
    model, feeds = example("resnet_block_net")
    mod = import_onnx(model).mod
    unfused_ops = sum(op_counts(mod).values())
    with cpu_target:
        stock = relax.get_pipeline("zero")(mod)
        ours = pipeline(cpu_target)(mod)
    assert kernel_count(ours) <= kernel_count(stock)
    assert kernel_count(ours) <= 0.5 * unfused_ops
    assert max_abs_err(run_relax(ours, feeds, cpu_target), ort_run(model, feeds)) < 1e-4


def test_each_group_is_one_kernel(example):
    """Every call of a fused group becomes exactly one kernel launch after FuseTIR."""
    import collections

    model, _ = example("transformer_block")
    fused = ApplyFusionPolicy()(imported(model))
    groups = set(primitive_functions(fused))
    calls = []
    relax.analysis.post_order_visit(
        fused["main"],
        lambda e: (
            calls.append(e.op.name_hint)
            if isinstance(e, relax.Call) and isinstance(e.op, tvm.ir.GlobalVar)
            else None
        ),
    )
    group_calls = collections.Counter(c for c in calls if c in groups)
    launched = collections.Counter(k for k in kernel_calls(LOWER(fused)) if k in groups)
    assert sum(group_calls.values()) >= 8
    assert launched == group_calls


def test_policy_round_trips_through_json(tmp_path):
    policy = FusionPolicy(
        max_fusion_depth=3, benefit_threshold_us=0.5, roofline=Roofline(10.0, 50.0, 1.0, 1 << 20)
    )
    path = tmp_path / "policy.json"
    path.write_text(json.dumps(policy.to_dict()))
    again = FusionPolicy.coerce(str(path))
    assert again == policy


def test_policy_rejects_unknown_keys_and_classes():
    with pytest.raises(TvmFusionError, match="unknown fusion policy key"):
        FusionPolicy.from_dict({"max_depth": 3})
    with pytest.raises(TvmFusionError, match="not in op_classes"):
        FusionPolicy.from_dict({"vertical": {"gemm": ["bogus"]}})
    with pytest.raises(TvmFusionError, match="max_fusion_depth"):
        FusionPolicy(max_fusion_depth=0)


def test_roofline_presets_differ_per_target():
    from tvm_fusion.targets import parse_target

    cpu, gpu = Roofline.for_target(parse_target("llvm")), Roofline.for_target(parse_target("cuda"))
    assert gpu.bandwidth_gbps > 10 * cpu.bandwidth_gbps
    assert gpu.launch_overhead_us > cpu.launch_overhead_us


def test_consumer_with_two_fusable_producers_joins_one_chain():
    g = models.GraphBuilder("two_producers")
    a, b = g.input("a", (1, 64)), g.input("b", (1, 64))
    model = g.finish([g.add(g.relu(a), g.op("Sigmoid", [b]))])
    mod = imported(model)
    (report,) = plan_module(mod, None, "llvm")
    assert sorted(len(gr.nodes) for gr in report.groups) == [1, 2]
    assert sum("larger benefit" in d.reason for d in report.decisions) == 1
    feeds = models.random_inputs(model)
    assert max_abs_err(run_relax(LOWER(ApplyFusionPolicy()(mod)), feeds), ort_run(model, feeds)) < 1e-6


def test_a_var_to_var_binding_does_not_end_a_chain():
    """``b = a`` between two ops (left by a user's own pass, or reaching the planner with
    ``fold_batch_norm=False``, which skips the pipeline's only ``CanonicalizeBindings``): the
    pass, ``plan_module`` and ``explain`` see through it."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 64), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            alias = bb.emit(bb.emit(relax.op.nn.relu(x)))
            out = bb.emit_output(relax.op.sigmoid(alias))
        bb.emit_func_output(out)
    mod = bb.get()
    assert any(isinstance(b.value, relax.Var) for b in mod["main"].body.blocks[0].bindings)
    fused = ApplyFusionPolicy(target="llvm")(mod)
    assert primitive_functions(fused) == ["fused_relu_sigmoid"]
    assert group_sizes(mod) == [2]
    assert "group fused_relu_sigmoid" in explain(mod, target="llvm")
    data = np.random.default_rng(0).standard_normal((1, 64)).astype("float32")
    ours = run_relax(LOWER(fused), {"x": data})
    np.testing.assert_allclose(ours, 1 / (1 + np.exp(-np.maximum(data, 0))), rtol=1e-6, atol=1e-6)


def _dense_layer_model():
    """DenseNet's layer input: the features so far concatenated, then the pre-activation BN + ReLU
    (a per-channel Mul / Add after BN folding) in front of the bottleneck 1x1 conv."""
    g = models.GraphBuilder("dense_layer")
    pieces = [g.input(f"f{i}", (1, c, 9, 9)) for i, c in enumerate((16, 8, 8))]
    h = g.op("Concat", pieces, axis=1)
    h = g.op("Mul", [h, g.const("scale", np.linspace(0.5, 1.5, 32, dtype=np.float32).reshape(32, 1, 1))])
    h = g.op("Add", [h, g.const("shift", np.linspace(-0.3, 0.3, 32, dtype=np.float32).reshape(32, 1, 1))])
    return g.finish([g.conv(g.relu(h), 32, 16, k=1)])


def _channel_shuffle_model():
    """ShuffleNet's block end: the two branches concatenated, then the channel shuffle
    (reshape to [N, groups, C/groups, H, W], swap the two channel axes, reshape back)."""
    g = models.GraphBuilder("channel_shuffle")
    a, b = g.input("a", (1, 8, 7, 7)), g.input("b", (1, 8, 7, 7))
    h = g.op("Concat", [a, g.relu(g.conv(b, 8, 8, k=1))], axis=1)
    h = g.op("Reshape", [h, g.const("split", np.array([1, 2, 8, 7, 7], np.int64))])
    h = g.op("Transpose", [h], perm=[0, 2, 1, 3, 4])
    h = g.op("Reshape", [h, g.const("merge", np.array([1, 16, 7, 7], np.int64))])
    return g.finish([g.conv(h, 16, 8, k=1)])


def _rotary_model():
    """A rotary embedding: ``x * cos + concat(-x2, x1) * sin`` of the two halves of the last axis.
    The negate fuses into the concat (the producer side) and the multiply after it."""
    g = models.GraphBuilder("rotary")
    x = g.input("x", (1, 4, 8, 16))
    starts, mids, ends = (g.const(n, np.array([v], np.int64)) for n, v in (("s", 0), ("m", 8), ("e", 16)))
    axis = g.const("axis", np.array([3], np.int64))
    x1, x2 = g.op("Slice", [x, starts, mids, axis]), g.op("Slice", [x, mids, ends, axis])
    rotated = g.op("Concat", [g.op("Neg", [x2]), x1], axis=3)
    cos = g.const("cos", np.cos(np.linspace(0, 3, 16, dtype=np.float32)))
    sin = g.const("sin", np.sin(np.linspace(0, 3, 16, dtype=np.float32)))
    return g.finish([g.add(g.op("Mul", [x, cos]), g.op("Mul", [rotated, sin]))])


# the kernel the concat joins: named after its ops (a layout_transform may come first where
# RewriteLayout blocks a conv's channels, so the names are matched inside, not as a prefix)
CONCAT_KERNELS = [
    (_dense_layer_model, "concat_multiply_add_relu"),
    (_channel_shuffle_model, "concat_reshape"),
    (_rotary_model, "negative_concat_multiply"),
]


@pytest.mark.parametrize("make,kernel", CONCAT_KERNELS)
def test_concat_fuses_with_its_neighbours(make, kernel, cpu_target):
    """A concat is fused like an injective op: its consumer chain reads the pieces directly
    instead of a materialised concatenation (DenseNet 245 -> 188 kernels per inference,
    ShuffleNet 0.83-0.88x the time, docs/performance.md), and an elementwise producer of a piece
    is computed inside it. Without the ``concat`` class (``FusionPolicy.without``) the
    concatenation stays a kernel of its own."""
    model = make()
    feeds = models.random_inputs(model)
    with cpu_target:
        lowered = pipeline(cpu_target)(import_onnx(model).mod)
        baseline = pipeline(cpu_target, FusionPolicy().without("concat"))(import_onnx(model).mod)
    names = kernel_calls(lowered)
    assert any(kernel in n for n in names), names
    assert not any(n.startswith("concat") for n in names), names
    assert any(n.startswith("concat") for n in kernel_calls(baseline))
    assert max_abs_err(run_relax(lowered, feeds, cpu_target), ort_run(model, feeds)) < 1e-5


def test_without_removes_a_class_from_every_table():
    policy = FusionPolicy().without("concat")
    assert "concat" not in policy.op_classes and policy.op_class("concat") is None
    assert all("concat" not in cs for cs in policy.vertical.values()) and "concat" not in policy.vertical
    with pytest.raises(TvmFusionError, match="no op class 'nope'"):
        policy.without("nope")


def test_a_concat_after_a_reduction_stays_apart():
    """The reduction schedules place consumers inside the reduction's loops, which a concat
    covering more than the reduction's output does not fit: ``reduce -> concat`` is not in the
    table."""
    g = models.GraphBuilder("pooled_concat")
    x = g.input("input", (1, 8, 5, 5))
    pooled = g.op("ReduceMean", [x], axes=[2, 3], keepdims=1)
    model = g.finish([g.relu(g.op("Concat", [pooled, g.input("other", (1, 8, 1, 1))], axis=1))])
    (report,) = plan_module(imported(model), None, "llvm")
    groups = [[n.op_name for n in grp.nodes] for grp in report.groups]
    assert ["mean"] in groups and ["concat", "nn.relu"] in groups, groups


def test_fused_concat_kernels_build_for_cuda(tmp_path):
    """The same groups on CUDA compile and export (no GPU needed; numerics run in test_cuda on a GPU)."""
    from tvm_fusion import build

    result = build(
        _dense_layer_model(), {"kind": "cuda", "arch": "sm_80"}, name="dense_layer", tuning_logs=None
    )
    assert any("concat_multiply_add_relu" in n for n in kernel_calls(result.lowered))
    assert result.export(tmp_path / "dense_layer.cuda.so").stat().st_size > 10_000

"""FuseAttention + the fused attention kernels: exporter spellings fused and exact against ONNX
Runtime (masks, causal, fully masked rows, odd lengths), no score-sized buffer after the
pipeline, one kernel per block, blocks that must not match, explain(), the policy switch, CUDA."""

import json
import math

import numpy as np
import pytest
import tvm
from conftest import ort_run, run_relax
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

import tvm_fusion
from tvm_fusion import FusionPolicy, models
from tvm_fusion.errors import TvmFusionError
from tvm_fusion.frontend import import_onnx
from tvm_fusion.ir import tir_stmts
from tvm_fusion.passes import FuseAttention, attention_decisions, explain
from tvm_fusion.pipeline import pipeline_passes
from tvm_fusion.report import kernel_calls, largest_intermediate, tir_buffers
from tvm_fusion.schedules._util import vector_lanes
from tvm_fusion.schedules.attention import (
    AttentionSpec,
    cpu_attention_kernel,
    cpu_tiles,
    cuda_attention_kernel,
    pv_vector_width,
    tile_work,
)
from tvm_fusion.schedules.attention_inputs import ColumnView, PackedInputs
from tvm_fusion.targets import llvm_target

SEQ = 77  # odd, and no other dim of the test models equals it
LOW = float(np.finfo(np.float32).min)


def rel_err(got, ref) -> float:
    finite = np.isfinite(ref)
    return float(np.abs(got[finite] - ref[finite]).max() / np.abs(ref[finite]).max())


def padded_feeds(model, seq):
    """Random inputs with batch row 0 right-padded and batch row 1 fully padded."""
    feeds = models.random_inputs(model)
    if "attention_mask" in feeds:
        mask = np.ones(feeds["attention_mask"].shape, np.int64)
        mask[0, seq * 2 // 3 :] = 0
        mask[1, :] = 0
        feeds["attention_mask"] = mask
    return feeds


def build_and_run(model, feeds, policy=None):
    result = tvm_fusion.build(model, "llvm", policy, tuning_logs=None)
    vm = relax.VirtualMachine(result.executable, tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(v) for v in feeds.values()])
    return result, out.numpy()


def score_sized_buffers(mod: tvm.IRModule, seq: int) -> list[str]:
    """Every buffer (PrimFunc parameter or allocation) and every Relax tensor in ``mod`` with two
    axes of extent ``seq``: a per-head S x S score tensor, wherever it would live."""
    found = []

    def check(name, shape):
        dims = [int(d) for d in shape if isinstance(d, (int, tvm.tirx.IntImm))]
        if dims.count(seq) >= 2:
            found.append(f"{name}{tuple(dims)}")

    for gvar, func in mod.functions.items():
        if isinstance(func, tvm.tirx.PrimFunc):
            for name, shape, _dtype, _scope in tir_buffers(func):
                check(f"{gvar.name_hint}:{name}", shape)
        elif isinstance(func, relax.Function):
            for var in relax.analysis.get_var2val(func):
                ty = var.ty
                if isinstance(ty, relax.TensorType) and isinstance(ty.shape, relax.ShapeExpr):
                    check(f"{gvar.name_hint}:{var.name}", ty.shape.values)
    return found


# -- numerics against ONNX Runtime, per exporter spelling ------------------------------------------
@pytest.mark.parametrize("spelling", models.ATTENTION_SPELLINGS)
def test_spelling_fused_and_matches_ort(spelling):
    model = models.attention_layer(spelling, batch=2, seq=SEQ, hidden=64, heads=4)
    feeds = padded_feeds(model, SEQ)
    result, got = build_and_run(model, feeds)
    ref = ort_run(model, feeds)
    assert rel_err(got, ref) <= 1e-4
    assert np.array_equal(np.isnan(got), np.isnan(ref))
    calls = kernel_calls(result.lowered)
    assert calls.count(next(c for c in calls if c.startswith("flash_attention"))) == 1
    assert not any("softmax" in c for c in calls)


def test_vit_sequence_197():
    model = models.attention_layer("vit", seq=197, hidden=64, heads=2)
    feeds = models.random_inputs(model)
    _, got = build_and_run(model, feeds)
    assert rel_err(got, ort_run(model, feeds)) <= 1e-4


def _attention_graph(batch, heads, seq, d, mask_shape=None):
    """q, k, v (B, N, S, d) [+ a float additive mask] -> MatMul, Div, Add, Softmax, MatMul."""
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [batch, heads, seq, d]) for n in "qkv"]
    nodes = [
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q", "kt"], ["s"]),
        helper.make_node("Div", ["s", "sqrt_d"], ["s1"]),
    ]
    inits = [numpy_helper.from_array(np.array(math.sqrt(d), np.float32), "sqrt_d")]
    scores = "s1"
    if mask_shape is not None:
        inputs.append(helper.make_tensor_value_info("mask", TensorProto.FLOAT, list(mask_shape)))
        nodes.append(helper.make_node("Add", ["s1", "mask"], ["s2"]))
        scores = "s2"
    nodes += [
        helper.make_node("Softmax", [scores], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "v"], ["o"]),
    ]
    out = helper.make_tensor_value_info("o", TensorProto.FLOAT, [batch, heads, seq, d])
    graph = helper.make_graph(nodes, "attention", inputs, [out], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("fill", [LOW, -np.inf], ids=["finfo_min", "minus_inf"])
def test_fully_masked_rows_as_ort(fill):
    """finfo.min on every key: equal scores, uniform weights (the mean of V); -inf: NaN rows."""
    model = _attention_graph(2, 2, SEQ, 16, mask_shape=(2, 1, 1, SEQ))
    rng = np.random.default_rng(0)
    feeds = {n: rng.standard_normal((2, 2, SEQ, 16)).astype(np.float32) for n in "qkv"}
    mask = np.zeros((2, 1, 1, SEQ), np.float32)
    mask[0, ..., 40:] = fill
    mask[1] = fill
    feeds["mask"] = mask
    result, got = build_and_run(model, feeds)
    ref = ort_run(model, feeds)
    assert any(c.startswith("flash_attention") for c in kernel_calls(result.lowered))
    assert np.array_equal(np.isnan(got), np.isnan(ref))
    if fill == -np.inf:
        assert np.isnan(ref[1]).all()
    else:
        np.testing.assert_allclose(
            ref[1], np.broadcast_to(feeds["v"][1].mean(1, keepdims=True), ref[1].shape), atol=1e-5
        )
    assert rel_err(got, ref) <= 1e-4


def test_gpt2_left_padding_fully_masked_rows():
    """Causal + padding: padded query rows whose kept keys are all masked follow ORT exactly."""
    model = models.attention_layer("gpt2", batch=2, seq=SEQ, hidden=64, heads=4)
    feeds = models.random_inputs(model)
    mask = np.ones((2, SEQ), np.int64)
    mask[0, :30] = 0  # left padding: rows 0..29 see only padded keys
    feeds["attention_mask"] = mask
    _, got = build_and_run(model, feeds)
    assert rel_err(got, ort_run(model, feeds)) <= 1e-4


# -- structure ------------------------------------------------------------------------------------
@pytest.mark.parametrize("spelling", ["torchscript", "gpt2_dynamo"])
def test_no_score_sized_buffer_after_pipeline(spelling):
    model = models.attention_layer(spelling, seq=SEQ, hidden=64, heads=4)
    mod = import_onnx(model).mod
    fused = tvm_fusion.optimize(mod, "llvm")
    unfused = tvm_fusion.optimize(mod, "llvm", {"attention": False})
    assert score_sized_buffers(unfused, SEQ)  # the check sees the unfused scores ...
    assert score_sized_buffers(fused, SEQ) == []  # ... and the fused pipeline has none
    assert largest_intermediate(fused)[1] < largest_intermediate(unfused)[1]
    assert sum(c.startswith("flash_attention") for c in kernel_calls(fused)) == 1


def test_pass_alone_without_attention_changes_nothing():
    mod = relax.transform.FoldConstant()(import_onnx(models.resnet_block_net()).mod)
    tvm.ir.assert_structural_equal(FuseAttention()(mod), mod)
    mod = relax.transform.FoldConstant()(import_onnx(models.mlp_bn()).mod)
    tvm.ir.assert_structural_equal(FuseAttention()(mod), mod)


def test_pass_alone_gives_one_function_that_compiles_anywhere():
    """Without LowerAttention, plain tvm.compile runs the reference body (LegalizeOps + FuseTIR)."""
    model = models.attention_layer("dynamo", batch=2, seq=SEQ, hidden=64, heads=4)
    feeds = padded_feeds(model, SEQ)
    mod = FuseAttention()(relax.transform.FoldConstant()(import_onnx(model).mod))
    fused = [gv for gv, f in mod.functions.items() if gv.name_hint.startswith("fused_attention")]
    assert len(fused) == 1 and int(mod.attrs["tvm_fusion.fuse_attention"]) == 1
    assert rel_err(run_relax(mod, feeds), ort_run(model, feeds)) <= 1e-4


def test_softmax_over_another_axis_is_left_alone_and_explained():
    model = models.attention_layer("torchscript", seq=SEQ, hidden=64, heads=4, softmax_axis=2)
    mod = relax.transform.FoldConstant()(import_onnx(model).mod)
    fuse = FuseAttention()
    tvm.ir.assert_structural_equal(fuse(mod), mod)
    (decision,) = fuse.decisions
    assert not decision.fused and "softmax over axis 2" in decision.reason
    assert "not fused (softmax over axis 2, not the key axis 3)" in explain(mod, None, "llvm")
    feeds = models.random_inputs(model)
    _, got = build_and_run(model, feeds)
    assert rel_err(got, ort_run(model, feeds)) <= 1e-4


def test_probabilities_used_elsewhere_are_not_fused():
    """An attention block whose probabilities are also an output (output_attentions) stays."""
    model = _attention_graph(1, 2, SEQ, 16)
    model.graph.output.append(helper.make_tensor_value_info("p", TensorProto.FLOAT, [1, 2, SEQ, SEQ]))
    mod = relax.transform.FoldConstant()(import_onnx(model).mod)
    (decision,) = attention_decisions(mod)
    assert not decision.fused and "other consumers" in decision.reason


def test_explain_reports_each_block_and_the_policy_switch():
    model = models.attention_layer("gpt2", seq=SEQ, hidden=64, heads=4)
    mod = relax.transform.FoldConstant()(import_onnx(model).mod)
    text = explain(mod, None, "llvm")
    assert "attention" in text and ": fused (" in text and "causal (offset 0" in text
    off = explain(mod, {"attention": False}, "llvm")
    assert "not fused (the fusion policy's attention switch is off)" in off


def test_policy_switch_validated_and_round_trips(tmp_path):
    policy = FusionPolicy(attention=False)
    assert FusionPolicy.from_dict(policy.to_dict()) == policy
    path = tmp_path / "policy.json"
    path.write_text(json.dumps(policy.to_dict()))
    assert FusionPolicy.from_json(path).attention is False
    with pytest.raises(TvmFusionError, match="key 'attention' must be true or false, got string"):
        FusionPolicy.from_dict({"attention": "yes"})
    names = [p.info.name for p in pipeline_passes("llvm", policy)]
    assert "FuseAttention" not in names and "FuseAttention" in [p.info.name for p in pipeline_passes("llvm")]


def test_qkv_horizontal_fusion_feeds_fused_attention():
    model = models.attention_layer("torchscript", batch=2, seq=SEQ, hidden=64, heads=4)
    feeds = padded_feeds(model, SEQ)
    mod = import_onnx(model).mod
    target = llvm_target()
    with target:
        for p in pipeline_passes(target):
            if p.info.name == "ApplyFusionPolicy":
                break
            mod = p(mod)
    assert int(mod.attrs["tvm_fusion.horizontal_fuse"]["matmul"]) == 1  # Q/K/V: one GEMM
    assert int(mod.attrs["tvm_fusion.fuse_attention"]) == 1
    result, got = build_and_run(model, feeds)
    assert rel_err(got, ort_run(model, feeds)) <= 1e-4


@pytest.mark.parametrize("spelling", ["torchscript", "dynamo", "gpt2", "gpt2_dynamo"])
def test_attention_reads_q_k_v_from_the_packed_projection(spelling):
    """No kernel copies Q, K and V out of their packed projection (horizontal fusion's split,
    GPT-2's Split): the attention kernel reads its columns. (The "vit" spelling takes them from
    a transposed view, which is not traced.)"""
    batch = 2
    model = models.attention_layer(spelling, batch=batch, seq=SEQ, hidden=64, heads=4)
    feeds = padded_feeds(model, SEQ)
    result, got = build_and_run(model, feeds)
    assert rel_err(got, ort_run(model, feeds)) <= 1e-4
    assert not [c for c in kernel_calls(result.lowered) if "split" in c or "slice" in c]
    kernel = next(
        f for gv, f in result.lowered.functions.items() if gv.name_hint.startswith("flash_attention")
    )
    qkv = kernel.params[:3]  # buffers
    assert [[int(d) for d in b.shape] for b in qkv] == [[batch, SEQ, 3 * 64]] * 3


@pytest.mark.parametrize("causal", [None, "TopLeft"])
def test_relax_attention_op_gets_the_fused_kernel(causal):
    batch, seq, heads, d = 2, SEQ, 3, 16
    bb = relax.BlockBuilder()
    params = [relax.Var(n, relax.TensorType((batch, seq, heads, d), "float32")) for n in "qkv"]
    bias = relax.Var("bias", relax.TensorType((batch, 1, 1, seq), "float32"))
    with bb.function("main", [*params, bias]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.nn.attention(*params, bias, causal_mask=causal))
        bb.emit_func_output(out)
    mod = bb.get()
    rng = np.random.default_rng(0)
    feeds = [rng.standard_normal((batch, seq, heads, d)).astype(np.float32) for _ in range(3)]
    feeds.append(np.where(rng.random((batch, 1, 1, seq)) < 0.3, LOW, 0).astype(np.float32))
    stock = run_relax(mod, feeds)  # TVM's own legalization
    lowered = tvm_fusion.optimize(mod, "llvm")
    assert [c for c in kernel_calls(lowered) if c.startswith("flash_attention")]
    assert score_sized_buffers(lowered, seq) == []
    assert rel_err(run_relax(lowered, feeds), stock) <= 1e-4
    assert any(d.fused and "one op already" in d.reason for d in attention_decisions(mod))


def test_attention_reads_slices_of_a_sequence_first_projection():
    """torchvision's ViT: Q, K, V are last-axis slices of a (S, 1, 3E) in_proj output, reshaped
    to (1, S, N, D); the kernel reads the (S, 1, 3E) tensor itself."""
    seq, heads, d = SEQ, 4, 16
    width = heads * d
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((seq, 1, 3 * width), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            qkv = [
                bb.emit(
                    relax.op.reshape(
                        relax.op.strided_slice(x, [2], [i * width], [(i + 1) * width]), (1, seq, heads, d)
                    )
                )  # fmt: skip
                for i in range(3)
            ]
            out = bb.emit_output(relax.op.nn.attention(*qkv))
        bb.emit_func_output(out)
    mod = bb.get()
    feeds = [np.random.default_rng(1).standard_normal((seq, 1, 3 * width)).astype(np.float32)]
    lowered = tvm_fusion.optimize(mod, "llvm")
    assert not [c for c in kernel_calls(lowered) if "slice" in c]
    kernel = next(f for gv, f in lowered.functions.items() if gv.name_hint.startswith("flash_attention"))
    assert [[int(x) for x in b.shape] for b in kernel.params[:3]] == [[seq, 1, 3 * width]] * 3
    assert rel_err(run_relax(lowered, feeds), run_relax(mod, feeds)) <= 1e-4


def test_packed_input_columns_of_uneven_splits_and_negative_slices():
    """The columns come from the cut's own output: an even split of 11 columns into 4 is
    3, 3, 3, 2 wide (TVM rounds up); a slice may count from the end on axis -1."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 7, 11), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            parts = bb.emit(relax.op.split(x, 4, axis=-1))
            last = bb.emit(relax.op.reshape(bb.emit(relax.TupleGetItem(parts, 3)), (1, 7, 1, 2)))
            tail = bb.emit(relax.op.reshape(relax.op.strided_slice(x, [-1], [-4], [11]), (1, 7, 2, 2)))
            bb.emit_output(relax.Tuple([last, tail]))
        bb.emit_func_output(relax.Tuple([last, tail]))
    mod = bb.get()
    inputs = PackedInputs(mod, mod["main"].body.blocks[0])
    assert inputs.column_view(last, (1, 7, 1, 2)) == (x, ColumnView((1, 7, 11), 9))
    assert inputs.column_view(tail, (1, 7, 2, 2)) == (x, ColumnView((1, 7, 11), 7))
    assert inputs.column_view(tail, (1, 7, 1, 4)) == (x, ColumnView((1, 7, 11), 7))
    assert inputs.column_view(x, (1, 7, 1, 11)) is None  # no cut: nothing to save


def test_packed_input_through_a_transpose_and_back():
    """GPT-2's TorchScript export moves K to (B, N, S, D), appends an empty past (a one-input
    concat) and moves it back: still columns of the projection; a transpose not undone is not."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 7, 12), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            k = bb.emit(relax.op.reshape(relax.op.strided_slice(x, [2], [4], [8]), (1, 7, 2, 2)))
            heads_first = bb.emit(relax.op.permute_dims(k, [0, 2, 1, 3]))
            past = bb.emit(relax.op.concat([heads_first], axis=-2))
            back = bb.emit(relax.op.permute_dims(past, [0, 2, 1, 3]))
            swapped = bb.emit(relax.op.permute_dims(past, [0, 2, 3, 1]))
            bb.emit_output(relax.Tuple([back, swapped]))
        bb.emit_func_output(relax.Tuple([back, swapped]))
    mod = bb.get()
    inputs = PackedInputs(mod, mod["main"].body.blocks[0])
    assert inputs.column_view(back, (1, 7, 2, 2)) == (x, ColumnView((1, 7, 12), 4))
    assert inputs.column_view(swapped, (1, 7, 2, 2)) is None


def test_packed_input_through_a_fused_view_function():
    """A view function the fusion policy made (reshape, transpose and back, as GPT-2's K) is
    followed into its caller: its parameter is the caller's cut of the projection."""
    bb = relax.BlockBuilder()
    p = relax.Var("p", relax.TensorType((1, 7, 4), "float32"))
    with bb.function("view", [p], attrs={"Primitive": True}, private=True):
        with bb.dataflow():
            heads_first = bb.emit(relax.op.permute_dims(relax.op.reshape(p, (1, 7, 2, 2)), [0, 2, 1, 3]))
            out = bb.emit_output(relax.op.permute_dims(heads_first, [0, 2, 1, 3]))
        bb.emit_func_output(out)
    view = bb.get().get_global_var("view")
    x = relax.Var("x", relax.TensorType((1, 7, 12), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            parts = bb.emit(relax.op.split(x, 3, axis=2))
            k = bb.emit(relax.Call(view, [bb.emit(relax.TupleGetItem(parts, 1))]))
            bb.emit_output(k)
        bb.emit_func_output(k)
    mod = bb.get()
    inputs = PackedInputs(mod, mod["main"].body.blocks[0])
    assert inputs.column_view(k, (1, 7, 2, 2)) == (x, ColumnView((1, 7, 12), 4))


# -- the kernels ----------------------------------------------------------------------------------
def _reference(q, k, v, biases, spec: AttentionSpec):
    qh, kh, vh = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    np.seterr(over="ignore", invalid="ignore")  # finfo.min + finfo.min = -inf, as in ORT
    scores = (qh @ kh.transpose(0, 1, 3, 2)) * np.float32(spec.scale)
    before = spec.biases_before_causal if spec.causal_offset is not None else len(biases)
    for b in biases[:before]:
        scores = scores + b
    if spec.causal_offset is not None:
        keep = np.arange(spec.seq_kv)[None, :] <= np.arange(spec.seq_q)[:, None] + spec.causal_offset
        scores = np.where(keep, scores, np.float32(spec.causal_fill))
    for b in biases[before:]:
        scores = scores + b
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs = probs / probs.sum(-1, keepdims=True)
    if spec.nan_to_zero:
        probs = np.where(np.isnan(probs), 0, probs)
    return (probs @ vh).transpose(0, 2, 1, 3)


KERNEL_SPECS = [
    AttentionSpec(1, 2, 64, 64, 64, 64, 0.125),
    AttentionSpec(2, 2, SEQ, SEQ, 16, 16, 0.25, causal_offset=0),
    AttentionSpec(1, 2, 50, 130, 40, 24, 0.2, causal_offset=80),
    AttentionSpec(4, 2, 64, 64, 36, 36, 1 / 6),  # MobileViT's head dim
    AttentionSpec(2, 2, SEQ, SEQ, 32, 32, 0.2, ((2, 1, 1, SEQ), (1, 2, SEQ, SEQ)), nan_to_zero=True),
    AttentionSpec(2, 2, 130, 130, 16, 16, 0.25, ((2, 1, 1, 130),), 0, LOW, biases_before_causal=0),
    AttentionSpec(2, 2, 130, 130, 16, 16, 0.25, ((2, 1, 1, 130),), 0, LOW, biases_before_causal=1),
]


def _run_kernel(func, spec, target, seed=0):
    rng = np.random.default_rng(seed)
    b, n, sq, skv, d, dv = spec.batch, spec.heads, spec.seq_q, spec.seq_kv, spec.head_dim, spec.head_dim_v
    q = rng.standard_normal((b, sq, n, d)).astype(np.float32)
    k = rng.standard_normal((b, skv, n, d)).astype(np.float32)
    v = rng.standard_normal((b, skv, n, dv)).astype(np.float32)
    biases = []
    for shape in spec.bias_shapes:
        bias = rng.standard_normal(shape).astype(np.float32)
        if shape[2] == 1:  # a padding mask: some keys masked, the last batch row entirely
            fill = -np.inf if spec.nan_to_zero else LOW  # -inf rows are NaN, then 0 behind the guard
            bias = np.where(rng.random(shape) < 0.3, fill, 0).astype(np.float32)
            bias[-1] = fill
        biases.append(bias)
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=target)
    out = tvm.runtime.tensor(np.zeros((b, sq, n, dv), np.float32))
    lib["main"](*[tvm.runtime.tensor(x) for x in [q, k, v, *biases]], out)
    return out.numpy(), _reference(q, k, v, biases, spec)


@pytest.mark.parametrize("spec", KERNEL_SPECS, ids=[f"spec{i}" for i in range(len(KERNEL_SPECS))])
@pytest.mark.parametrize("kernel", ["cpu", "cpu_avx2", "cuda_emulated"])
def test_kernel_matches_reference(spec, kernel):
    """The CPU kernel with this machine's tiles and with AVX2's (8 lanes, 16 registers; runs on
    any x86 CI machine), and the CUDA kernel with its threads as serial loops."""
    target = llvm_target("znver3" if kernel == "cpu_avx2" else None)
    if kernel == "cuda_emulated":
        func = cuda_attention_kernel(spec, emulate=True)
    else:
        func = cpu_attention_kernel(spec, target)
    got, ref = _run_kernel(func, spec, target)
    assert np.array_equal(np.isnan(got), np.isnan(ref))
    assert rel_err(got, ref) <= 1e-4


@pytest.mark.parametrize("mcpu", ["znver3", "skylake-avx512", None])
def test_cpu_tiles_fit_the_target(mcpu):
    target = llvm_target(mcpu) if mcpu else llvm_target()
    spec = AttentionSpec(1, 12, 512, 512, 64, 64, 0.125)
    tiles = cpu_tiles(spec, target)
    assert tiles.q_tile % tiles.qk_cols == 0 and tiles.q_tile % tiles.pv_rows == 0
    assert tiles.kv_tile % tiles.qk_rows == 0 and tiles.qk_cols % tiles.lanes == 0
    assert spec.head_dim_v % tiles.pv_cols == 0


def test_cpu_kernel_repacks_a_per_query_bias_in_parallel():
    """A bias that varies over queries (T5's relative position bias, 8 x 128 x 128) is repacked
    to [key, query] in each call, one task per head and key tile; packed serially it was about a
    third of T5's attention kernel (alone 0.29 -> 0.24 ms with the tasks on two cores)."""
    spec = AttentionSpec(1, 8, 128, 128, 64, 64, 1.0, ((1, 8, 128, 128), (1, 1, 1, 128)))
    target = llvm_target()
    func = cpu_attention_kernel(spec, target)
    sch = tvm.s_tir.Schedule(func)
    loop = sch.get(sch.get_loops(sch.get_sblock("pack_bias0"))[0])
    key_tiles = -(-128 // cpu_tiles(spec, target).kv_tile)
    assert loop.kind == tvm.tirx.ForKind.PARALLEL and loop.extent == 8 * key_tiles


@pytest.mark.parametrize("head_dim", [20, 24, 36, 40, 72])
def test_cpu_kernel_vectors_fit_one_register_for_any_head_dim(head_dim):
    """A head dim no multiple of the SIMD width made one vector of the whole tile width per P.V
    accumulator row (<36 x float>), which LLVM compiled 6-8x slower (MobileViT: 7.9 -> 0.99 ms)."""
    target = llvm_target("skylake-avx512")
    spec = AttentionSpec(4, 4, 256, 256, head_dim, head_dim, head_dim**-0.5)
    func = cpu_attention_kernel(spec, target)

    def stores_accumulator(loop):
        return any(
            isinstance(node, tvm.tirx.BufferStore) and node.buffer.name == "o_reg" for node in tir_stmts(loop)
        )

    widths = [
        int(node.extent)
        for node in tir_stmts(func)
        if isinstance(node, tvm.tirx.For)
        and node.kind == tvm.tirx.ForKind.VECTORIZED
        and stores_accumulator(node)
    ]
    assert widths and max(widths) <= vector_lanes(target)
    for mcpu in ("skylake-avx512", "znver3"):  # and the accumulator rows fit the registers
        tiles = cpu_tiles(spec, llvm_target(mcpu))
        registers = 32 if mcpu == "skylake-avx512" else 16
        assert tiles.pv_rows * (tiles.pv_cols // pv_vector_width(tiles.pv_cols, tiles.lanes)) <= registers


@pytest.mark.parametrize("mcpu", ["znver3", "skylake-avx512"])
@pytest.mark.parametrize("seq, causal, bound", [(197, False, 1.2), (128, True, 0.85), (77, False, 1.2)])
def test_cpu_tiles_waste_little_work(mcpu, seq, causal, bound):
    """The kernel computes whole tiles: ViT's 197 tokens in 48 x 64 tiles computed 1.58x the
    scores (now 1.12x), and a causal 128-token GPT-2 head computed more than the full square."""
    spec = AttentionSpec(1, 12, seq, seq, 64, 64, 0.125, causal_offset=0 if causal else None)
    tiles = cpu_tiles(spec, llvm_target(mcpu, num_cores=2))
    assert tile_work(spec, tiles.q_tile, tiles.kv_tile) <= bound * seq * seq


def test_cuda_attention_builds_and_exports(tmp_path):
    model = models.attention_layer("gpt2_dynamo", seq=SEQ, hidden=64, heads=4)
    result = tvm_fusion.build(model, {"kind": "cuda", "arch": "sm_80"}, tuning_logs=None)
    assert sum(c.startswith("flash_attention") for c in kernel_calls(result.lowered)) == 1
    path = result.export(tmp_path / "attention.cuda.so")
    assert path.stat().st_size > 10_000
    source = _cuda_source(result.executable.mod)
    assert "flash_attention" in source and "__shared__" in source


def _cuda_source(mod):
    if mod.kind == "cuda":
        return mod.inspect_source()
    return "".join(_cuda_source(sub) for sub in mod.imports)


def test_spec_round_trips():
    spec = KERNEL_SPECS[-1]
    assert AttentionSpec.from_json(spec.to_json()) == spec
    with pytest.raises(ValueError):
        AttentionSpec(1, 2, 8, 8, 4, 4, 1.0, ((1, 3, 1, 8),))

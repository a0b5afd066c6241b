"""Property-based tests: every tvm_fusion pass, and the whole pipeline, on random ONNX graphs.

Graphs come from ``strategies.random_models`` (tiny random DAGs over the supported op set; a
failing example prints as a runnable script). Properties:

1. ``tvm_fusion.build`` == unoptimised ``tvm.compile(from_onnx(model))`` == onnxruntime.
2. Each pass alone keeps the numerics of the module it was given, leaves it well formed
   (``relax.analysis.check_well_formed``) and does not mutate its input module.
3. Structural invariants: no ``nn.batch_norm`` after FoldBatchNorm + FoldConstant (all BN params
   are constants here); after the pipeline every launched kernel is a PrimFunc and no high-level
   op or Primitive Relax function is left; layout transforms <= model inputs + outputs.

CI runs a small derandomized subset; ``pytest -m nightly`` runs >= 200 random examples per
property (``TVM_FUSION_NIGHTLY_EXAMPLES`` overrides the count). No example database is written.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import tvm
import tvm_ffi
from conftest import ort_outputs, run_outputs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import GraphSpec, random_models
from tvm import relax
from tvm.relax.frontend.onnx import from_onnx

import tvm_fusion
from tvm_fusion.report import count_layout_transforms
from tvm_fusion.targets import parse_target

TARGET = parse_target("llvm")

_COMMON = dict(
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
CI = settings(max_examples=10, derandomize=True, **_COMMON)
CI_SMALL = settings(max_examples=6, derandomize=True, **_COMMON)  # per-pass: 5 parametrized copies
NIGHTLY = settings(
    max_examples=int(os.environ.get("TVM_FUSION_NIGHTLY_EXAMPLES", "200")), derandomize=False, **_COMMON
)

# Conv graphs, token/feature graphs and mixed ones, so a 6-10 example CI run sees all three.
GRAPHS = st.one_of(random_models(focus="conv"), random_models(focus="dense"), random_models())
CONV_GRAPHS = st.one_of(random_models(focus="conv"), random_models())


# -- helpers -------------------------------------------------------------------------------------
def imported(spec: GraphSpec) -> tvm.IRModule:
    return from_onnx(spec.model, keep_params_in_input=False)


def run_vm(mod_or_executable, spec: GraphSpec, feeds: dict) -> list[np.ndarray]:
    return run_outputs(mod_or_executable, [feeds[name] for name, _ in spec.inputs], TARGET)


def assert_close(actual, expected, spec: GraphSpec, what: str) -> None:
    """fp32 comparison: rtol 1e-4; atol 1e-4 scaled by output magnitude and graph depth."""
    assert len(actual) == len(expected), f"{what}: {len(actual)} outputs, expected {len(expected)}"
    for i, (a, e) in enumerate(zip(actual, expected)):
        a, e = np.asarray(a), np.asarray(e)
        assert a.shape == e.shape, f"{what}: output {i} shape {a.shape}, expected {e.shape}"
        scale = max(1.0, float(np.max(np.abs(e))) if e.size else 1.0)
        atol = 1e-4 * scale * (1.0 + spec.depth / 8.0)
        np.testing.assert_allclose(a, e, rtol=1e-4, atol=atol, err_msg=f"{what}: output {i} ({spec.ops})")


def well_formed(mod: tvm.IRModule) -> bool:
    # relax.analysis.well_formed raises (returns None) in TVM 0.27; check_well_formed is the bool.
    return bool(relax.analysis.check_well_formed(mod))


def relax_calls(mod: tvm.IRModule, include_primitive: bool = True) -> list[relax.Call]:
    found = []
    for func in mod.functions.values():
        if not isinstance(func, relax.Function):
            continue
        if not include_primitive and func.attrs is not None and "Primitive" in func.attrs.keys():
            continue
        relax.analysis.post_order_visit(
            func, lambda e: found.append(e) if isinstance(e, relax.Call) else None
        )
    return found


def op_names(mod: tvm.IRModule) -> list[str]:
    return [c.op.name for c in relax_calls(mod) if isinstance(c.op, tvm.ir.Op)]


# Relax ops that may stay in a lowered main: VM plumbing, not kernels.
_PLUMBING = (
    "relax.call_tir",
    "relax.call_tir_inplace",
    "relax.null_value",
    "relax.builtin.",
    "relax.memory.",
    "relax.vm.",
    "relax.shape_of",
    "relax.call_pure_packed",
    "relax.tensor_to_shape",
)


def non_primfunc_kernels(mod: tvm.IRModule) -> list[str]:
    """Everything main launches that is not a PrimFunc (empty when the invariant holds)."""
    bad = []
    for gvar, func in mod.functions.items():
        if isinstance(func, relax.Function) and func.attrs is not None and "Primitive" in func.attrs.keys():
            bad.append(f"Primitive Relax function {gvar.name_hint} survived FuseTIR")
    for call in relax_calls(mod, include_primitive=False):
        op = call.op
        if isinstance(op, tvm.ir.Op):
            if op.name in ("relax.call_tir", "relax.call_tir_inplace"):
                callee = call.args[0]
                if not isinstance(mod[callee], tvm.tirx.PrimFunc):
                    bad.append(f"call_tir of non-PrimFunc {callee.name_hint}")
            elif not op.name.startswith(_PLUMBING):
                bad.append(f"high-level op {op.name} left after lowering")
        elif isinstance(op, relax.GlobalVar):
            if not isinstance(mod[op], tvm.tirx.PrimFunc):
                bad.append(f"call of non-PrimFunc {op.name_hint}")
    return bad


def _pass_cases():
    """(name, pass factory, FoldConstant first?) for each pass tested alone."""
    return {
        # Documented to run straight after ONNX import.
        "FoldBatchNorm": (lambda: tvm_fusion.FoldBatchNorm(), False),
        "CanonicalizeActivations": (lambda: tvm_fusion.CanonicalizeActivations(), True),
        # Documented to work on both the raw import and after FoldConstant: the test draws which.
        "HorizontalFuse": (lambda: tvm_fusion.HorizontalFuse(), None),
        "RewriteLayout": (lambda: tvm_fusion.RewriteLayout(TARGET), True),
        "ApplyFusionPolicy": (lambda: tvm_fusion.ApplyFusionPolicy(target=TARGET), True),
    }


PASSES = list(_pass_cases())


# -- property 1: the whole pipeline --------------------------------------------------------------
def check_pipeline_numerics(spec: GraphSpec) -> None:
    feeds = spec.feeds()
    reference = ort_outputs(spec.model, feeds)
    plain = run_vm(imported(spec), spec, feeds)
    result = tvm_fusion.build(spec.model, "llvm", tuning_logs=None)
    ours = run_vm(result.executable, spec, feeds)
    assert_close(plain, reference, spec, "unoptimised TVM vs onnxruntime")
    assert_close(ours, plain, spec, "tvm_fusion.build vs unoptimised TVM")
    assert_close(ours, reference, spec, "tvm_fusion.build vs onnxruntime")


# -- property 2: each pass alone -----------------------------------------------------------------
def check_pass_alone(spec: GraphSpec, name: str, fold_first: bool) -> None:
    make_pass, _ = _pass_cases()[name]

    def pass_input() -> tvm.IRModule:
        mod = imported(spec)
        return relax.transform.FoldConstant()(mod) if fold_first else mod

    before, reference = pass_input(), pass_input()  # two objects: the reference stays untouched
    assert well_formed(before), "the imported module itself is not well formed"
    with TARGET:
        after = make_pass()(before)
    assert well_formed(after), f"{name} produced an ill-formed module:\n{after.script()[:4000]}"
    feeds = spec.feeds()
    assert_close(
        run_vm(after, spec, feeds), run_vm(reference, spec, feeds), spec, f"{name} vs its input module"
    )
    assert tvm_ffi.structural_equal(before, reference), f"{name} mutated its input module"


# -- property 3: structural invariants ----------------------------------------------------------
def check_fold_batch_norm_removes_bn(spec: GraphSpec) -> None:
    mod = imported(spec)
    assert op_names(mod).count("relax.nn.batch_norm") == spec.n_bn  # the generator's count is right
    folded = relax.transform.FoldConstant()(tvm_fusion.FoldBatchNorm()(mod))
    left = op_names(folded).count("relax.nn.batch_norm")
    assert left == 0, f"{left} of {spec.n_bn} nn.batch_norm left after FoldBatchNorm + FoldConstant"


def check_pipeline_invariants(spec: GraphSpec) -> None:
    lowered = tvm_fusion.optimize(imported(spec), "llvm")
    assert well_formed(lowered), "pipeline output is not well formed"
    bad = non_primfunc_kernels(lowered)
    assert not bad, "; ".join(bad)
    n_io = len(spec.inputs) + len(spec.outputs)
    transforms = count_layout_transforms(lowered)
    assert transforms <= n_io, f"{transforms} layout transforms left, model has only {n_io} inputs + outputs"


# -- CI subset (derandomized: the same examples every run) -------------------------------------
@CI
@given(spec=GRAPHS)
def test_pipeline_matches_unoptimised_and_onnxruntime(spec):
    check_pipeline_numerics(spec)


@pytest.mark.parametrize("name", PASSES)
@CI_SMALL
@given(data=st.data())
def test_each_pass_alone_keeps_numerics_and_well_formedness(name, data):
    draw_and_check_pass(name, data)


def draw_and_check_pass(name: str, data) -> None:
    spec = data.draw(CONV_GRAPHS if name == "RewriteLayout" else GRAPHS, label="spec")
    fold_first = _pass_cases()[name][1]
    if fold_first is None:
        fold_first = data.draw(st.booleans(), label="fold_constant_first")
    check_pass_alone(spec, name, fold_first)


@CI
@given(spec=GRAPHS)
def test_fold_batch_norm_leaves_no_batch_norm(spec):
    check_fold_batch_norm_removes_bn(spec)


@CI
@given(spec=CONV_GRAPHS)
def test_pipeline_structural_invariants(spec):
    check_pipeline_invariants(spec)


# -- nightly: >= 200 random examples per property (pytest -m nightly) -----------------------------
@pytest.mark.nightly
@NIGHTLY
@given(spec=GRAPHS)
def test_nightly_pipeline_numerics(spec):
    check_pipeline_numerics(spec)


@pytest.mark.nightly
@pytest.mark.parametrize("name", PASSES)
@NIGHTLY
@given(data=st.data())
def test_nightly_each_pass_alone(name, data):
    draw_and_check_pass(name, data)


@pytest.mark.nightly
@NIGHTLY
@given(spec=GRAPHS)
def test_nightly_fold_batch_norm_leaves_no_batch_norm(spec):
    check_fold_batch_norm_removes_bn(spec)


@pytest.mark.nightly
@NIGHTLY
@given(spec=CONV_GRAPHS)
def test_nightly_pipeline_structural_invariants(spec):
    check_pipeline_invariants(spec)


# -- regression tests for failures the properties found, and one open reproducer ---------------
def _one_layer_spec(code: str, inputs, outputs, depth: int = 2) -> GraphSpec:
    return GraphSpec(
        code=code,
        seed=0,
        inputs=tuple(inputs),
        outputs=tuple(outputs),
        ops=("reproducer",),
        depth=depth,
        n_bn=0,
    )


def test_regression_canonicalize_activations_does_not_mutate_input():
    """Found by the properties: the pass used to rewrite the caller's module in place."""
    spec = _one_layer_spec(
        "x = g.input('input0', (1, 4, 4, 4))\ny = g.relu6(x)\n", [("input0", (1, 4, 4, 4))], ["y"]
    )
    check_pass_alone(spec, "CanonicalizeActivations", fold_first=True)


def test_regression_depthwise_1x1_conv_bias_pipeline_numerics():
    """Found by the properties: the Injective rule inlined the bias into a unit-extent reduction twice."""
    spec = _one_layer_spec(
        "x = g.input('input0', (1, 3, 4, 4))\ny = g.conv(x, 3, 3, k=1, stride=1, groups=3, bias=True)\n",
        [("input0", (1, 3, 4, 4))],
        ["y"],
    )
    check_pipeline_numerics(spec)


@pytest.mark.xfail(
    strict=True,
    reason="RewriteLayout(NCHW8c) ends the blocked region at an H/W transpose: 3 layout "
    "transforms for 1 input + 1 output (numerics are right); see .notes/repro_rewrite_layout_1.py",
)
def test_reproducer_transpose_between_conv_regions_layout_budget():
    from tvm_fusion import models
    from tvm_fusion.passes import RewriteLayout

    g = models.GraphBuilder("transpose_between_convs")
    x = g.input("input0", (1, 8, 4, 4))
    h = g.transpose(g.conv(x, 8, 8, k=1, bias=False), [0, 1, 3, 2])
    mod = relax.transform.FoldConstant()(
        tvm_fusion.import_onnx(g.finish([g.conv(h, 8, 8, k=1, bias=False)])).mod
    )
    out = relax.transform.FoldConstant()(RewriteLayout("llvm", "NCHW8c")(mod))
    assert count_layout_transforms(out) <= 2

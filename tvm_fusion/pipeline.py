"""The tvm_fusion pipeline: a ``tvm.transform.Sequential`` of named passes a user can reuse.

Order, and why:

1. ``FoldBatchNorm`` + ``FoldConstant``: BN disappears into conv/matmul weights before anything
   counts ops, so fusion and layout see the real compute graph.
2. ``CanonicalizeActivations``: exporters spell GELU/SiLU as erf/sigmoid arithmetic; one op fuses
   as an epilogue, five ops with a diamond do not.
3. ``HorizontalFuse``: sibling GEMMs/convs over one input become one (Q/K/V -> one GEMM + split).
4. ``RewriteLayout`` + ``FoldConstant``: NCHW{c}/NHWC per target; weights transformed at compile time.
5. ``ApplyFusionPolicy``: groups named ops into Primitive functions as the policy decides.
6. ``LegalizeOps``, ``AnnotateTIROpPattern``, ``FoldConstant``, ``FuseTIR``: one PrimFunc per group.
7. Schedules: constant weights marked layout-free, tuned records (``MetaScheduleApplyDatabase``),
   default (dlight-style) rules for the rest, packed weights folded into constants.

The result is a lowered Relax module; ``tvm.compile(mod, target, relax_pipeline=build_pipeline(target))``
finishes the build (plain ``tvm.compile`` too, except for modules with symbolic shapes: see
``MarkSingleBufferNoAlias``).
"""

from __future__ import annotations

import tvm
from tvm import relax

from .policy import FusionPolicy
from .targets import parse_target

# The activation layout the pipeline asks RewriteLayout for, per target kind; measured, see
# docs/layout.md. On CPU our conv schedule already packs weights into a blocked layout at compile
# time and picks its vector axis per conv; NCHW activations measured faster than NCHW8c/16c/32c
# (ResNet-18 at 224: 78 ms vs 148/105/91 ms), so the pipeline keeps them. ``RewriteLayout(target)``
# on its own still gives NCHW{c} on CPU, and ``layout="NCHW8c"`` selects it here.
PIPELINE_LAYOUT = {"cuda": "NHWC", "llvm": "NCHW"}


def in_target(
    target: tvm.target.Target, inner: tvm.transform.Pass, name: str | None = None
) -> tvm.transform.Pass:
    """Run ``inner`` with ``target`` in scope (dlight and Meta-Schedule read ``Target.current()``)."""

    @tvm.transform.module_pass(opt_level=0, name=name or inner.info.name)
    def _run(mod, _ctx):
        with target:
            return inner(mod)

    return _run


def pipeline_passes(
    target,
    policy: FusionPolicy | dict | str | None = None,
    *,
    fold_batch_norm: bool = True,
    horizontal: bool | None = None,
    layout: str | bool | None = True,
    fusion: bool = True,
    schedule: bool = True,
    database=None,
) -> list[tvm.transform.Pass]:
    """The passes of :func:`pipeline`, as a list to print, reorder or splice into your own.

    Parameters
    ----------
    target : str | dict | Target
        ``"llvm"``, ``"cuda"``, a JSON dict or a ``tvm.target.Target``.
    policy : FusionPolicy | dict | path | None
        Fusion rules (None: defaults). ``policy.horizontal`` switches horizontal fusion.
    fold_batch_norm, fusion, schedule : bool
        Switch stages off (``fusion=False`` gives the unfused baseline: one kernel per op).
    horizontal : bool | None
        Overrides ``policy.horizontal`` when not None.
    layout : True | False | str
        True: the pipeline's per-target layout (``PIPELINE_LAYOUT``); a string forces one
        ("NHWC", "NCHW8c", ...); False skips the layout pass.
    database : meta_schedule Database | None
        Tuned records to apply before the default schedules.
    """
    from .passes import (
        ApplyFusionPolicy,
        CanonicalizeActivations,
        FoldBatchNorm,
        HorizontalFuse,
        RewriteLayout,
    )
    from .schedules import default_schedule_passes, mark_prepackable

    target = parse_target(target)
    policy = FusionPolicy.coerce(policy)
    horizontal = policy.horizontal if horizontal is None else horizontal
    passes: list[tvm.transform.Pass] = []
    if fold_batch_norm:
        passes += [FoldBatchNorm(), relax.transform.FoldConstant()]
    passes.append(CanonicalizeActivations())
    if horizontal:
        passes.append(HorizontalFuse())
    if layout:
        chosen = PIPELINE_LAYOUT.get(target.kind.name, "auto") if layout is True else layout
        passes += [RewriteLayout(target, chosen), relax.transform.FoldConstant()]
    if fusion:
        passes.append(ApplyFusionPolicy(policy, target))
    passes += [
        relax.transform.LegalizeOps(),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        relax.transform.FuseTIR(),
        relax.transform.DeadCodeElimination(),
    ]
    if schedule:
        # constant weights marked first, so tuned schedules can pre-pack them like ours do
        passes += mark_prepackable(target)
        if database is not None:
            passes.append(in_target(target, _apply_database(database), "MetaScheduleApplyDatabase"))
        rules, *finish = default_schedule_passes(target)
        passes += [in_target(target, rules, "DefaultSchedules"), *finish]
    return passes


def _apply_database(database) -> tvm.transform.Pass:
    @tvm.transform.module_pass(opt_level=0, name="MetaScheduleApplyDatabase")
    def _apply(mod, _ctx):
        with database:
            return relax.transform.MetaScheduleApplyDatabase(enable_warning=False)(mod)

    return _apply


def pipeline(target, policy=None, **options) -> tvm.transform.Sequential:
    """The whole tvm_fusion pipeline as one ``Sequential`` (see :func:`pipeline_passes`)."""
    return tvm.transform.Sequential(pipeline_passes(target, policy, **options), name="tvm_fusion")


def describe(passes: list[tvm.transform.Pass]) -> str:
    """One line per pass, for printing what a pipeline will do."""
    return "\n".join(f"{i + 1:2d}. {p.info.name}" for i, p in enumerate(passes))


def build_pipeline(target) -> tvm.transform.Pass:
    """The Relax pipeline for ``tvm.compile(lowered, target, relax_pipeline=...)``: what
    ``"default"`` means there, then ``MarkSingleBufferNoAlias`` for the shape functions it makes
    (without it a module with symbolic shapes loses ``noalias`` in every kernel, see that pass)."""
    from .passes import MarkSingleBufferNoAlias

    target = parse_target(target)
    lower = relax.get_default_pipeline(target) if "gpu" in target.keys else relax.get_pipeline("default")
    return tvm.transform.Sequential([lower, MarkSingleBufferNoAlias()], name="tvm_fusion_lower")


@relax.register_pipeline("tvm_fusion")
def _registered_pipeline(target=None, policy=None, **options):
    """``relax.get_pipeline("tvm_fusion", target=...)``: our passes then TVM's lowering to the VM."""
    from .passes import MarkSingleBufferNoAlias

    target = parse_target(target or "llvm")
    return tvm.transform.Sequential(
        [pipeline(target, policy, **options), relax.get_pipeline("default"), MarkSingleBufferNoAlias()],
        name="tvm_fusion_build",
    )

"""The tvm_fusion pipeline: a ``tvm.transform.Sequential`` of named passes a user can reuse.

Order, and why:

0. ``BindUnknownShapes``: a tensor whose shape depends on data (a slice with run-time bounds) gets
   symbolic dims, or FoldConstant and LegalizeOps cannot lower anything downstream of it.
   ``RemoveInferenceDropout``: an exported ``Dropout`` is its input (TVM would copy it and write
   a mask of ones). ``RemoveEmptyTensors``: an empty operand of a ``concat`` (Phi-3's rotary
   pass-through part when the rotary dimension is the whole head) is dropped and no kernel computes
   an empty tensor (LLVM refuses to vectorize a loop of extent 0).
1. ``FoldBatchNorm`` + ``FoldConstant``: BN disappears into conv/matmul weights before anything
   counts ops, so fusion and layout see the real compute graph. ``CanonicalizeBindings`` +
   ``FoldConstant``: a BatchNormalization of a constant (BiT's weight standardization) folds to a
   tuple of constants; the conv reading a field of it gets a constant weight.
2. ``CanonicalizeActivations``: exporters spell GELU/SiLU/HardSwish as arithmetic; one op fuses
   as an epilogue, five ops with a diamond do not. ``RecognizeGroupNorm``: torch's GroupNorm /
   InstanceNorm exports (reshape, mean, variance, reshape back, affine) become one ``group_norm``,
   which a layout region can cross (``DecomposeGroupNorm`` expands it again after step 4).
   ``RecognizeRMSNorm``: T5's and the Llama family's RMSNorm (square, mean, add, sqrt, divide,
   scale) becomes one ``rms_norm``, which fuses in front of its projection like a layer norm (on
   CPU only rows shorter than ``WidenLongReductions``' threshold: its float64 sum stays on longer
   ones).
   ``SimplifyPoolCeilMode``: a ``ceil_mode`` pool whose windows rounding up does not change
   loses the flag (and TOPI's padded copy of its input). ``PoolBeforePointwiseConv``: an average
   pool after a 1x1 conv (DenseNet's transitions) pools the conv's input instead, so the conv
   runs on the pooled map (4x fewer FLOPs for a 2x2/2 pool).
   ``TrimPaddingTaps``: conv taps that read only zero padding (DeepLabV3's ASPP, dilation 24 and 36
   on a 14x14 map) are dropped from the kernel, with the padding shrunk to match.
   ``SimplifyUnitPermutes``: a transpose of size-1 axes only (ViT's seq-first attention at batch 1)
   is a free reshape, moved in front of a layer norm so that the norm still fuses into its GEMM.
   ``SliceBeforeLayoutOps``: a ``take`` out of a transposed view that reads one block of its
   source (Q, K and V out of ``nn.MultiheadAttention``'s packed projection) slices the source.
   ``SliceBeforeRowwiseOps``: a ``take`` of one row (a ViT's class token) moves in front of the
   row-wise ops that computed it, so the last layer's MLP and projection run on that row only.
   ``SplitConvAtBorders`` (CPU): a dilated conv whose border outputs read fewer taps (DeepLabV3's
   dilation-12 ASPP conv) is computed per output region with only that region's taps.
   ``LinearResizeAsMatmul`` (CPU): a bilinear resize of a small map (a segmentation head's
   logits) becomes two matmuls with constant interpolation matrices.
3. ``HorizontalFuse``: sibling GEMMs/convs over one input become one (Q/K/V -> one GEMM + split).
   ``FuseAttention``: each attention block becomes one ``fused_attention`` function (after the
   QKV merge, which it looks through; before fusion, which would otherwise split the block).
4. ``RewriteLayout`` + ``FoldConstant``: NCHW{c}/NHWC per target; weights transformed at compile time.
   ``DecomposeGroupNorm``: group norms as means and elementwise ops, in the layout they now have.
   ``WidenLongReductions`` (CPU): a mean / variance / sum over thousands of elements (a
   GroupNorm's statistics) accumulates in float64, or its float32 rounding error compounds
   through the layers.
5. ``ConcatPerReader`` + ``ApplyFusionPolicy``: groups named ops into Primitive functions as the
   policy decides; ``MergeUnfusedConcats`` then merges the concat copies it left unfused.
6. ``LowerAttention``: fused attention (and ``R.nn.attention``) becomes the target's
   FlashAttention-style kernel (``schedules/attention.py``), already scheduled.
   ``LegalizeOps``, ``AnnotateTIROpPattern``, ``FoldConstant``, ``FuseTIR``: one PrimFunc per group.
   On CPU, eligible 3x3 convs become Winograd kernels where the conv-algorithm decision says so
   (tuning's measured choice, else a measured cost rule: ``legalize/winograd_conv.py``).
7. Schedules: constant weights marked layout-free, tuned records (``MetaScheduleApplyDatabase``),
   default (dlight-style) rules for the rest, packed weights folded into constants.

The result is a lowered Relax module; ``tvm.compile(mod, target,
relax_pipeline=build_pipeline(target), tir_pipeline=tir_pipeline(target))`` finishes the build
(plain ``tvm.compile`` too, without the stack scratch of ``StackAllocateLoopBuffers``, except for
modules with symbolic shapes: see ``MarkSingleBufferNoAlias``).
"""

from __future__ import annotations

import contextlib
import dataclasses

import tvm
from tvm import relax

from .errors import TvmFusionError, last_line
from .legalize import LegalizeOps
from .legalize import register as register_legalizations
from .legalize.strassen_matmul import check_choice as check_strassen_choice
from .legalize.strassen_matmul import strassen as strassen_scope
from .legalize.winograd_conv import conv_algorithms as conv_algorithm_scope
from .passes import (
    ApplyFusionPolicy,
    BindUnknownShapes,
    CanonicalizeActivations,
    ConcatPerReader,
    DecomposeGroupNorm,
    FoldBatchNorm,
    FuseAttention,
    HorizontalFuse,
    LinearResizeAsMatmul,
    MarkSingleBufferNoAlias,
    MergeUnfusedConcats,
    PadConvChannels,
    PoolBeforePointwiseConv,
    RecognizeGroupNorm,
    RecognizeRMSNorm,
    RemoveEmptyTensors,
    RemoveInferenceDropout,
    RewriteLayout,
    SimplifyPoolCeilMode,
    SimplifyUnitPermutes,
    SliceBeforeLayoutOps,
    SliceBeforeRowwiseOps,
    SplitConvAtBorders,
    StackAllocateLoopBuffers,
    TrimPaddingTaps,
    WidenLongReductions,
)
from .passes.widen_long_reductions import MIN_ELEMENTS
from .policy import FusionPolicy
from .schedules import LowerAttention, default_schedule_passes, mark_prepackable
from .targets import parse_target

# The activation layout the pipeline asks RewriteLayout for, per target kind; measured, see
# docs/performance.md. On CPU our conv schedule already packs weights into a blocked layout at compile
# time and picks its vector axis per conv; NCHW activations measured faster than NCHW8c/16c/32c
# (ResNet-18 at 224: 78 ms vs 148/105/91 ms), so the pipeline keeps them, unless the model is itself
# channels-last between its convs (ConvNeXt): "as-model" gives it NHWC, see
# ``rewrite_layout.channels_last_model``. ``RewriteLayout(target)`` on its own still gives NCHW{c}
# on CPU, and ``layout="NCHW8c"`` selects it here.
PIPELINE_LAYOUT = {"cuda": "NHWC", "llvm": "as-model"}


def in_target(
    target: tvm.target.Target, inner: tvm.transform.Pass, name: str | None = None
) -> tvm.transform.Pass:
    """Run ``inner`` with ``target`` in scope (dlight and Meta-Schedule read ``Target.current()``)."""

    @tvm.transform.module_pass(opt_level=0, name=name or inner.info.name)
    def _run(mod, _ctx):
        with target:
            return inner(mod)

    return _run


@dataclasses.dataclass
class PipelineStages:
    """The pipeline's passes in the four stages a build, tuning and ``explain`` each stop at."""

    rewrite: list  # graph rewrites before fusion: BN fold, activations, horizontal, attention, layout
    fuse: list  # fusion policy, lowering to TIR: one PrimFunc per group
    tuned: list  # constant weights marked layout-free, tuned records applied
    default: list  # default schedules for everything else, packed weights folded

    def passes(self) -> list[tvm.transform.Pass]:
        return self.rewrite + self.fuse + self.tuned + self.default


def pipeline_stages(
    target,
    policy: FusionPolicy | dict | str | None = None,
    *,
    fold_batch_norm: bool = True,
    horizontal: bool | None = None,
    attention: bool | None = None,
    layout: str | bool | None = True,
    fusion: bool = True,
    schedule: bool = True,
    database=None,
    conv_algorithms: dict | str | None = None,
    strassen: bool | str | None = None,
) -> PipelineStages:
    """The passes of :func:`pipeline`, by stage (see :func:`pipeline_passes` for the options)."""
    target = parse_target(target)
    policy = FusionPolicy.coerce(policy)
    register_legalizations()  # LegalizeOps below lowers NCHW{c} convs and GELU our way
    horizontal = policy.horizontal if horizontal is None else horizontal
    attention = policy.attention if attention is None else attention
    rewrite: list[tvm.transform.Pass] = [BindUnknownShapes(), RemoveInferenceDropout(), RemoveEmptyTensors()]
    if fold_batch_norm:
        # FoldConstant evaluates a batch_norm of constants (BiT's weight standardization) to a
        # tuple of constants; CanonicalizeBindings makes the field read from it that constant, and
        # the second FoldConstant folds what is computed from it: the conv gets a constant weight,
        # which its schedule packs (or Winograd-transforms) at compile time
        rewrite += [
            FoldBatchNorm(),
            relax.transform.FoldConstant(),
            relax.transform.CanonicalizeBindings(),
            relax.transform.FoldConstant(),
        ]
    rewrite += [
        CanonicalizeActivations(),
        RecognizeGroupNorm(),
        # on CPU a long row's mean of squares stays a mean, which WidenLongReductions widens
        RecognizeRMSNorm(max_row=MIN_ELEMENTS if target.kind.name == "llvm" else None),
        SimplifyPoolCeilMode(),
        PoolBeforePointwiseConv(),
        TrimPaddingTaps(),
        SimplifyUnitPermutes(),
        SliceBeforeLayoutOps(),
        SliceBeforeRowwiseOps(),
    ]
    if target.kind.name == "llvm":  # GPU: not measured
        rewrite += [SplitConvAtBorders(), LinearResizeAsMatmul()]
    if horizontal:
        rewrite.append(HorizontalFuse())
    if attention and fusion:
        if not fold_batch_norm:  # scales, masks and causal triangles must be constants
            rewrite.append(relax.transform.FoldConstant())
        rewrite.append(FuseAttention())
    if layout:
        chosen = PIPELINE_LAYOUT.get(target.kind.name, "auto") if layout is True else layout
        rewrite += [RewriteLayout(target, chosen), relax.transform.FoldConstant()]
    rewrite.append(DecomposeGroupNorm())  # in the layout it now has
    if target.kind.name == "llvm":  # its statistics too (GPU reductions are trees: not needed)
        rewrite.append(WidenLongReductions())
    rewrite.append(PadConvChannels(target))  # whole vectors of output channels (CPU, NCHW)
    fuse = []
    if fusion:
        fuse += [ConcatPerReader(policy.for_target(target)), ApplyFusionPolicy(policy, target)]
        fuse.append(MergeUnfusedConcats())  # the copies the planner did not fuse: written once
    fuse += [
        LowerAttention(target),
        _legalize(conv_algorithms, strassen),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        relax.transform.FuseTIR(),
        relax.transform.DeadCodeElimination(),
    ]
    tuned: list[tvm.transform.Pass] = []
    default: list[tvm.transform.Pass] = []
    if schedule:
        # constant weights marked first, so tuned schedules can pre-pack them like ours do
        tuned += mark_prepackable(target)
        if database is not None:
            tuned.append(in_target(target, _apply_database(database), "MetaScheduleApplyDatabase"))
        rules, *finish = default_schedule_passes(target)
        default += [in_target(target, rules, "DefaultSchedules"), *finish]
    return PipelineStages(rewrite, fuse, tuned, default)


def pipeline_passes(
    target, policy: FusionPolicy | dict | str | None = None, **options
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
    horizontal, attention : bool | None
        Override ``policy.horizontal`` / ``policy.attention`` when not None.
    layout : True | False | str
        True: the pipeline's per-target layout (``PIPELINE_LAYOUT``); a string forces one
        ("NHWC", "NCHW8c", "NCHW", "as-model": NHWC for a channels-last model, else NCHW);
        False skips the layout pass.
    database : meta_schedule Database | None
        Tuned records to apply before the default schedules.
    conv_algorithms : dict | str | None
        How eligible 3x3 convs are computed on CPU (``legalize/winograd_conv.py``): a dict from conv
        signature to ``"direct"`` / ``"winograd2"`` / ``"winograd4"`` (what tuning measured; others
        by the cost rule), one of those names for all, or None (the cost rule).
    strassen : bool | str | None
        Large float32 matmuls by a constant weight on CPU by one level of Strassen
        (``legalize/strassen_matmul.py``): off by default (its error is relative to whole blocks,
        not rows: a model that normalizes rows that should be zero amplifies it); True where its
        measured size rule says, ``"always"`` for every eligible matmul.
    """
    return pipeline_stages(target, policy, **options).passes()


def _legalize(conv_algorithms, strassen) -> tvm.transform.Pass:
    """Our ``LegalizeOps`` with the conv-algorithm and Strassen decisions in scope (none set when
    None, so a caller's own ``winograd_conv.conv_algorithms`` / ``strassen_matmul.strassen`` block
    still applies)."""
    if strassen is not None:
        check_strassen_choice(strassen)  # at pipeline construction, not inside a pass
    if conv_algorithms is None and strassen is None:
        return LegalizeOps()

    @tvm.transform.module_pass(opt_level=0, name="LegalizeOps")
    def _run(mod, _ctx):
        with contextlib.ExitStack() as scopes:
            if conv_algorithms is not None:
                scopes.enter_context(conv_algorithm_scope(conv_algorithms))
            if strassen is not None:
                scopes.enter_context(strassen_scope(strassen))
            return LegalizeOps()(mod)

    return _run


def run_passes(
    mod: tvm.IRModule, passes: list, target: tvm.target.Target, name: str = "model"
) -> tvm.IRModule:
    """Run ``passes`` in order under ``with target:``; a pass that fails is named in one line
    (``pass X failed on <name>: ...``) instead of a C++ backtrace."""
    with target:
        for p in passes:
            try:
                mod = p(mod)
            except TvmFusionError:
                raise
            except Exception as err:
                raise TvmFusionError(f"pass {p.info.name} failed on {name}: {last_line(err)}") from err
    return mod


def unscheduled_module(
    mod: tvm.IRModule, target: tvm.target.Target, policy=None, name: str = "model", **options
) -> tvm.IRModule:
    """The fused module exactly as the build hands it to the schedules (constant weights marked
    layout-free, nothing scheduled): what tuning must see, since records are keyed by PrimFunc
    hash. Pass the policy and options the build will get (they shape the fused kernels)."""
    options = {k: v for k, v in options.items() if k not in ("schedule", "database")}
    stages = pipeline_stages(target, policy, **options)
    return run_passes(mod, stages.rewrite + stages.fuse + stages.tuned, target, name)


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
    target = parse_target(target)
    lower = relax.get_default_pipeline(target) if "gpu" in target.keys else relax.get_pipeline("default")
    return tvm.transform.Sequential([lower, MarkSingleBufferNoAlias()], name="tvm_fusion_lower")


CPU_TIR_PIPELINE = "tvm_fusion_cpu"


def _cpu_tir_pipeline():
    """TVM's default TIR pipeline with ``StackAllocateLoopBuffers`` right before
    ``LowerTVMBuiltin`` (the factory protocol of ``tvm.tirx.register_tir_pipeline``)."""
    lower, finalize_host, finalize_device = tvm.tirx.get_tir_pipeline("default")

    def host_passes():
        return tvm.transform.Sequential([StackAllocateLoopBuffers(), finalize_host()])

    return lower, host_passes, finalize_device


tvm.tirx.register_tir_pipeline(CPU_TIR_PIPELINE, _cpu_tir_pipeline)


def tir_pipeline(target) -> str:
    """The TIR pipeline for ``tvm.compile(lowered, target, tir_pipeline=...)``: on CPUs
    ``"tvm_fusion_cpu"``, TVM's default with ``StackAllocateLoopBuffers`` (per-task scratch on
    the stack, not in the workspace pool); elsewhere TVM's default."""
    return CPU_TIR_PIPELINE if parse_target(target).kind.name == "llvm" else "default"


@relax.register_pipeline("tvm_fusion")
def _registered_pipeline(target=None, policy=None, **options):
    """``relax.get_pipeline("tvm_fusion", target=...)``: our passes then TVM's lowering to the VM."""
    target = parse_target(target or "llvm")
    return tvm.transform.Sequential(
        [pipeline(target, policy, **options), relax.get_pipeline("default"), MarkSingleBufferNoAlias()],
        name="tvm_fusion_build",
    )

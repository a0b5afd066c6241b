"""Default (untuned) schedules: dlight-style rules that make every fused PrimFunc parallel + SIMD.

``apply_default_schedules(target)`` is the pass to run after fusion (FuseTIR) and before
``tvm.compile``. On CPU it also packs constant weights into the micro-kernel's blocked layout at
compile time: it marks constant PrimFunc arguments layout-free, schedules, splits the packing
blocks into their own PrimFuncs and folds them into new constants (weights must be bound
``relax.Constant``s, as ``from_onnx(keep_params_in_input=False)`` gives).

Fused attention (``FuseAttention``'s functions and ``R.nn.attention``) gets its own kernels
(``attention.py``: FlashAttention-style, complete schedules marked ``tirx.is_scheduled``, so the
rules below skip them), put in by the ``LowerAttention`` pass before ``LegalizeOps``.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.s_tir import dlight as dl

from ..passes.fold_constant_calls import FoldConstantCalls
from ..targets import is_gpu, parse_target
from ._util import Declining
from .attention import LowerAttention, attention_kernel
from .cpu import (
    Contraction,
    Depthwise,
    Injective,
    ParallelFallback,
    PlainReduction,
    RowReduction,
    Strassen,
    WindowReduction,
    Winograd,
    cpu_rules,
)
from .gpu_matmul import TunableMatmul
from .prepack import SplitWeightPrepack


def _target(target):
    return parse_target(target)


def gpu_rules() -> list:
    """dlight's GPU rule list (its Matmul with tunable config), each rule declining (instead of
    aborting the pass) when it raises."""
    return [
        Declining(rule)
        for rule in (
            TunableMatmul(),  # dlight's Matmul, its config tunable (choice 0: the rule's own pick)
            dl.gpu.GEMV(),
            dl.gpu.Reduction(),
            dl.gpu.GeneralReduction(),
            dl.gpu.Fallback(),
        )
    ]


def default_rules(target) -> list:
    """The ScheduleRules for target, most specific first."""
    target = _target(target)
    if is_gpu(target):
        return gpu_rules()
    return cpu_rules()


def mark_prepackable(target, prepack: bool = True) -> list[tvm.transform.Pass]:
    """The first scheduling step on CPU: mark PrimFunc arguments bound to constants
    ``layout_free_buffers``, so that any schedule (our rules, or a tuned Meta-Schedule record)
    may read them in a packed layout that is computed at compile time. Tuning extracts its tasks
    after this step, so a record's workload is the marked function the build schedules."""
    target = _target(target)
    return [] if is_gpu(target) or not prepack else [relax.transform.AttachAttrLayoutFreeBuffers()]


def default_schedule_passes(target, prepack: bool = True) -> list[tvm.transform.Pass]:
    """The rules for every function not scheduled yet, then (CPU) the packing blocks split into
    their own PrimFuncs and folded into new constants."""
    target = _target(target)
    if is_gpu(target):
        return [dl.ApplyDefaultSchedule(*default_rules(target))]
    if not prepack:
        return [dl.ApplyDefaultSchedule(*cpu_rules(prepack=False))]
    return [
        dl.ApplyDefaultSchedule(*default_rules(target)),
        SplitWeightPrepack(),
        FoldConstantCalls(),  # all packing functions in one build (FoldConstant: one each)
        relax.transform.FoldConstant(),
        relax.transform.DeadCodeElimination(),
    ]


def apply_default_schedules(target, prepack: bool = True) -> tvm.transform.Pass:
    """``dl.ApplyDefaultSchedule(*default_rules(target))``, plus compile-time weight packing on CPU.

    Run it inside ``with target:`` (dlight reads the target from the context when a PrimFunc has
    no "target" attribute). With ``prepack=False`` (or on GPU) it is that pass alone, with the
    rules of :func:`default_rules` (ours on CPU; dlight's GPU rules, Matmul made tunable, on CUDA).
    Tuned records go between the two halves (see ``pipeline_passes``).
    """
    passes = mark_prepackable(target, prepack) + default_schedule_passes(target, prepack)
    return (
        passes[0]
        if len(passes) == 1
        else tvm.transform.Sequential(passes, name="tvm_fusion.ApplyDefaultSchedules")
    )


__all__ = [
    "Contraction",
    "Depthwise",
    "LowerAttention",
    "attention_kernel",
    "Declining",
    "Injective",
    "ParallelFallback",
    "PlainReduction",
    "RowReduction",
    "TunableMatmul",
    "SplitWeightPrepack",
    "WindowReduction",
    "Strassen",
    "Winograd",
    "apply_default_schedules",
    "cpu_rules",
    "default_rules",
    "default_schedule_passes",
    "gpu_rules",
    "mark_prepackable",
]

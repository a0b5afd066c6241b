"""Default (untuned) schedules: dlight-style rules that make every fused PrimFunc parallel + SIMD.

``apply_default_schedules(target)`` is the pass to run after fusion (FuseTIR) and before
``tvm.compile``. On CPU it also packs constant weights into the micro-kernel's blocked layout at
compile time: it marks constant PrimFunc arguments layout-free, schedules, splits the packing
blocks into their own PrimFuncs and folds them into new constants (weights must be bound
``relax.Constant``s, as ``from_onnx(keep_params_in_input=False)`` gives).

Importing this package also registers a float32 ``relax.nn.gelu`` legalization that uses the
vectorizable ``topi.fast_erf`` instead of scalar ``erff`` (see ``fast_gelu.py``; switch it off
with ``set_fast_gelu(False)``, ``with fast_gelu(False):`` or ``TVM_FUSION_FAST_GELU=0``).
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.s_tir import dlight as dl

from .cpu import Contraction, Injective, ParallelFallback, RowReduction, cpu_rules
from .fast_gelu import fast_gelu, fast_gelu_enabled, set_fast_gelu  # registers the GELU legalization


def _target(target):
    if isinstance(target, tvm.target.Target):
        return target
    from ..targets import parse_target

    return parse_target(target)


def default_rules(target) -> list:
    """The ScheduleRules for target, most specific first."""
    target = _target(target)
    if target.kind.name == "cuda" or "gpu" in target.keys:
        return [dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(), dl.gpu.Fallback()]
    return cpu_rules()


def apply_default_schedules(target, prepack: bool = True) -> tvm.transform.Pass:
    """``dl.ApplyDefaultSchedule(*default_rules(target))``, plus compile-time weight packing on CPU.

    Run it inside ``with target:`` (dlight reads the target from the context when a PrimFunc has
    no "target" attribute). With ``prepack=False`` (or on GPU) it is exactly the dlight pass.
    """
    target = _target(target)
    rules = default_rules(target)
    if target.kind.name == "cuda" or "gpu" in target.keys:
        return dl.ApplyDefaultSchedule(*rules)
    if not prepack:
        return dl.ApplyDefaultSchedule(*cpu_rules(prepack=False))
    return tvm.transform.Sequential(
        [
            relax.transform.AttachAttrLayoutFreeBuffers(),
            dl.ApplyDefaultSchedule(*rules),
            relax.transform.SplitLayoutRewritePreproc(),
            relax.transform.FoldConstant(),
            relax.transform.DeadCodeElimination(),
        ],
        name="tvm_fusion.ApplyDefaultSchedules",
    )


__all__ = [
    "Contraction",
    "Injective",
    "ParallelFallback",
    "RowReduction",
    "apply_default_schedules",
    "cpu_rules",
    "default_rules",
    "fast_gelu",
    "fast_gelu_enabled",
    "set_fast_gelu",
]

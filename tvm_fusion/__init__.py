"""tvm_fusion: BatchNorm folding, policy-driven fusion and layout passes for Apache TVM (Relax).

Quick use::

    import tvm_fusion
    result = tvm_fusion.build("model.onnx", target="llvm")   # or "cuda", or a JSON target dict
    result.export("model.so")
    model = tvm_fusion.load("model.so")

Or take the passes into your own flow: ``tvm_fusion.pipeline(target)`` is a
``tvm.transform.Sequential``; ``tvm_fusion.pipeline_passes(target)`` the list of its passes.
"""

__version__ = "0.1.0"

import os as _os

# TVM sizes its thread pool as hardware_concurrency()/2 on x86 (it assumes hyper-threading), so a
# 2-vCPU VM runs every parallel kernel on ONE thread: half speed, measured (BERT FFN2 7.2 vs 3.6 ms).
# The pool starts lazily at the first parallel kernel, so a default set here, before any kernel
# runs, takes effect; an explicit TVM_NUM_THREADS / OMP_NUM_THREADS from the user always wins.
if "TVM_NUM_THREADS" not in _os.environ and "OMP_NUM_THREADS" not in _os.environ:
    _os.environ["TVM_NUM_THREADS"] = str(_os.cpu_count() or 1)
# TVM also pins each pool worker to one core, and its kernels split work statically, so a kernel
# waits for its slowest thread: one busy process on the worker's core made MobileNet-V2 234 ms
# instead of 9 ms unpinned (docs/contention.md). Unpinned, the OS moves the worker off the busy
# core; on an idle machine both measured the same. The user's TVM_BIND_THREADS wins here too.
_os.environ.setdefault("TVM_BIND_THREADS", "0")

from .api import BuildResult, LoadedModel, build, export_library, load, optimize  # noqa: E402
from .errors import (  # noqa: E402
    ExportError,
    InputError,
    ModelLoadError,
    ModuleError,
    PolicyError,
    TargetError,
    TuningRecordError,
    TvmFusionError,
    UnsupportedOpError,
)
from .frontend import import_onnx  # noqa: E402
from .passes import (  # noqa: E402
    ApplyFusionPolicy,
    CanonicalizeActivations,
    FoldBatchNorm,
    FuseAttention,
    HorizontalFuse,
    LinearResizeAsMatmul,
    PadConvChannels,
    PoolBeforePointwiseConv,
    RewriteLayout,
    SimplifyPoolCeilMode,
    SliceBeforeLayoutOps,
    SliceBeforeRowwiseOps,
    TrimPaddingTaps,
    explain,
)
from .pipeline import describe, pipeline, pipeline_passes  # noqa: E402
from .policy import FusionPolicy, Roofline  # noqa: E402
from .targets import parse_target  # noqa: E402

__all__ = [
    "ApplyFusionPolicy",
    "BuildResult",
    "CanonicalizeActivations",
    "ExportError",
    "FoldBatchNorm",
    "FuseAttention",
    "FusionPolicy",
    "HorizontalFuse",
    "InputError",
    "LinearResizeAsMatmul",
    "LoadedModel",
    "ModelLoadError",
    "ModuleError",
    "PadConvChannels",
    "PolicyError",
    "PoolBeforePointwiseConv",
    "RewriteLayout",
    "Roofline",
    "SimplifyPoolCeilMode",
    "SliceBeforeLayoutOps",
    "SliceBeforeRowwiseOps",
    "TargetError",
    "TrimPaddingTaps",
    "TuningRecordError",
    "TvmFusionError",
    "UnsupportedOpError",
    "build",
    "describe",
    "explain",
    "export_library",
    "import_onnx",
    "load",
    "optimize",
    "parse_target",
    "pipeline",
    "pipeline_passes",
]

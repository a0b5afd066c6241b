"""tvm_fusion's Relax passes, one per module; each is a ``tvm.transform.Pass`` usable on its own."""

from .apply_fusion_policy import ApplyFusionPolicy, explain, plan_module
from .canonicalize_activations import CanonicalizeActivations
from .fold_batch_norm import FoldBatchNorm
from .fold_constant_calls import FoldConstantCalls
from .horizontal_fuse import HorizontalFuse
from .mark_single_buffer_noalias import MarkSingleBufferNoAlias
from .rewrite_layout import RewriteLayout, count_layout_transforms

__all__ = [
    "ApplyFusionPolicy",
    "CanonicalizeActivations",
    "FoldBatchNorm",
    "FoldConstantCalls",
    "HorizontalFuse",
    "MarkSingleBufferNoAlias",
    "RewriteLayout",
    "count_layout_transforms",
    "explain",
    "plan_module",
]

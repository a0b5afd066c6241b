"""tvm_fusion's Relax passes, one per module; each is a ``tvm.transform.Pass`` usable on its own."""

from .apply_fusion_policy import ApplyFusionPolicy, explain, plan_module
from .bind_unknown_shapes import BindUnknownShapes
from .canonicalize_activations import CanonicalizeActivations
from .concat_per_reader import ConcatPerReader, MergeUnfusedConcats
from .decompose_group_norm import DecomposeGroupNorm
from .fold_batch_norm import FoldBatchNorm
from .fold_constant_calls import FoldConstantCalls
from .fuse_attention import FuseAttention, attention_decisions
from .horizontal_fuse import HorizontalFuse
from .mark_single_buffer_noalias import MarkSingleBufferNoAlias
from .pad_conv_channels import PadConvChannels
from .pool_before_pointwise_conv import PoolBeforePointwiseConv
from .recognize_group_norm import RecognizeGroupNorm
from .recognize_rms_norm import RecognizeRMSNorm
from .remove_empty_tensors import RemoveEmptyTensors
from .remove_inference_dropout import RemoveInferenceDropout
from .resize_as_matmul import LinearResizeAsMatmul
from .rewrite_layout import RewriteLayout, count_layout_transforms
from .simplify_pool_ceil_mode import SimplifyPoolCeilMode
from .simplify_unit_permutes import SimplifyUnitPermutes
from .slice_before_layout_ops import SliceBeforeLayoutOps
from .slice_before_rowwise_ops import SliceBeforeRowwiseOps
from .split_conv_at_borders import SplitConvAtBorders
from .stack_allocate_loop_buffers import StackAllocateLoopBuffers
from .trim_padding_taps import TrimPaddingTaps
from .widen_long_reductions import WidenLongReductions

__all__ = [
    "ApplyFusionPolicy",
    "BindUnknownShapes",
    "CanonicalizeActivations",
    "ConcatPerReader",
    "DecomposeGroupNorm",
    "FoldBatchNorm",
    "FoldConstantCalls",
    "FuseAttention",
    "HorizontalFuse",
    "LinearResizeAsMatmul",
    "MarkSingleBufferNoAlias",
    "MergeUnfusedConcats",
    "PadConvChannels",
    "PoolBeforePointwiseConv",
    "RecognizeGroupNorm",
    "RecognizeRMSNorm",
    "RemoveEmptyTensors",
    "RemoveInferenceDropout",
    "RewriteLayout",
    "SimplifyPoolCeilMode",
    "SimplifyUnitPermutes",
    "SliceBeforeLayoutOps",
    "SliceBeforeRowwiseOps",
    "SplitConvAtBorders",
    "StackAllocateLoopBuffers",
    "TrimPaddingTaps",
    "WidenLongReductions",
    "attention_decisions",
    "count_layout_transforms",
    "explain",
    "plan_module",
]

"""A tuning candidate as the built model runs it: weight-packing blocks split off.

Kernels that pack a constant weight do it in a block annotated as layout-rewrite preproc, and the
build computes that block once at compile time (``SplitLayoutRewritePreproc`` + ``FoldConstant``),
so a candidate must be timed reading pre-packed weights. Meta-Schedule's
``RemoveWeightLayoutRewriteBlock`` (in its builder and in ``ArgInfo.from_entry_func``) only
understands packing blocks that copy (``B[f(i)] = A[i]``) and aborts on one that computes, such as
the Winograd weight transform ``G·W·Gᵀ``; so does the cost model's feature extractor. Here the
block is split off with the build's own pass, so every kind of packing is timed (and featurized)
the way the build runs it.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

from ..ir import tir_stmts
from ..schedules.prepack import has_layout_rewrite_preproc


def kernel_as_built(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` (one scheduled ``main``) with its packing blocks removed: ``main`` then takes the
    packed weights as parameters, as the built model's kernel does."""
    func = mod["main"]
    if not has_layout_rewrite_preproc(func):
        return mod
    buffers = list(func.params)  # in this TVM a PrimFunc param *is* its buffer
    written = {region.source for node in tir_stmts(func) for region in getattr(node, "writes", None) or []}
    num_outputs = 0
    while num_outputs < len(buffers) and buffers[-1 - num_outputs] in written:
        num_outputs += 1
    inputs, outputs = buffers[: len(buffers) - num_outputs], buffers[len(buffers) - num_outputs :]
    bb = relax.BlockBuilder()
    kernel = bb.add_func(func.without_attr("global_symbol"), "kernel")
    args = [relax.Var(b.name, relax.TensorType(b.shape, b.dtype)) for b in inputs]
    with bb.function("main", args):
        out_sinfo = [relax.TensorType(b.shape, b.dtype) for b in outputs]
        call = bb.emit(
            relax.op.call_tir(kernel, relax.Tuple(args), out_sinfo if len(out_sinfo) > 1 else out_sinfo[0])
        )
        bb.emit_func_output(call)
    split = relax.transform.SplitLayoutRewritePreproc()(bb.get())
    compute = split[_last_kernel_called(split)]  # after the prepack function (weights -> packed)
    return tvm.IRModule({"main": compute.with_attr("global_symbol", "main")})


def candidate_args(mod: tvm.IRModule) -> list:
    """What the runner allocates for a candidate: the as-built kernel's parameters."""
    return ms.arg_info.ArgInfo.from_prim_func(kernel_as_built(mod)["main"])


def measure_candidate(sch) -> ms.MeasureCandidate:
    return ms.MeasureCandidate(sch, candidate_args(sch.mod))


@derived_object
class AsBuiltFeatures(ms.feature_extractor.PyFeatureExtractor):
    """The cost model's features (``PerStoreFeature``) of each candidate as built: the C++
    extractor removes packing blocks itself, with the same limit as above (and it also aborts on
    the empty block Meta-Schedule's removal leaves behind, so the split is used for every kind)."""

    def __init__(self):
        super().__init__()
        self.inner = ms.feature_extractor.PerStoreFeature()

    def extract_from(self, context, candidates):
        as_built = [
            ms.MeasureCandidate(tvm.s_tir.Schedule(kernel_as_built(c.sch.mod)), c.args_info)
            for c in candidates
        ]
        return self.inner.extract_from(context, as_built)


def _last_kernel_called(mod: tvm.IRModule) -> tvm.ir.GlobalVar:
    """The PrimFunc ``main`` calls last (``call_tir``'s first argument)."""
    calls = [
        binding.value.args[0]
        for block in mod["main"].body.blocks
        for binding in block.bindings
        if isinstance(binding.value, relax.Call)
        and binding.value.args
        and isinstance(binding.value.args[0], tvm.ir.GlobalVar)
    ]
    return calls[-1]

"""SplitWeightPrepack: ``relax.transform.SplitLayoutRewritePreproc`` on the kernels that pack weights.

The TVM pass builds a splitter for *every* PrimFunc in the module, and the splitter asserts ("There
should be a compute block if there is only one subtree under the root") on an opaque kernel whose
body is not a block tree, e.g. the ``scatter_elements`` a run-time ``Slice`` bound imports as.
Only kernels with a weight-packing block (annotated ``meta_schedule.layout_rewrite_preproc``) have
anything to split, so the others are set aside while it runs and put back unchanged.
"""

from __future__ import annotations

import tvm
from tvm import relax, tirx

from ..ir import tir_stmts
from ._util import LAYOUT_REWRITE_PREPROC


def has_layout_rewrite_preproc(func: tirx.PrimFunc) -> bool:
    """Whether any block of ``func`` is a weight-packing (layout-rewrite preproc) block."""
    return any(
        LAYOUT_REWRITE_PREPROC in (getattr(node, "annotations", None) or {}) for node in tir_stmts(func)
    )


@tvm.transform.module_pass(opt_level=0, name="SplitLayoutRewritePreproc")
class SplitWeightPrepack:
    """``SplitLayoutRewritePreproc`` that leaves kernels without a packing block alone."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        aside = {
            gvar: func
            for gvar, func in mod.functions_items()
            if isinstance(func, tirx.PrimFunc) and not has_layout_rewrite_preproc(func)
        }
        if len(aside) == sum(isinstance(f, tirx.PrimFunc) for _, f in mod.functions_items()):
            return mod  # nothing to split
        work = tvm.IRModule({g: f for g, f in mod.functions_items() if g not in aside}, attrs=mod.attrs)
        work = relax.transform.SplitLayoutRewritePreproc()(work)
        for gvar, func in aside.items():
            work[gvar] = func
        return relax.transform.DeadCodeElimination()(work)

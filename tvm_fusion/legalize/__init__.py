"""Our legalizations, in one place: each goes in front of TVM's own and defers to it otherwise.

* ``nchwc_conv``: conv2d in the blocked ``NCHW{c}`` layouts ``RewriteLayout`` writes (TVM 0.27
  leaves them unlowered).
* ``fast_gelu``: float32 GELU with the vectorizable ``topi.fast_erf`` (switchable).
* ``fast_exp``: float32 exp / sigmoid / SiLU / tanh / tanh-GELU / softmax with ``topi.fast_exp`` and
  ``topi.fast_tanh`` (LLVM turns a vector ``exp`` into one ``expf`` call per lane; switchable), and
  ``power(x, c)`` for c in 1..4 as products.
* ``winograd_conv``: 3×3 stride-1 NCHW conv2d on LLVM CPUs as Winograd F(2×2,3×3) / F(4×4,3×3),
  where the pipeline's decision (``winograd_conv.conv_algorithms``) or the cost rule says so.
* ``depthwise_conv``: depthwise, narrow grouped and RGB-stem NCHW conv2d on LLVM CPUs with a
  polyphase padded input and whole output vectors (stride-2 windows without gathers).
* ``strided_pointwise_conv``: 1×1 NCHW conv2d with a stride on LLVM CPUs as a subsample stage and
  a stride-1 conv (a GEMM over the contiguous plane, no gathers).
* ``strassen_matmul``: large float32 matmuls by a constant weight on LLVM CPUs by one level of
  Strassen (7 block products instead of 8), where the size rule or the caller's choice says so.

:func:`register` installs them (the pipeline and ``RewriteLayout`` call it).

``LegalizeOps`` (and so ``tvm.compile``) looks up an op's ``FLegalize`` attribute. We register a
wrapper at a higher level that tries our lowering first and calls the stock one when ours returns
None. Registration is process-wide, so the wrappers only act inside :func:`enabled` (our pipeline
runs :class:`LegalizeOps`, which is ``relax.transform.LegalizeOps`` in that scope): a plain
``tvm.compile`` elsewhere in the same process lowers exactly as stock TVM. The one exception is the
``NCHW{c}`` conv, which stock TVM cannot lower at all. Registering twice is a no-op.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable

import tvm
from tvm import relax
from tvm.ir import Op

from . import (
    depthwise_conv,
    fast_exp,
    fast_gelu,
    nchwc_conv,
    strassen_matmul,
    strided_pointwise_conv,
    winograd_conv,
)

LEVEL = 21  # above TVM's own registrations (level 10)

_stock: dict[str, Callable] = {}  # op name -> TVM's own legalization, for every op we took over
_ENABLED: contextvars.ContextVar[bool] = contextvars.ContextVar("tvm_fusion_legalizations", default=False)


@contextlib.contextmanager
def enabled():
    """Within the block, ``LegalizeOps`` lowers with our legalizations (outside it, TVM's own)."""
    token = _ENABLED.set(True)
    try:
        yield
    finally:
        _ENABLED.reset(token)


@tvm.transform.module_pass(opt_level=0, name="LegalizeOps")
class LegalizeOps:
    """``relax.transform.LegalizeOps`` with our legalizations (registered if needed) in effect."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        register()
        with enabled():
            return relax.transform.LegalizeOps()(mod)


def override_legalization(op_name: str, try_legalize: Callable, always: bool = False) -> Callable:
    """Make ``try_legalize(bb, call)`` the first lowering of ``op_name`` inside :func:`enabled`
    (everywhere with ``always``); returning None defers to TVM's. Once per op and process (later
    calls are no-ops). Returns TVM's own legalization."""
    if op_name in _stock:
        return _stock[op_name]
    stock = Op.get(op_name).get_attr("FLegalize")

    def legalize(bb, call):
        result = try_legalize(bb, call) if always or _ENABLED.get() else None
        return stock(bb, call) if result is None else result

    tvm.ir.register_op_attr(op_name, "FLegalize", legalize, level=LEVEL)
    _stock[op_name] = stock
    return stock


def _legalize_conv2d(bb, call):
    """NCHW{c} convs our way (always: stock TVM cannot lower them); inside :func:`enabled`,
    eligible NCHW 3x3 convs as Winograd where chosen, depthwise and strided 1x1 convs our way;
    else None."""
    result = nchwc_conv.legalize_conv2d_nchwc(bb, call)
    if result is None and _ENABLED.get():
        result = winograd_conv.legalize_conv2d_winograd(bb, call)
    if result is None and _ENABLED.get():
        result = depthwise_conv.legalize_depthwise_conv2d(bb, call)
    if result is None and _ENABLED.get():
        result = strided_pointwise_conv.legalize_strided_pointwise_conv2d(bb, call)
    return result


def register() -> None:
    """Install every legalization of this package (idempotent)."""
    override_legalization("relax.nn.conv2d", _legalize_conv2d, always=True)
    override_legalization("relax.nn.gelu", fast_gelu.legalize_gelu_if_enabled)
    override_legalization("relax.matmul", strassen_matmul.legalize_matmul_strassen)
    for op_name, lower in fast_exp.lowerings().items():
        override_legalization(op_name, lower)


def stock_legalization(op_name: str) -> Callable:
    """TVM's own legalization of ``op_name``, whether or not ours is installed in front of it."""
    return _stock.get(op_name) or Op.get(op_name).get_attr("FLegalize")

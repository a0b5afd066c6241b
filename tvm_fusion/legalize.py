"""Legalization overrides: put our lowering of an op in front of TVM's, deferring to TVM's otherwise.

``LegalizeOps`` (and so ``tvm.compile``) looks up an op's ``FLegalize`` attribute. We register a
wrapper at a higher level that tries our lowering first and calls the stock one when ours returns
None, so modules that never use the new forms lower exactly as before. Registering twice is a no-op.
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm.ir import Op

LEVEL = 21  # above TVM's own registrations (level 10)


def override_legalization(op_name: str, try_legalize: Callable) -> Callable:
    """Make ``try_legalize(bb, call)`` the first lowering of ``op_name``; returning None defers to TVM's.

    Returns TVM's own legalization function (for tests and explicit fallbacks).
    """
    current = Op.get(op_name).get_attr("FLegalize")
    stock = getattr(current, "__tvm_fusion_stock__", current)
    if stock is not current:
        return stock  # already overridden (module re-imported)

    def legalize(bb, call):
        result = try_legalize(bb, call)
        return stock(bb, call) if result is None else result

    legalize.__tvm_fusion_stock__ = stock
    tvm.ir.register_op_attr(op_name, "FLegalize", legalize, level=LEVEL)
    return stock

"""Relax ops tvm_fusion adds: activations ONNX has and this TVM's Relax has not.

ONNX's ``HardSwish`` (MobileNetV3's activation, 19 of them in ``mobilenet_v3_small``) reaches
Relax as ``x * (clip(x + 3, 0, 6) / 6)``: ``x`` feeds two branches, so the unique-consumer rule
keeps the four ops out of the conv before them, and every HardSwish cost a kernel launch and a
round trip of the conv's output through memory. As one op (``CanonicalizeActivations`` rewrites
the pattern) it is a plain epilogue, like SiLU and GELU.

The op is registered with TVM's op registry from Python (type inference, purity, legalization);
its legalization computes exactly the frontend's arithmetic, so results are bit-identical. Its
builder is also put in ``relax.op.nn`` (which TVMScript's ``R.nn`` is), so a module holding it
prints and parses back like one with TVM's own ops. Such a module (TVMScript or JSON) loads only in
a process that imported tvm_fusion; compiled libraries do not contain the op and load anywhere.
"""

from __future__ import annotations

import tvm
from tvm import relax, te, tirx

from .ir import is_float_dtype

HARDSWISH = "relax.nn.hardswish"


def _same_type(call, _ctx):
    """A float tensor in, the same type out (an int HardSwish would divide by 6 in integers)."""
    if len(call.args) != 1:
        raise ValueError(f"{HARDSWISH} takes one tensor, got {len(call.args)} arguments")
    ty = call.args[0].ty
    if not isinstance(ty, relax.TensorType) or not is_float_dtype(ty.dtype):
        raise ValueError(f"{HARDSWISH} needs a floating-point tensor, got {ty}")
    return ty


def hardswish_te(x: te.Tensor) -> te.Tensor:
    """``x * (clip(x + 3, 0, 6) / 6)``, in the Relax ONNX frontend's order of operations."""
    dtype = x.dtype

    def value(*i):
        shifted = x(*i) + tirx.const(3, dtype)
        clipped = tirx.max(tirx.min(shifted, tirx.const(6, dtype)), tirx.const(0, dtype))
        return x(*i) * (clipped / tirx.const(6, dtype))

    return te.compute(x.shape, value, name="hardswish")


def _legalize_hardswish(bb: relax.BlockBuilder, call: relax.Call):
    return bb.call_te(hardswish_te, call.args[0], primfunc_name_hint="hardswish")


def hardswish(x: relax.Expr) -> relax.Call:
    """``R.nn.hardswish(x)``."""
    return relax.Call(tvm.ir.Op.get(HARDSWISH), [x])


def register() -> None:
    """Register the ops (idempotent; a TVM that has its own ``nn.hardswish`` keeps it)."""
    if HARDSWISH in tvm.ir._ffi_api.ListOpNames():  # pylint: disable=protected-access
        return
    tvm.ir.register_op_attr(HARDSWISH, "FInferType", _same_type)  # creates the op
    tvm.ir.register_op_attr(HARDSWISH, "FPurity", True)
    tvm.ir.register_op_attr(HARDSWISH, "FLegalize", _legalize_hardswish)
    if not hasattr(relax.op.nn, "hardswish"):
        relax.op.nn.hardswish = hardswish  # TVMScript's R.nn.hardswish


register()

"""FoldBatchNorm: fold inference ``R.nn.batch_norm`` into neighbouring constant-weight ops.

Inference batch norm is a per-channel affine map ``y = x*s + t`` with ``s = gamma/sqrt(var+eps)``
and ``t = beta - mean*s``. When the op next to it is linear in a constant weight, the map can be
absorbed into that weight, and the batch norm costs nothing at run time.

Runs on high-level Relax (before ``LegalizeOps``), e.g. straight after ONNX import. For every
``TupleGetItem(batch_norm(x, gamma, beta, mean, var), 0)`` with constant parameters and
``training=False`` it tries, in this order:

1. **Fold into the producer** of ``x`` (exact):
   ``conv{1,2,3}d(d, W)`` or ``conv(d, W) + per-channel constant`` (ONNX Conv-with-bias imports as
   ``add(conv, reshape(bias))``) with the BN axis equal to the conv's output-channel axis (read from
   ``out_layout``, so NHWC/axis=3 works when the kernel layout names an ``O`` axis; packed
   layouts such as ``NCHW4c`` are skipped), and ``matmul(d, W)`` / ``matmul(d, permute_dims(W))``
   (+ optional per-feature bias: ONNX MatMul+Add and Gemm ``transB=1``, which is what
   ``relax.op.linear`` also builds) with the BN over the last axis. Result:
   ``op(d, W*s) + (s*b + t)``; the Gemm form keeps its ``permute_dims`` over the new constant so
   later pattern passes still see a Gemm.
2. **Fold into the consumer**, when the BN output's only use is the data input of a conv with
   *zero padding* (any stride/dilation/groups) or of a ``matmul`` over the BN axis:
   ``conv(x*s + t, W) = conv(x, W*s[in]) + sum(W*t[in])``. With non-zero padding this is not exact
   (padded zeros would have to become ``t``), so padded convs are never folded this way.
3. **Otherwise lower to a per-channel multiply+add** with constant ``s``/``t`` (absorbing a
   preceding constant bias add), unless ``lower_unfoldable=False``. Legalized ``batch_norm`` keeps
   ``(x-mean)/sqrt(var+eps)*gamma+beta`` per element; the affine form is two cheap broadcast ops
   that ``FuseOps`` fuses into the producer's epilogue.

A ``multiply`` by a constant per last-axis feature (a scalar included) after a constant-weight
``matmul`` (+ bias) is the same affine map with ``t = 0`` and folds into it by step 1 (OPT's and
BART's ``q_proj(h) * scaling``); a multiply that does not fold stays.

Multi-consumer safety: we never duplicate a producer. If the conv/matmul output (or its bias add)
has any consumer besides the batch norm, step 1 is skipped and the BN is lowered by step 3 instead,
so other consumers keep reading the original, untouched producer. Duplicating would pay a whole
extra conv/matmul to save one fusible elementwise op.

Folded weights are computed in float64 numpy and cast back to the weight dtype (fp16 safe), and
emitted as single constants (no multiply chain is left for ``FoldConstant``). Anything non-constant
(weights as function parameters, BN params), training-mode BN, bindings outside dataflow blocks, and
primitive functions are left untouched. The pass is idempotent.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from ..ir import constant_value, dtype_of, graph_functions, named_shape, op_name, with_functions

__all__ = ["FoldBatchNorm"]

_BN = "relax.nn.batch_norm"
_CONVS = {"relax.nn.conv1d": 1, "relax.nn.conv2d": 2, "relax.nn.conv3d": 3}
_MATMUL = "relax.matmul"
_ADD = "relax.add"
_PERMUTE = "relax.permute_dims"
_MULTIPLY = "relax.multiply"
_MAX_ROUNDS = 16


@tvm.transform.module_pass(opt_level=0, name="FoldBatchNorm")
class FoldBatchNorm:
    """Fold inference batch_norm into adjacent constant conv/matmul weights (see module docstring).

    Parameters
    ----------
    lower_unfoldable : bool
        Rewrite a BN with constant params but no foldable neighbour into a per-channel
        ``multiply`` + ``add`` (default); ``False`` leaves such BNs as they are.
    """

    def __init__(self, lower_unfoldable: bool = True):
        self.lower_unfoldable = lower_unfoldable

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        updates = {}
        for gvar, func in graph_functions(mod):
            new_func = _fold_function(func, self.lower_unfoldable)
            if new_func is not func:
                updates[gvar] = new_func
        return with_functions(mod, updates)


# -- driver -----------------------------------------------------------------------------------
def _fold_function(func: relax.Function, lower_unfoldable: bool) -> relax.Function:
    """Plan non-conflicting rewrites, apply them, drop the dead BNs; repeat (chains like
    BN -> conv -> BN need a second round, because one round never looks through a rewritten var).
    Every round that plans anything removes a BN or a constant scale, so the rounds end; past
    ``_MAX_ROUNDS`` (a chain of that many BNs / scales, one folded per round) the rest stays
    unfolded, which is correct, only slower."""
    for _ in range(_MAX_ROUNDS):
        if not _has_candidates(func):
            break
        plans = _Planner(func, lower_unfoldable).plan()
        if not plans:
            break
        func = relax.analysis.remove_all_unused(_Rewriter(plans).visit_expr(func))
    return func  # the same object when nothing was planned


def _has_candidates(func: relax.Function) -> bool:
    """A BN or a multiply (a scale to fold, maybe) in ``func``: otherwise no planning at all."""
    return any(op_name(val) in (_BN, _MULTIPLY) for val in relax.analysis.get_var2val(func).values())


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    """Rebind each planned var to its new value (same var, same type); nested calls in the new
    value are emitted as their own bindings by the block builder's normalizer."""

    def __init__(self, plans: dict):
        super().__init__()
        self.plans = plans

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        new = self.plans.get(binding.var)
        if new is None:
            super().visit_var_binding_(binding)
            return
        value = self.visit_expr(new)
        self.builder_.emit_normalized(relax.VarBinding(binding.var, value))


# -- helpers ----------------------------------------------------------------------------------


def _is_float(dtype: str | None) -> bool:
    return dtype is not None and (dtype.startswith("float") or dtype.startswith("bfloat"))


def _out_dtype_ok(call, dtype: str) -> bool:
    out = getattr(call.attrs, "out_dtype", None)
    return out is None or str(out) in ("", "void", dtype)


def _simple_layout(layout: str) -> bool:
    return layout.isalpha() and layout.isupper() and len(set(layout)) == len(layout)


def _channel_shape(ndim: int, axis: int, c: int) -> tuple:
    shape = [1] * ndim
    shape[axis] = c
    return tuple(shape)


def _const(array: np.ndarray, dtype: str) -> relax.Expr:
    return relax.const(np.ascontiguousarray(array).astype(dtype), dtype)


def _to_oi(w: np.ndarray, layout: str) -> tuple[np.ndarray, list]:
    """Transpose a kernel to (O, I, *spatial) order; also return the permutation used."""
    perm = [layout.index("O"), layout.index("I")] + [i for i, ch in enumerate(layout) if ch not in "OI"]
    return w.transpose(perm), perm


def _from_oi(w: np.ndarray, perm: list) -> np.ndarray:
    return w.transpose(np.argsort(perm))


class _Planner:
    """Finds rewrites for one function. ``plan()`` returns {var: new value expr}.

    Invariants: a var whose binding is rewritten ("replaced") is never looked through by another
    plan in the same round, and a var looked through is never replaced; vars are only *referenced*
    across plans, which is always safe because a rewrite keeps each var's value."""

    def __init__(self, func: relax.Function, lower_unfoldable: bool):
        self.func = func
        self.lower_unfoldable = lower_unfoldable
        self.var2val = relax.analysis.get_var2val(func)
        self.users: dict = {}
        self.dataflow_bindings = []
        body = func.body
        blocks = body.blocks if isinstance(body, relax.SeqExpr) else []
        for block in blocks:
            for var, users in relax.analysis.udchain(block).items():
                self.users.setdefault(var, []).extend(users)
            if isinstance(block, relax.DataflowBlock):
                self.dataflow_bindings.extend(block.bindings)
        # Vars that escape (returned) get a pseudo-user, so they never count as single-use.
        result = body.body if isinstance(body, relax.SeqExpr) else body
        for var in relax.analysis.free_vars(result):
            self.users.setdefault(var, []).append(None)
        self.dataflow_vars = {b.var for b in self.dataflow_bindings}
        self.replaced: set = set()
        self.looked: set = set()
        self.plans: dict = {}

    # -- utilities ------------------------------------------------------------------------
    def _users(self, var) -> list:
        return self.users.get(var, [])

    def _only_user_is(self, var, user) -> bool:
        us = self._users(var)
        return len(us) == 1 and us[0] is not None and us[0].same_as(user)

    def _value(self, var):
        """The bound value of a dataflow var we may look through, else None."""
        if not isinstance(var, relax.Var) or var in self.replaced or var not in self.dataflow_vars:
            return None
        return self.var2val.get(var)

    def const_value(self, expr) -> np.ndarray | None:
        """The value of a constant expression, not looking through vars being rewritten."""
        return constant_value(expr, self.var2val, hidden=self.replaced)

    def channel_vector(self, expr, out_shape: tuple, axis: int) -> np.ndarray | None:
        """A constant that, broadcast against ``out_shape``, varies only along ``axis``: its
        per-channel vector (float64), else None. Must not widen the result's shape."""
        val = self.const_value(expr)
        if val is None or val.ndim > len(out_shape):
            return None
        full = val.reshape((1,) * (len(out_shape) - val.ndim) + val.shape)
        c = out_shape[axis]
        for i, d in enumerate(full.shape):
            if i != axis and d != 1:
                return None
        if full.shape[axis] not in (1, c):
            return None
        return np.broadcast_to(full.reshape(-1).astype(np.float64), (c,)).copy()

    # -- planning -------------------------------------------------------------------------
    def plan(self) -> dict:
        for binding in self.dataflow_bindings:
            if not isinstance(binding, relax.VarBinding):
                continue
            if op_name(binding.value) == _BN:
                self._plan_bn(binding.var, binding.value)
            elif op_name(binding.value) == _MULTIPLY:
                self._plan_scale(binding.var, binding.value)
        return self.plans

    def _plan_scale(self, y, mul) -> None:
        """``y = x * c``, ``c`` constant per last-axis feature (a scalar included), folded into
        the constant-weight matmul (+ bias) that computes ``x``: OPT's and BART's
        ``q_proj(h) * scaling``, which otherwise stays a copy kernel between the Q/K/V GEMM and
        the attention. Only that fold (step 1); any other multiply is left as it is."""
        if y in self.replaced or y in self.looked:
            return
        for x, c in ((mul.args[0], mul.args[1]), (mul.args[1], mul.args[0])):
            if not isinstance(x, relax.Var) or self._touches_replaced(x):
                continue
            shape, dtype = named_shape(x), dtype_of(x)
            if (
                shape is None
                or not _is_float(dtype)
                or named_shape(y) != shape
                or not isinstance(shape[-1], int)
            ):
                continue
            s = self.channel_vector(c, shape, len(shape) - 1)
            if s is not None and self._fold_into_producer(
                y, y, x, len(shape) - 1, shape, dtype, s, np.zeros_like(s)
            ):
                return

    def _plan_bn(self, bn_var, bn) -> None:
        attrs = bn.attrs
        if bool(attrs.training) or bn_var in self.replaced or bn_var in self.looked:
            return
        x = bn.args[0]
        if self._touches_replaced(x):
            return  # its input is rewritten this round: plan it next round, on the new IR
        shape, dtype = named_shape(x), dtype_of(x)
        if shape is None or not _is_float(dtype):
            return
        axis = int(attrs.axis)
        axis = axis + len(shape) if axis < 0 else axis
        if not 0 <= axis < len(shape) or not isinstance(shape[axis], int):
            return
        c = shape[axis]
        params = [self.const_value(a) for a in bn.args[1:5]]
        if any(p is None or p.shape != (c,) for p in params):
            return
        gamma, beta, mean, var = (p.astype(np.float64) for p in params)
        if not bool(attrs.scale):
            gamma = np.ones(c)
        if not bool(attrs.center):
            beta = np.zeros(c)
        s = gamma / np.sqrt(var + float(attrs.epsilon))
        t = beta - mean * s

        # The tuple may only be read through TupleGetItem bindings in dataflow blocks.
        items = {0: [], 1: [], 2: []}
        for user in self._users(bn_var):
            val = self._value(user) if user is not None else None
            if not isinstance(val, relax.TupleGetItem) or not val.tuple_value.same_as(bn_var):
                return
            items[int(val.index)].append(user)
        if len(items[0]) != 1 or any(
            v in self.looked or v in self.replaced for vs in items.values() for v in vs
        ):
            return
        y = items[0][0]

        done = (
            self._fold_into_producer(bn_var, y, x, axis, shape, dtype, s, t)
            or self._fold_into_consumer(y, x, axis, shape, dtype, s, t)
            or (self.lower_unfoldable and self._lower_affine(bn_var, y, x, axis, shape, dtype, s, t))
        )
        if done:
            # training=False: items 1 and 2 are the moving mean / var unchanged.
            for idx, arg in ((1, bn.args[3]), (2, bn.args[4])):
                for v in items[idx]:
                    self.plans[v] = arg
                    self.replaced.add(v)
            self.looked.add(bn_var)

    def _touches_replaced(self, x) -> bool:
        if x in self.replaced:
            return True
        val = self.var2val.get(x) if isinstance(x, relax.Var) else None
        return op_name(val) == _ADD and any(a in self.replaced for a in val.args)

    def _split_bias(self, bn_var, x, axis, shape):
        """If x = add(z, per-channel const) used only by the BN, return (z, bias, add_var)."""
        val = self._value(x)
        if op_name(val) != _ADD or not self._only_user_is(x, bn_var) or x in self.looked:
            return x, np.zeros(shape[axis]), None
        for z, b in ((val.args[0], val.args[1]), (val.args[1], val.args[0])):
            if not isinstance(z, relax.Var) or named_shape(z) != shape or dtype_of(z) != dtype_of(x):
                continue
            vec = self.channel_vector(b, shape, axis)
            if vec is not None:
                return z, vec, x
        return x, np.zeros(shape[axis]), None

    def _fold_into_producer(self, bn_var, y, x, axis, shape, dtype, s, t) -> bool:
        z, bias, add_var = self._split_bias(bn_var, x, axis, shape)
        consumer = add_var if add_var is not None else bn_var
        prod = self._value(z)
        if prod is None or z in self.looked or not self._only_user_is(z, consumer):
            return False
        name = op_name(prod)
        new_bias = s * bias + t
        if name in _CONVS:
            new_op = self._scaled_conv(prod, axis, len(shape), dtype, s)
        elif name == _MATMUL and axis == len(shape) - 1:
            new_op = self._scaled_matmul(prod, dtype, s)
        else:
            return False
        if new_op is None:
            return False
        self.looked.update(v for v in (z, add_var) if v is not None)
        bias_shape = _channel_shape(len(shape), axis, shape[axis]) if name in _CONVS else (shape[axis],)
        self.plans[y] = relax.op.add(new_op, _const(new_bias.reshape(bias_shape), dtype))
        self.replaced.add(y)
        return True

    def _scaled_conv(self, conv, axis, ndim, dtype, s):
        attrs = conv.attrs
        data, weight = conv.args
        k_layout, o_layout = str(attrs.kernel_layout), str(attrs.out_layout or attrs.data_layout)
        if not (_simple_layout(k_layout) and _simple_layout(o_layout)) or "O" not in k_layout:
            return None
        if len(o_layout) != ndim or o_layout.find("C") != axis or not _out_dtype_ok(conv, dtype):
            return None
        w = self.const_value(weight)
        if w is None or dtype_of(weight) != dtype or w.shape[k_layout.index("O")] != s.shape[0]:
            return None
        scale_shape = [1] * w.ndim
        scale_shape[k_layout.index("O")] = s.shape[0]
        new_w = w.astype(np.float64) * s.reshape(scale_shape)
        return relax.Call(conv.op, [data, _const(new_w, dtype)], attrs)

    def _scaled_matmul(self, mm, dtype, s):
        data, weight = mm.args
        if not _out_dtype_ok(mm, dtype) or dtype_of(weight) != dtype:
            return None
        wval = self._value(weight) if isinstance(weight, relax.Var) else None
        if op_name(wval) == _PERMUTE:  # Gemm transB / linear: keep the permute over a new const
            w0 = self.const_value(wval.args[0])
            axes = wval.attrs.axes
            if w0 is not None and w0.ndim == 2 and (axes is None or [int(a) for a in axes] == [1, 0]):
                if w0.shape[0] != s.shape[0]:
                    return None
                new_w0 = w0.astype(np.float64) * s[:, None]
                return relax.op.matmul(data, relax.op.permute_dims(_const(new_w0, dtype), [1, 0]))
        w = self.const_value(weight)
        if w is None or w.ndim < 2 or w.shape[-1] != s.shape[0]:
            return None
        return relax.op.matmul(data, _const(w.astype(np.float64) * s, dtype))

    def _fold_into_consumer(self, y, x, axis, shape, dtype, s, t) -> bool:
        us = self._users(y)
        if len(us) != 1 or us[0] is None:
            return False
        z = us[0]
        op = self._value(z)
        if (
            not isinstance(op, relax.Call)
            or z in self.looked
            or z in self.replaced
            or not op.args
            or not op.args[0].same_as(y)
        ):
            return False
        if any(a.same_as(y) for a in op.args[1:]):
            return False
        name = op_name(op)
        if name in _CONVS:
            new = self._conv_absorbing_input(op, x, axis, len(shape), dtype, s, t)
        elif name == _MATMUL and axis == len(shape) - 1 and len(shape) >= 1:
            new = self._matmul_absorbing_input(op, x, dtype, s, t)
        else:
            return False
        if new is None:
            return False
        self.plans[z] = new
        self.replaced.add(z)
        self.looked.add(y)
        return True

    def _conv_absorbing_input(self, conv, x, axis, ndim, dtype, s, t):
        attrs = conv.attrs
        weight = conv.args[1]
        d_layout, k_layout = str(attrs.data_layout), str(attrs.kernel_layout)
        o_layout = str(attrs.out_layout or attrs.data_layout)
        if not all(_simple_layout(lay) for lay in (d_layout, k_layout, o_layout)):
            return None
        if not {"O", "I"} <= set(k_layout) or d_layout.find("C") != axis or len(d_layout) != ndim:
            return None
        if any(int(p) != 0 for p in attrs.padding) or not _out_dtype_ok(conv, dtype):
            return None  # padded zeros would need the shift too: not exact, leave it
        w = self.const_value(weight)
        out_shape = named_shape(conv)
        if w is None or dtype_of(weight) != dtype or out_shape is None:
            return None
        w_oi, perm = _to_oi(w.astype(np.float64), k_layout)
        cout, ipg = w_oi.shape[0], w_oi.shape[1]
        groups = int(attrs.groups)
        if ipg * groups != s.shape[0] or cout % groups:
            return None
        # input channel feeding W[o, j] is group(o) * ipg + j
        in_ch = (np.arange(cout) // (cout // groups))[:, None] * ipg + np.arange(ipg)[None, :]
        bshape = (cout, ipg) + (1,) * (w_oi.ndim - 2)
        new_w = _from_oi(w_oi * s[in_ch].reshape(bshape), perm)
        bias = (w_oi * t[in_ch].reshape(bshape)).reshape(cout, -1).sum(axis=1)
        o_axis = o_layout.find("C")
        if o_axis < 0:
            return None
        new_conv = relax.Call(conv.op, [x, _const(new_w, dtype)], attrs)
        return relax.op.add(
            new_conv, _const(bias.reshape(_channel_shape(len(out_shape), o_axis, cout)), dtype)
        )

    def _matmul_absorbing_input(self, mm, x, dtype, s, t):
        weight = mm.args[1]
        if not _out_dtype_ok(mm, dtype) or dtype_of(weight) != dtype:
            return None
        w = self.const_value(weight)
        if w is None or w.ndim != 2 or w.shape[0] != s.shape[0]:
            return None
        w = w.astype(np.float64)
        return relax.op.add(relax.op.matmul(x, _const(w * s[:, None], dtype)), _const(t @ w, dtype))

    def _lower_affine(self, bn_var, y, x, axis, shape, dtype, s, t) -> bool:
        z, bias, add_var = self._split_bias(bn_var, x, axis, shape)
        if add_var is not None:
            self.looked.add(add_var)
        cshape = _channel_shape(len(shape), axis, shape[axis])
        scaled = relax.op.multiply(z, _const(s.reshape(cshape), dtype))
        self.plans[y] = relax.op.add(scaled, _const((s * bias + t).reshape(cshape), dtype))
        self.replaced.add(y)
        return True

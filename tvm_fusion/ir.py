"""Small Relax IR helpers shared by the passes (one definition each, one meaning each)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import tvm
from tvm import relax
from tvm.ir import Op


def op_name(expr) -> str | None:
    """``"relax.nn.conv2d"`` for a call of a Relax operator, None for anything else."""
    return expr.op.name if isinstance(expr, relax.Call) and isinstance(expr.op, Op) else None


def op_calls(func: relax.Function, names) -> list[relax.Call]:
    """Every call in ``func`` of a Relax operator named in ``names``, in post order."""
    calls = []

    def visit(expr):
        if op_name(expr) in names:
            calls.append(expr)

    relax.analysis.post_order_visit(func.body, visit)
    return calls


def tensor_type(expr) -> relax.TensorType | None:
    ty = getattr(expr, "ty", None)
    return ty if isinstance(ty, relax.TensorType) else None


def shape_dims(expr) -> tuple[int | None, ...] | None:
    """The shape with symbolic dims as None; None when even the rank is unknown."""
    ty = tensor_type(expr)
    if ty is None or not isinstance(ty.shape, relax.ShapeExpr):
        return None
    return tuple(int(d) if isinstance(d, tvm.tirx.IntImm) else None for d in ty.shape.values)


def static_shape(expr) -> tuple[int, ...] | None:
    """The shape when every dim is a known integer, else None."""
    dims = shape_dims(expr)
    return None if dims is None or any(d is None for d in dims) else dims


def int_values(expr) -> list[int]:
    """The integers of a ``relax.Tuple`` of ``PrimValue`` s or a ``ShapeExpr`` (a ``strided_slice``'s
    axes and bounds); raises where one is not a constant."""
    fields = expr.fields if isinstance(expr, relax.Tuple) else expr.values
    return [int(getattr(v, "value", v)) for v in fields]  # IntImm, or a PrimValue holding one


def static_slice(call: relax.Call) -> tuple[int, int, int] | None:
    """``(axis, start, stop)`` of a static, one-axis, stride-1 ``strided_slice`` (axis and a
    negative start normalised, the stop from the output's extent), or None."""
    shape, out = static_shape(call.args[0]), static_shape(call)
    if shape is None or out is None or len(call.args) < 4:
        return None
    try:
        axes, begin = int_values(call.args[1]), int_values(call.args[2])
        strides = int_values(call.args[4]) if len(call.args) > 4 and call.args[4] is not None else [1]
    except (TypeError, ValueError, AttributeError):  # run-time bounds
        return None
    if len(axes) != 1 or set(strides) != {1}:
        return None
    axis = axes[0] % len(shape)
    start = min(max(begin[0] + shape[axis] if begin[0] < 0 else begin[0], 0), shape[axis])
    return axis, start, start + out[axis]


def is_float_dtype(dtype) -> bool:
    """float16/32/64 or bfloat16 (``np.dtype`` does not know bfloat16)."""
    return str(dtype).startswith(("float", "bfloat"))


def dtype_of(expr) -> str | None:
    ty = tensor_type(expr)
    return None if ty is None else str(ty.dtype)


def is_primitive(func) -> bool:
    """A function that is one kernel already (``Primitive``) or belongs to an external codegen:
    graph passes leave it alone."""
    attrs = getattr(func, "attrs", None)
    if attrs is None:
        return False
    return ("Primitive" in attrs.keys() and int(attrs["Primitive"]) != 0) or "Codegen" in attrs.keys()


def graph_functions(mod: tvm.IRModule) -> Iterator[tuple[relax.GlobalVar, relax.Function]]:
    """The Relax functions a graph pass rewrites: every one that is not primitive, by name order."""
    for gvar in sorted(mod.functions.keys(), key=lambda g: g.name_hint):
        func = mod[gvar]
        if isinstance(func, relax.Function) and not is_primitive(func):
            yield gvar, func


def rewrite_functions(mod: tvm.IRModule, names, applies, rewriter) -> tvm.IRModule:
    """``mod`` with every graph function that calls an operator in ``names`` for which
    ``applies(call)`` holds visited by ``rewriter(mod)`` (a ``PyExprMutator``); the others, and
    ``mod`` itself when nothing applies, are left as they are."""
    updates = {
        gvar: rewriter(mod).visit_expr(func)
        for gvar, func in graph_functions(mod)
        if any(applies(call) for call in op_calls(func, names))
    }
    return with_functions(mod, updates)


def rewrite_and_prune(mod: tvm.IRModule, needs, make_rewriter) -> tvm.IRModule:
    """``mod`` with every graph function for which ``needs(func)`` holds visited by
    ``make_rewriter(func)`` (a ``PyExprMutator`` that sets ``rewrote`` when it changes something),
    the bindings the rewrite left unused then removed; the other functions, and ``mod`` itself when
    nothing changed, are left as they are."""
    updates = {}
    for gvar, func in graph_functions(mod):
        if not needs(func):
            continue
        rewriter = make_rewriter(func)
        rewritten = rewriter.visit_expr(func)
        if rewriter.rewrote:
            updates[gvar] = relax.analysis.remove_all_unused(rewritten)
    return with_functions(mod, updates)


def with_bindings(func: relax.Function, replace: dict) -> relax.Function:
    """``func`` with the values bound to the vars in ``replace`` swapped for the new ones; the vars,
    and so every use of them, are kept."""
    blocks = [
        type(block)(
            [relax.VarBinding(b.var, replace[b.var]) if b.var in replace else b for b in block.bindings]
        )
        for block in func.body.blocks
    ]
    return relax.Function(
        func.params, relax.SeqExpr(blocks, func.body.body), func.ret_ty, func.is_pure, func.attrs
    )


def with_functions(mod: tvm.IRModule, updates: dict) -> tvm.IRModule:
    """``mod`` with ``updates`` (global var -> function) put in; ``mod`` itself when there are none."""
    if not updates:
        return mod
    mod = mod.clone()
    for gvar, func in updates.items():
        mod[gvar] = func
    return mod


def named_shape(expr) -> tuple[int | str, ...] | None:
    """The shape with symbolic dims as their names (two tensors with the same symbolic batch
    compare equal); None when the shape is unknown or has a computed dim."""
    ty = tensor_type(expr)
    if ty is None or not isinstance(ty.shape, relax.ShapeExpr):
        return None
    dims: list[int | str] = []
    for d in ty.shape.values:
        if isinstance(d, tvm.tirx.IntImm):
            dims.append(int(d))
        elif isinstance(d, tvm.tirx.Var):
            dims.append(d.name)
        else:
            return None
    return tuple(dims)


def tir_stmts(root) -> Iterator:
    """Every statement under ``root`` (a PrimFunc or a Stmt), the root included; this TVM has no
    ``stmt_functor.post_order_visit``."""
    stack = [root.body if isinstance(root, tvm.tirx.PrimFunc) else root]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, tvm.tirx.SeqStmt):
            stack.extend(node.seq)
            continue
        for name in ("body", "block", "init", "then_case", "else_case"):
            child = getattr(node, name, None)
            if isinstance(child, tvm.tirx.Stmt):
                stack.append(child)


class UseCountingMutator(relax.PyExprMutator):
    """A mutator that knows how many bindings read each var (``count_uses`` of the function it
    rewrites), for rewrites that may only replace a value nothing else reads. Subclasses set
    ``rewrote`` when they change something."""

    def __init__(self, mod: tvm.IRModule, uses: dict):
        super().__init__(mod)
        self.uses = uses
        self.rewrote = False

    def single_use_binding(self, expr):
        """The value bound to ``expr`` if it is a var exactly one binding reads, else None."""
        if not isinstance(expr, relax.Var) or self.uses.get(expr, 0) != 1:
            return None
        return self.lookup_binding(expr)


def binding_users(func: relax.Function) -> dict[relax.Var, list[relax.Var]]:
    """For each var, the vars of the bindings (of ``func``'s own blocks) that read it."""
    users: dict[relax.Var, list[relax.Var]] = {}
    for block in func.body.blocks:
        for binding in block.bindings:
            for var in relax.analysis.free_vars(binding.value):
                users.setdefault(var, []).append(binding.var)
    return users


def count_uses(func: relax.Function) -> dict[relax.Var, int]:
    """How many bindings (plus the function result) read each var."""
    uses: dict[relax.Var, int] = {}
    exprs = [b.value for block in func.body.blocks for b in block.bindings] + [func.body.body]
    for expr in exprs:
        for var in relax.analysis.free_vars(expr):
            uses[var] = uses.get(var, 0) + 1
    return uses


_CONSTANT_VIEWS = ("relax.reshape", "relax.permute_dims", "relax.astype")
_MAX_LOOKUPS = 8  # vars and views followed from an expression to its constant


def is_constant(expr) -> bool:
    """A Relax tensor constant (not a var bound to one)."""
    return isinstance(expr, tvm.ir.GenericConst)


def constant_value(expr, var2val=None, hidden=(), _depth: int = 0) -> np.ndarray | None:
    """The value of a constant expression: a constant, or a var bound to one, also through
    reshapes, permute_dims and casts of one (the frontend reshapes some constants, e.g.
    InstanceNormalization's scale to ``[-1, 1]``, and ``FoldConstant`` may not have run yet).
    None for anything else, for vars in ``hidden`` (bindings being rewritten) and for payloads
    numpy cannot hold."""
    if _depth >= _MAX_LOOKUPS:
        return None
    if isinstance(expr, relax.Var):
        if expr in hidden:
            return None
        return constant_value((var2val or {}).get(expr), var2val, hidden, _depth + 1)
    if is_constant(expr):
        try:
            return expr.value.numpy()
        except Exception:  # not a tensor payload numpy can hold
            return None
    name = op_name(expr)
    if name not in _CONSTANT_VIEWS:
        return None
    inner = constant_value(expr.args[0], var2val, hidden, _depth + 1)
    shape = static_shape(expr)
    if inner is None or shape is None:
        return None
    if name == "relax.reshape":
        return inner.reshape(shape)
    if name == "relax.permute_dims":
        axes = expr.attrs.axes
        return np.transpose(inner, None if axes is None else [int(a) for a in axes])
    return inner.astype(dtype_of(expr))


def scalar_value(expr, var2val=None) -> float | None:
    """A one-element constant expression (see :func:`constant_value`) as a float, else None."""
    value = constant_value(expr, var2val)
    return float(value.reshape(())) if value is not None and value.size == 1 else None


class BindingChain:
    """Walks single-use chains of bindings forward from a var (the exporter spellings that
    recognizer passes turn back into one op)."""

    def __init__(self, func: relax.Function):
        self.var2val = relax.analysis.get_var2val(func)
        self.uses = count_uses(func)
        self.users = binding_users(func)

    def call(self, var, name):
        """The ``relax.<name>`` call bound to ``var``, else None."""
        value = self.var2val.get(var) if isinstance(var, relax.Var) else None
        return value if op_name(value) == f"relax.{name}" else None

    def only_user(self, var):
        """The one binding that reads ``var`` (None if several or none, or the function result)."""
        users = self.users.get(var, [])
        return users[0] if self.uses.get(var, 0) == 1 and len(users) == 1 else None


def replace_matches(mod: tvm.IRModule, anchor_op: str, match, chain_type=BindingChain) -> tvm.IRModule:
    """The recognizer passes' rewrite: in each graph function, for every binding of an
    ``anchor_op`` call, ``match(chain, var)`` returns None or ``(y, call)``, and the binding of
    ``y`` becomes ``call`` where ``call``'s first argument is visible there (bound in y's block, or
    not a DataflowVar); the bindings only the old spelling read are then removed."""
    updates = {}
    for gvar, func in graph_functions(mod):
        if not isinstance(func.body, relax.SeqExpr):
            continue
        chain = chain_type(func)
        replace = {}
        for block in func.body.blocks:
            local = {b.var for b in block.bindings}
            for b in block.bindings:
                if op_name(b.value) == anchor_op and (hit := match(chain, b.var)) is not None:
                    y, call = hit
                    x = call.args[0]
                    if y in local and (x in local or not isinstance(x, relax.DataflowVar)):
                        replace[y] = call
        if replace:
            updates[gvar] = with_bindings(func, replace)
    if not updates:
        return mod
    mod = with_functions(mod, updates)
    return relax.transform.DeadCodeElimination()(relax.transform.Normalize()(mod))


def is_pointwise_conv(conv) -> bool:
    """A plain float 1x1 conv2d in NCHW / OIHW: every output pixel from its own input pixel, in the
    dtype it reads (an int8 conv accumulating in int32 cannot average its input first)."""
    if op_name(conv) != "relax.nn.conv2d":
        return False
    dtype = dtype_of(conv.args[0])
    if not is_float_dtype(dtype) or dtype_of(conv) != dtype:
        return False
    a = conv.attrs
    weight = static_shape(conv.args[1])
    return (
        weight is not None
        and weight[2:] == (1, 1)
        and all(int(s) == 1 for s in a.strides)
        and all(int(p) == 0 for p in a.padding)
        and (str(a.data_layout), str(a.kernel_layout), str(a.out_layout)) == ("NCHW", "OIHW", "NCHW")
    )


def reads_pieces_in_place(call) -> bool:
    """Whether a reader of a concat can take it in front with the pieces read in place: a pool
    (``WindowReduction`` computes its rows per output row), or a plain ungrouped 1x1 conv
    (``Contraction`` loops over the pieces apart). Other convs' schedules (Winograd, depthwise,
    direct KxK) would write the joined tensor inside their kernel, or leave it unscheduled."""
    if op_name(call) in ("relax.nn.max_pool2d", "relax.nn.avg_pool2d"):
        return True
    return is_pointwise_conv(call) and int(call.attrs.groups) == 1

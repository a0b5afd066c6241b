"""Where a fused attention's Q, K and V come from: columns of one packed projection.

Horizontal fusion makes Q, K and V one GEMM (``x . [Wq Wk Wv]``), and the exporters' own packed
projections (GPT-2's ``c_attn``, ViT's ``in_proj``) are one to begin with; a ``split`` (or three
``strided_slice`` s) along the last axis then copies each third out, and reshapes make it
``(batch, seq, heads, head_dim)``. That copy is a kernel per layer which writes and reads the
whole projection once more (about 1 % of BERT). The CPU attention kernel repacks its inputs
per head anyway, so it can read them from the projection directly:
:meth:`PackedInputs.column_view` finds, for an attention input, the tensor it was cut from and
the columns it holds, looking through reshapes (which keep row-major order), transposes that
are undone again, ``split`` / ``strided_slice`` along the last axis, and the Primitive
functions the fusion policy made of such ops.
"""

from __future__ import annotations

import dataclasses
import math

import tvm
from tvm import relax

from ..ir import is_primitive, op_name, static_shape, static_slice

_MAX_DEPTH = 16  # producers walked per input (a few reshapes and one cut in practice)


@dataclasses.dataclass(frozen=True)
class ColumnView:
    """An attention input ``(B, S, N, D)`` read as columns ``[offset, offset + N*D)`` of a tensor
    of ``shape`` whose leading axes hold ``B*S`` rows. A reshape keeps row-major order, so token
    ``(b, s)`` is row ``b*S + s`` of the cut whatever the leading axes are: ``(B, S)``, or
    ``(S, 1)`` for a ViT's sequence-first ``in_proj`` output."""

    shape: tuple[int, ...]
    offset: int

    def index(self, row, column) -> list:
        """The source index of token ``row`` (``b*S + s``), column ``column`` of the cut."""
        index = []
        for dim in reversed(self.shape[:-1]):
            index.insert(0, row % dim if dim > 1 else 0)
            row = row // dim
        return [*index, self.offset + column]


@dataclasses.dataclass(frozen=True)
class _Cut:
    source: relax.Expr
    offset: int
    columns: int


class PackedInputs:
    """Finds the packed projections that attention inputs bound in ``block`` were cut from.

    Only bindings of that block are walked, so a source found is in scope at the attention."""

    def __init__(self, mod: tvm.IRModule, block: relax.BindingBlock):
        self.mod = mod
        self.values = _bindings([block])

    def column_view(self, expr, shape: tuple[int, ...]) -> tuple[relax.Expr, ColumnView] | None:
        """``(source, view)`` when ``expr`` (of static ``shape`` ``(B, S, N, D)``) is a row-major
        view of columns of a tensor with ``B*S`` rows, cut along its last axis; else None."""
        cut = _cut(expr, self.values, self.mod, depth=0)
        if cut is None:
            return None
        source_shape = static_shape(cut.source)
        b, s, n, d = shape
        if source_shape is None or math.prod(source_shape[:-1]) != b * s or cut.columns != n * d:
            return None
        return cut.source, ColumnView(tuple(int(x) for x in source_shape), cut.offset)


def _bindings(blocks) -> dict:
    return {b.var: b.value for block in blocks for b in block.bindings if isinstance(b, relax.VarBinding)}


def _cut(expr, values: dict, mod, depth: int, caller: tuple | None = None) -> _Cut | None:
    """The last-axis cut ``expr`` is a reshaped view of, walking through reshapes (and into the
    Primitive functions that hold them: ``caller`` is ``(params -> args, the caller's values)``
    inside one)."""
    if depth > _MAX_DEPTH or not isinstance(expr, relax.Var):
        return None
    if caller is not None and expr in caller[0]:  # a parameter: go on with the caller's argument
        return _cut(caller[0][expr], caller[1], mod, depth + 1)
    if expr not in values:
        return None
    value = values[expr]
    name = op_name(value)
    if name == "relax.reshape":
        return _cut(value.args[0], values, mod, depth + 1, caller)
    if name == "relax.permute_dims":
        undone = _undone_permute(value, values)
        return None if undone is None else _cut(undone, values, mod, depth + 1, caller)
    if name == "relax.strided_slice":
        return _slice_cut(value)
    if isinstance(value, relax.TupleGetItem):
        return _split_cut(values.get(value.tuple_value), int(value.index))
    if caller is None and isinstance(value, relax.Call) and isinstance(value.op, relax.GlobalVar):
        return _cut_in_function(mod.functions.get(value.op), list(value.args), values, mod, depth)
    return None


def _undone_permute(call: relax.Call, values: dict):
    """``x`` when ``call`` permutes back a permute of ``x`` (through one-input concats): GPT-2's
    TorchScript export moves K and V to (B, N, S, D), appends an empty past and moves them back."""
    inner = call.args[0]
    while isinstance(inner, relax.Var) and op_name(values.get(inner)) == "relax.concat":
        fields = values[inner].args[0]
        if not isinstance(fields, relax.Tuple) or len(fields.fields) != 1:
            return None
        inner = fields.fields[0]
    first = values.get(inner) if isinstance(inner, relax.Var) else None
    if op_name(first) != "relax.permute_dims":
        return None
    rank = len(static_shape(call) or ())
    if not rank:
        return None
    outer_axes, inner_axes = _axes(call, rank), _axes(first, rank)
    if [inner_axes[a] for a in outer_axes] != list(range(rank)):
        return None
    return first.args[0]


def _axes(call: relax.Call, rank: int) -> list[int]:
    """A ``permute_dims``'s axes (None: reversed, as the op defines it)."""
    axes = call.attrs.axes
    return list(reversed(range(rank))) if axes is None else [int(a) % rank for a in axes]


def _cut_in_function(func, args, values: dict, mod, depth: int) -> _Cut | None:
    """A Primitive function's result traced to a cut, inside it or (through a parameter) in the
    caller; a cut of a parameter is a cut of the caller's argument, a cut of anything the
    function computes is no view of the caller's."""
    if not is_primitive(func) or not isinstance(func.body, relax.SeqExpr):
        return None
    inner = _bindings(func.body.blocks)
    cut = _cut(func.body.body, inner, mod, depth + 1, (dict(zip(func.params, args)), values))
    bound_inside = {b.var for block in func.body.blocks for b in block.bindings}  # MatchCast too
    if cut is None or not isinstance(cut.source, relax.Var) or cut.source in bound_inside:
        return None
    if cut.source in func.params:
        arg = args[list(func.params).index(cut.source)]
        if not isinstance(arg, relax.Var):  # a constant: nothing to save
            return None
        return _Cut(arg, cut.offset, cut.columns)
    return cut


def _slice_cut(call: relax.Call) -> _Cut | None:
    bounds = static_slice(call)
    if bounds is None or bounds[0] != len(static_shape(call.args[0])) - 1:
        return None
    _axis, start, stop = bounds
    return _Cut(call.args[0], start, stop - start)


def _split_cut(call, index: int) -> _Cut | None:
    """Field ``index`` of a last-axis ``split``: its columns from the fields' own widths (TVM
    rounds an even split's sections up and shortens the last)."""
    if op_name(call) != "relax.split":
        return None
    shape = static_shape(call.args[0])
    if shape is None or int(call.attrs.axis) % len(shape) != len(shape) - 1:
        return None
    fields = getattr(call.ty, "fields", None)
    if fields is None or index >= len(fields):
        return None
    widths = []
    for field in fields:
        dims = getattr(field, "shape", None)
        if not isinstance(dims, relax.ShapeExpr) or not isinstance(dims.values[-1], tvm.tirx.IntImm):
            return None
        widths.append(int(dims.values[-1]))
    return _Cut(call.args[0], sum(widths[:index]), widths[index])

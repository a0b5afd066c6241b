"""Where a fused attention's Q, K and V come from: columns of one packed projection.

Horizontal fusion makes Q, K and V one GEMM (``x . [Wq Wk Wv]``), and the exporters' own packed
projections (GPT-2's ``c_attn``, ViT's ``in_proj``) are one to begin with; a ``split`` (or three
``strided_slice`` s) along the last axis then copies each third out, and reshapes make it
``(batch, seq, heads, head_dim)``. That copy is a kernel per layer which writes and reads the
whole projection once more (about 1 % of BERT). The CPU attention kernel repacks its inputs
per head anyway, so it can read them from the projection directly: :func:`column_view` finds,
for an attention input, the tensor it was cut from and the columns it holds, looking through
reshapes (which keep row-major order), ``split`` / ``strided_slice`` along the last axis, and
the Primitive functions the fusion policy made of such ops.
"""

from __future__ import annotations

import dataclasses
import math

import tvm
from tvm import relax

from ..ir import int_values, is_primitive, op_name, static_shape

_RESHAPES = {"relax.reshape"}


@dataclasses.dataclass(frozen=True)
class ColumnView:
    """An attention input ``(B, S, N, D)`` read as columns ``[offset, offset + N*D)`` of a tensor
    of ``shape`` whose rows (all but the last axis, row-major) are the ``B*S`` tokens: ``(B, S,
    width)``, or ``(S, B, width)`` with ``B == 1`` (a ViT's ``in_proj`` output)."""

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
    """Finds the packed projections the attention inputs of ``func`` were cut from."""

    def __init__(self, mod: tvm.IRModule, func: relax.Function):
        self.mod = mod
        self.values = _bindings(func)

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


def _bindings(func: relax.Function) -> dict:
    values = {}
    if isinstance(func.body, relax.SeqExpr):
        for block in func.body.blocks:
            for binding in block.bindings:
                if isinstance(binding, relax.VarBinding):
                    values[binding.var] = binding.value
    return values


_MAX_DEPTH = 16  # producers walked per input (a few reshapes and one cut in practice)


def _cut(expr, values: dict, mod, depth: int) -> _Cut | None:
    """The last-axis cut ``expr`` is a reshaped view of, walking through reshapes (and into the
    Primitive functions that hold them)."""
    if depth > _MAX_DEPTH or not isinstance(expr, relax.Var) or expr not in values:
        return None
    value = values[expr]
    name = op_name(value)
    if name in _RESHAPES:
        return _cut(value.args[0], values, mod, depth + 1)
    if name == "relax.strided_slice":
        return _slice_cut(value)
    if isinstance(value, relax.TupleGetItem):
        return _split_cut(values.get(value.tuple_value), int(value.index))
    if isinstance(value, relax.Call) and isinstance(value.op, relax.GlobalVar) and value.op in mod.functions:
        return _cut_in_function(mod[value.op], list(value.args), values, mod, depth)
    return None


def _cut_in_function(func, args, outer: dict, mod, depth: int) -> _Cut | None:
    """A Primitive function's result traced to a cut; a cut of a parameter is a cut of the
    caller's argument."""
    if not is_primitive(func) or not isinstance(func.body, relax.SeqExpr):
        return None
    cut = _cut(func.body.body, _bindings(func), mod, depth + 1)
    if cut is None or cut.source not in func.params:
        return None
    arg = args[list(func.params).index(cut.source)]
    if not isinstance(arg, relax.Var):  # a constant: nothing to save
        return None
    return _Cut(arg, cut.offset, cut.columns)


def _slice_cut(call: relax.Call) -> _Cut | None:
    shape, out = static_shape(call.args[0]), static_shape(call)
    if shape is None or out is None or len(call.args) < 4:
        return None
    try:
        axes, begin = int_values(call.args[1]), int_values(call.args[2])
        strides = int_values(call.args[4]) if len(call.args) > 4 and call.args[4] is not None else [1]
    except (TypeError, ValueError, AttributeError):  # run-time bounds
        return None
    if axes != [len(shape) - 1] and axes != [-1] or set(strides) != {1}:
        return None
    start = begin[0] + shape[-1] if begin[0] < 0 else begin[0]
    if not 0 <= start <= shape[-1] - out[-1]:
        return None
    return _Cut(call.args[0], start, out[-1])


def _split_cut(call, index: int) -> _Cut | None:
    if op_name(call) != "relax.split":
        return None
    shape = static_shape(call.args[0])
    if shape is None or int(call.attrs.axis) % len(shape) != len(shape) - 1:
        return None
    sections = call.attrs.indices_or_sections
    width = shape[-1]
    if isinstance(sections, tvm.tirx.IntImm | int):
        step = width // int(sections)
        bounds = list(range(0, width + 1, step))
    else:
        bounds = [0, *(int(i) for i in sections), width]
    if index + 1 >= len(bounds):
        return None
    return _Cut(call.args[0], bounds[index], bounds[index + 1] - bounds[index])

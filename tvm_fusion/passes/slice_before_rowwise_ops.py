"""SliceBeforeRowwiseOps: compute only the rows a ``take`` keeps.

Why: a ViT classifier reads one token of its last encoder layer (``take(x, 0, axis=1)``, the class
token), yet the layer computes all 197: its output projection, MLP, residual adds and final norm
work token by token, so 196 of their rows are thrown away. Moved in front of those ops, the
take keeps one row from the start and they run on it alone (ViT-B/16: the last layer's MLP and
projection, ~6 % of the model's FLOPs). The same holds for any head that reads a few rows.

The kept rows move up through ops where every output row along the axis depends only on the
same row of the inputs: elementwise ops (operands broadcast along the axis stay whole), layer /
RMS norms and softmax over other axes, ``matmul`` along its row or batch axes, reshapes that
keep the axis whole, transposes, and a single-index ``take`` on another axis (Hugging Face
classifiers read the first token the same way: BertForSequenceClassification 0.94x the time).
It stops at a value
something else reads too (that value is sliced there, not moved past) and at anything else
(attention's key axis, a conv). The slice keeps the axis (size 1) on the way, so no op changes
rank; the original ``take`` then picks index 0 of what is left. Exact: the same rows are
computed the same way. Static shapes only. An exported dropout stops it too; in the pipeline
``RemoveInferenceDropout`` has removed them before.
"""

from __future__ import annotations

import dataclasses
import math

import tvm
from tvm import relax

from ..ir import (
    UseCountingMutator,
    count_uses,
    graph_functions,
    op_calls,
    op_name,
    static_shape,
    static_slice,
    tensor_type,
    with_functions,
)
from ..policy import OP_CLASSES

__all__ = ["SliceBeforeRowwiseOps"]

_TAKE = "relax.take"
_SLICE = "relax.strided_slice"
# each round moves slices past one value that several of them read; past the cap the rest stay
# where they are (correct, only less work saved)
_MAX_ROUNDS = 16
_ELEMENTWISE = {f"relax.{op}" for op in OP_CLASSES["activation"]}
_BINARY = {f"relax.{op}" for op in OP_CLASSES["binary"]}
_ROW_NORMS = {"relax.nn.layer_norm", "relax.nn.rms_norm"}
_SOFTMAX = {"relax.nn.softmax", "relax.nn.log_softmax"}
_VIEWS = {"relax.reshape", "relax.expand_dims", "relax.squeeze", "relax.flatten"}


@dataclasses.dataclass(frozen=True)
class _Rows:
    """Rows ``begin .. end - 1`` along ``axis`` (stride 1)."""

    axis: int
    begin: int
    end: int

    def on(self, axis: int) -> _Rows:
        return dataclasses.replace(self, axis=axis)


def take_index(take: relax.Call) -> int | None:
    """The constant scalar index of a one-axis ``take`` that picks one row in bounds (a negative
    one only in ``wrap`` mode, where it counts from the end); None for anything else."""
    index, shape = take.args[1], static_shape(take.args[0])
    if take.attrs.axis is None or shape is None:  # no axis: a take from the flattened tensor
        return None
    if not isinstance(index, tvm.ir.expr.Constant) or index.value.numpy().ndim:
        return None
    size = shape[int(take.attrs.axis) % len(shape)]
    value = int(index.value.numpy())
    if value < 0 and str(take.attrs.mode) == "wrap":
        value += size
    return value if 0 <= value < size else None


def _take_rows(take: relax.Call) -> _Rows | None:
    """The row a ``take`` of one constant index keeps (None if its input has only that row)."""
    if (index := take_index(take)) is None:
        return None
    shape = static_shape(take.args[0])
    axis = int(take.attrs.axis) % len(shape)
    return _Rows(axis, index, index + 1) if shape[axis] > 1 else None


def _slice_rows(call: relax.Call) -> _Rows | None:
    """The rows a static, one-axis, stride-1 ``strided_slice`` keeps, if fewer than its input has."""
    bounds = static_slice(call)
    if bounds is None:
        return None
    axis, start, stop = bounds
    return _Rows(axis, start, stop) if 0 < stop - start < static_shape(call.args[0])[axis] else None


def _rows_kept(call: relax.Call) -> _Rows | None:
    """The rows a ``take`` or ``strided_slice`` keeps, for those this pass can move."""
    rows_kept = {_TAKE: _take_rows, _SLICE: _slice_rows}.get(op_name(call))
    return rows_kept(call) if rows_kept else None


def _reshaped_axis(before: tuple, after: tuple, axis: int) -> int | None:
    """The axis of ``before`` that a reshape to ``after`` keeps whole as ``after[axis]``: same size,
    same number of elements in front (row-major), else None."""
    in_front = math.prod(after[:axis])
    for b in range(len(before)):
        if before[b] == after[axis] and math.prod(before[:b]) == in_front:
            return b
    return None


@relax.expr_functor.mutator
class _Rewriter(UseCountingMutator):
    def __init__(self, mod, uses: dict):
        super().__init__(mod, uses)
        self.slices = {}  # (value, rows) -> the var holding that slice, emitted once

    def visit_call_(self, call):
        call = super().visit_call_(call)
        rows = _rows_kept(call)
        if rows is None:
            return call
        moved = self._moved(call.args[0], rows)
        if moved is None:
            return call
        self.rewrote = True
        if op_name(call) == _SLICE:
            return moved
        kept = self.builder_.emit(moved)
        return relax.op.take(kept, relax.const(0, "int64"), axis=rows.axis, mode=str(call.attrs.mode))

    # -- the slice, moved where it can be ---------------------------------------------------------
    def _sliced(self, expr, rows: _Rows):
        """``expr`` restricted to ``rows``: moved up past its producer where possible, else sliced
        (once per value and rows: the next round moves that one slice on)."""
        key = (expr, rows)
        if key not in self.slices:
            moved = self._moved(expr, rows)
            if moved is None:
                moved = relax.op.strided_slice(expr, [rows.axis], [rows.begin], [rows.end])
            self.slices[key] = self.builder_.emit(moved)
        return self.slices[key]

    def _moved(self, expr, rows: _Rows):
        """``expr``'s producer recomputed on sliced inputs, or None where the slice cannot move up
        (a value read elsewhere too, an unknown shape, an op that mixes rows along the axis)."""
        call = self.single_use_binding(expr)
        name = op_name(call)
        if name is None or static_shape(call) is None or any(static_shape(a) is None for a in _tensors(call)):
            return None
        rule = next((rule for ops, rule in _RULES if name in ops), None)
        moved = getattr(self, rule)(call, rows) if rule else None
        if moved is None:
            return None
        # a safety net: a rule that got its axes wrong gives up here instead of changing the result
        moved = self.builder_.normalize(moved)
        kept = list(static_shape(expr))
        kept[rows.axis] = rows.end - rows.begin
        return moved if static_shape(moved) == tuple(kept) else None

    def _elementwise(self, call, rows):
        rank = len(static_shape(call))
        args = [self._broadcast_operand(arg, rows, rank) for arg in call.args]
        return relax.Call(call.op, args, call.attrs, call.ty_args)

    def _broadcast_operand(self, arg, rows: _Rows, rank: int):
        shape = static_shape(arg)
        if shape is None:  # an attribute-like operand (PrimValue)
            return arg
        axis = rows.axis - (rank - len(shape))
        return arg if axis < 0 or shape[axis] == 1 else self._sliced(arg, rows.on(axis))

    def _along_other_axes(self, call, rows):
        """Norms / softmax: the slice moves if they reduce over other axes only."""
        rank = len(static_shape(call))
        axes = call.attrs.axes if op_name(call) in _ROW_NORMS else [call.attrs.axis]
        if rows.axis in {int(a) % rank for a in axes}:
            return None
        args = [self._sliced(call.args[0], rows), *call.args[1:]]
        return relax.Call(call.op, args, call.attrs, call.ty_args)

    def _matmul(self, call, rows):
        rank = len(static_shape(call))
        lhs, rhs = call.args
        if rows.axis == rank - 1 or min(len(static_shape(lhs)), len(static_shape(rhs))) < 2:
            return None  # the column axis (a slice of the weight), or a vector operand's axes
        if rows.axis == rank - 2:
            rows = rows.on(len(static_shape(lhs)) - 2)
            return relax.Call(call.op, [self._sliced(lhs, rows), rhs], call.attrs)
        args = [self._broadcast_operand(arg, rows, rank) for arg in (lhs, rhs)]
        return relax.Call(call.op, args, call.attrs)

    def _view(self, call, rows):
        before, after = static_shape(call.args[0]), static_shape(call)
        axis = _reshaped_axis(before, after, rows.axis)
        if axis is None:
            return None
        shape = list(after)
        shape[rows.axis] = rows.end - rows.begin
        return relax.op.reshape(self._sliced(call.args[0], rows.on(axis)), shape)

    def _permute(self, call, rows):
        rank = len(static_shape(call))
        axes = (
            list(range(rank))[::-1] if call.attrs.axes is None else [int(a) % rank for a in call.attrs.axes]
        )
        return relax.Call(call.op, [self._sliced(call.args[0], rows.on(axes[rows.axis]))], call.attrs)

    def _take(self, call, rows):
        """A single-index ``take`` on another axis (Q out of a stacked Q/K/V)."""
        if take_index(call) is None:
            return None
        axis = int(call.attrs.axis) % len(static_shape(call.args[0]))
        source = rows.on(rows.axis + (rows.axis >= axis))
        return relax.Call(call.op, [self._sliced(call.args[0], source), call.args[1]], call.attrs)


def _tensors(call: relax.Call) -> list:
    return [arg for arg in call.args if tensor_type(arg) is not None]


_RULES = [
    (_ELEMENTWISE | _BINARY, "_elementwise"),
    (_ROW_NORMS | _SOFTMAX, "_along_other_axes"),
    ({"relax.matmul"}, "_matmul"),
    (_VIEWS, "_view"),
    ({"relax.permute_dims"}, "_permute"),
    ({_TAKE}, "_take"),
]


@tvm.transform.module_pass(opt_level=0, name="SliceBeforeRowwiseOps")
class SliceBeforeRowwiseOps:
    """Move a one-index ``take`` (or a static one-axis ``strided_slice``) in front of the row-wise
    ops that computed its input."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        updates = {}
        for gvar, func in graph_functions(mod):
            if not any(_rows_kept(call) for call in op_calls(func, {_TAKE, _SLICE})):
                continue
            for _ in range(_MAX_ROUNDS):
                rewriter = _Rewriter(mod, count_uses(func))
                rewritten = rewriter.visit_expr(func)
                if not rewriter.rewrote:
                    break
                func = updates[gvar] = relax.analysis.remove_all_unused(rewritten)
        return with_functions(mod, updates)

"""SliceBeforeLayoutOps: a ``take`` of a reshaped / transposed view becomes a slice of its source.

Why: torchvision's ``nn.MultiheadAttention`` projects Q, K and V with one packed GEMM, then splits
its ``[S, B, 3 * E]`` result as ``unflatten -> unsqueeze -> transpose -> squeeze`` and takes
Q, K and V out of the stacked axis (``take(x, i, axis=0)``). The transpose copies the whole
projection before the three takes copy it again: in ViT-B/16 that transpose took 0.39 ms of each
layer's ~13 ms. Each take only reads one contiguous block of the projection's last axis, so it
becomes that ``strided_slice`` of the projection, reshaped, and the transpose is left unread.

The block is found by emulation, not by pattern: the layout ops between the source and the take
(reshape, expand_dims, squeeze, flatten, permute_dims) are replayed on a tensor of element indices
(numpy, at compile time), and the take is rewritten only if the indices it reads are exactly a
one-axis slice of the source (possibly with a step: every other element), in row-major order or
in that of a transpose of the slice (then the slice is transposed, a copy of the part read
instead of the whole view). Exact by construction; static shapes only.

When the source is a matmul by a constant that nothing else reads and the slice is along its
last axis, only the kept columns are computed: the matmul takes those columns of the constant.
An ONNX ``DFT`` followed by the real part of its result (FNet's ``fft.fftn(x).real``) reads every
other column of the DFT's matmul (real and imaginary parts are interleaved): half its FLOPs.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import tvm
from tvm import relax

from ..ir import constant_value, count_uses, op_calls, op_name, rewrite_and_prune, static_shape
from .slice_before_rowwise_ops import take_index

__all__ = ["SliceBeforeLayoutOps"]

_TAKE = "relax.take"
_RESHAPES = {"relax.reshape", "relax.expand_dims", "relax.squeeze", "relax.flatten"}
_PERMUTE = "relax.permute_dims"
MAX_ELEMENTS = 1 << 22  # the largest source whose element indices are emulated (32 MiB of int64)


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    def __init__(self, mod, uses: dict):
        super().__init__(mod)
        self.uses = uses  # of the function's vars, before the rewrite
        self.rewrote = False

    def visit_call_(self, call):
        call = super().visit_call_(call)
        if op_name(call) != _TAKE or (index := take_index(call)) is None:
            return call
        source, chain, views = self._layout_chain(call.args[0])
        if not chain:
            return call
        block = _block_read(source, chain, index, int(call.attrs.axis))
        if block is None:
            return call
        self.rewrote = True
        read_once = all(self.uses.get(var) == 1 for var in [source, *views])
        sliced = self._constant_matmul_columns(source, block) if read_once else None
        if sliced is None:
            strides = None if block.step == 1 else [block.step]
            sliced = self.builder_.emit(
                relax.op.strided_slice(source, [block.axis], [block.begin], [block.end], strides)
            )
        if block.order is not None:
            sliced = self.builder_.emit(relax.op.permute_dims(sliced, list(block.order)))
        return relax.op.reshape(sliced, static_shape(call))

    def _constant_matmul_columns(self, source, block: _Block):
        """``matmul(x, w[..., begin:end:step])`` when ``source`` is ``matmul(x, w)`` by a constant
        ``w`` and the slice is along its last axis; else None."""
        value = self.lookup_binding(source) if isinstance(source, relax.Var) else None
        if op_name(value) != "relax.matmul":
            return None
        data, weight = value.args[0], constant_value(value.args[1])
        if weight is None or weight.ndim < 2 or block.axis != len(static_shape(value)) - 1:
            return None
        if isinstance(data, relax.DataflowVar) and not isinstance(source, relax.DataflowVar):
            return None  # out of scope where the take is
        columns = np.ascontiguousarray(weight[..., block.begin : block.end : block.step])
        return self.builder_.emit(
            relax.op.matmul(data, relax.const(columns, str(columns.dtype)), out_dtype=value.attrs.out_dtype)
        )

    def _layout_chain(self, expr) -> tuple:
        """``(source, [layout calls from the source on], [the vars bound to them])``: the value in
        front of the longest run of layout ops that ends at ``expr``. The run stops at a block's
        output var whose producer reads a dataflow var, which is out of scope where the take is."""
        chain, views = [], []
        while isinstance(expr, relax.Var):
            value = self.lookup_binding(expr)
            if op_name(value) not in _RESHAPES | {_PERMUTE} or static_shape(value) is None:
                break
            source = value.args[0]
            if isinstance(source, relax.DataflowVar) and not isinstance(expr, relax.DataflowVar):
                break
            chain.append(value)
            views.append(expr)
            expr = source
        return expr, chain[::-1], views


class _Block(NamedTuple):
    """``strided_slice(source, [axis], [begin], [end], [step])``, then ``permute_dims(order)``
    unless ``order`` is None (read in row-major order)."""

    axis: int
    begin: int
    end: int
    step: int
    order: tuple[int, ...] | None


def _block_read(source, chain: list, index: int, axis: int) -> _Block | None:
    """The block of ``source`` that ``take(chain(source), index, axis)`` reads, or None when it
    reads anything else."""
    shape = static_shape(source)
    if shape is None or not 0 < int(np.prod(shape)) <= MAX_ELEMENTS:
        return None
    indices = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
    view = indices
    for call in chain:
        if op_name(call) == _PERMUTE:
            view = np.transpose(view, None if call.attrs.axes is None else [int(a) for a in call.attrs.axes])
        else:
            view = view.reshape(static_shape(call))
    read = np.take(view, index, axis=axis).reshape(-1)
    coordinates = np.unravel_index(read, shape)
    for k, size in enumerate(shape):
        kept = np.unique(coordinates[k])
        if len(kept) >= size or len(kept) * (indices.size // size) != read.size:
            continue
        step = int(kept[1] - kept[0]) if len(kept) > 1 else 1
        taken = range(int(kept[0]), int(kept[-1]) + 1, step)
        block = indices.take(taken, axis=k)
        order = _read_order(block, read) if len(taken) == len(kept) else None
        if order is not None:
            moved = [d for d in order if block.shape[d] > 1]
            return _Block(k, taken.start, taken.stop, step, None if moved == sorted(moved) else order)
    return None


def _read_order(block: np.ndarray, read: np.ndarray) -> tuple[int, ...] | None:
    """The axes of the transpose of ``block`` (element indices) whose row-major order is the order
    of ``read``, unit axes first; None when ``read`` visits ``block`` in no such order."""
    flat = block.reshape(-1)  # ascending: a slice of an index tensor
    rank = np.searchsorted(flat, read)
    if not np.array_equal(flat[np.minimum(rank, flat.size - 1)], read):
        return None
    position = np.empty(flat.size, dtype=np.int64)
    position[rank] = np.arange(read.size)
    position = position.reshape(block.shape)
    origin = (0,) * block.ndim
    stride = [
        int(position[tuple(1 if d == e else 0 for e in range(block.ndim))] - position[origin])
        if block.shape[d] > 1
        else 0
        for d in range(block.ndim)
    ]
    order = tuple(sorted(range(block.ndim), key=lambda d: (block.shape[d] > 1, -stride[d], d)))
    return order if np.array_equal(np.transpose(block, order).reshape(-1), read) else None


@tvm.transform.module_pass(opt_level=0, name="SliceBeforeLayoutOps")
class SliceBeforeLayoutOps:
    """Rewrite a one-index ``take`` of a reshaped / transposed view as a ``strided_slice`` of the
    view's source, where it reads one (strided) block of one source axis; of a matmul by a
    constant, as a matmul by the columns it keeps."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return rewrite_and_prune(
            mod,
            lambda func: any(take_index(call) is not None for call in op_calls(func, {_TAKE})),
            lambda func: _Rewriter(mod, count_uses(func)),
        )

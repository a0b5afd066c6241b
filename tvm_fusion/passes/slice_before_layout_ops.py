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
one-axis slice of the source, in row-major order. Exact by construction; static shapes only.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from ..ir import op_calls, op_name, rewrite_and_prune, static_shape
from .slice_before_rowwise_ops import take_index

__all__ = ["SliceBeforeLayoutOps"]

_TAKE = "relax.take"
_RESHAPES = {"relax.reshape", "relax.expand_dims", "relax.squeeze", "relax.flatten"}
_PERMUTE = "relax.permute_dims"
MAX_ELEMENTS = 1 << 22  # the largest source whose element indices are emulated (32 MiB of int64)


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    def __init__(self, mod):
        super().__init__(mod)
        self.rewrote = False

    def visit_call_(self, call):
        call = super().visit_call_(call)
        if op_name(call) != _TAKE or (index := take_index(call)) is None:
            return call
        source, chain = self._layout_chain(call.args[0])
        if not chain:
            return call
        block = _block_read(source, chain, index, int(call.attrs.axis))
        if block is None:
            return call
        axis, begin, end = block
        self.rewrote = True
        sliced = self.builder_.emit(relax.op.strided_slice(source, [axis], [begin], [end]))
        return relax.op.reshape(sliced, static_shape(call))

    def _layout_chain(self, expr) -> tuple:
        """``(source, [layout calls from the source on])``: the value in front of the longest run
        of layout ops that ends at ``expr``. The run stops at a block's output var whose producer
        reads a dataflow var, which is out of scope where the take is."""
        chain = []
        while isinstance(expr, relax.Var):
            value = self.lookup_binding(expr)
            if op_name(value) not in _RESHAPES | {_PERMUTE} or static_shape(value) is None:
                break
            source = value.args[0]
            if isinstance(source, relax.DataflowVar) and not isinstance(expr, relax.DataflowVar):
                break
            chain.append(value)
            expr = source
        return expr, chain[::-1]


def _block_read(source, chain: list, index: int, axis: int) -> tuple[int, int, int] | None:
    """``(axis, begin, end)`` of ``source`` that ``take(chain(source), index, axis)`` reads, in
    row-major order, or None when it reads anything else."""
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
    for k, size in enumerate(shape):
        width = read.size // (indices.size // size)
        if width * (indices.size // size) != read.size or width >= size:
            continue
        begin = int(np.unravel_index(read[0], shape)[k])
        if begin + width <= size and np.array_equal(
            read, indices.take(range(begin, begin + width), axis=k).reshape(-1)
        ):
            return k, begin, begin + width
    return None


@tvm.transform.module_pass(opt_level=0, name="SliceBeforeLayoutOps")
class SliceBeforeLayoutOps:
    """Rewrite a one-index ``take`` of a reshaped / transposed view as a ``strided_slice`` of the
    view's source, where it reads one contiguous block of one source axis."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        return rewrite_and_prune(
            mod,
            lambda func: any(take_index(call) is not None for call in op_calls(func, {_TAKE})),
            lambda func: _Rewriter(mod),
        )

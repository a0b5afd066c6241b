"""Pointwise (1x1, stride 1, unpadded) NCHW convs as GEMMs over the flattened H*W plane.

Such a conv is ``out[c, h, w] = sum_k W[c, k] * x[k, h, w]``: in memory a GEMM whose N axis is
the whole plane. Scheduled as a conv, its vector axis is either W (56 on a MobileNet block: no
16- or 32-wide tile divides it) or output channels (a scatter of single lanes on every
write-back, paid once per 24-step reduction). Merged into one ``hw`` iter, the plane is a
contiguous axis of 3136 elements: the Contraction rule then picks a GEMM tile (16 plane lanes x
6 channel rows) with contiguous loads and stores.

Rewrites, before the rule plans its tile:

* direct producers of the contraction that are plain copies (the ``pad_temp`` of an unpadded
  conv) are inlined: they only rename the input and cost a pass over it; so is a concat fused in
  front (a *piece select*), where the contraction reduces along its axis: the conv then reads the
  pieces in place (the rule loops over them apart, ``contraction._split_at_pieces``);
* intermediate buffers ``[.., H, W]`` become ``[.., H*W]`` (``transform_layout``), and the
  contraction and its epilogue blocks get one ``hw`` iter (``transform_block_layout``).
  Function parameters keep their shape; their accesses become ``[.., hw // W, hw % W]``, which
  ``access_class`` reads as contiguous and lowering simplifies back to ``hw``.
"""

from __future__ import annotations

import math

import tvm
from tvm import tirx

from ._util import reachable_blocks, try_primitive, uses_var


def inline_plain_copies(sch, main, max_piece_copies: int = 0) -> bool:
    """compute_inline the direct producers of ``main`` that are plain copies, to a fixpoint; and
    piece selects (a concat behind the ``pad_temp`` copy) that ``main`` reads along one of its
    reduction iters in at most ``max_piece_copies`` equal steps (the caller splits the loop
    there, see ``contraction._split_at_pieces``). True if any was inlined."""

    def inlinable(blk) -> bool:
        block = sch.get(blk)
        return is_plain_copy(block) or _reduced_piece_select(sch.get(main), block, max_piece_copies)

    changed = False
    # one inline at a time (``any`` stops at the first): it changes the producers, so look again
    while any(inlinable(blk) and try_primitive(sch.compute_inline, blk) for blk in sch.get_producers(main)):
        changed = True
    return changed


def _reduced_piece_select(main, block, max_copies: int) -> bool:
    """A piece select whose pieces ``main`` reads along a reduction iter (the concat's axis is
    reduced over), splittable in at most ``max_copies`` steps."""
    found = _piece_axis(block)
    if found is None or found[1] > max_copies:
        return False
    axes = [i for i, index in enumerate(block.body.indices) if index.same_as(found[0])]
    if len(axes) != 1:
        return False
    axis, written = axes[0], block.body.buffer
    reduced = {iv.var for iv in main.iter_vars if iv.iter_type == tirx.IterVar.CommReduce}
    for read in main.reads:
        if read.source.same_as(written):
            index = read.region[axis].min
            return any(index.same_as(v) for v in reduced)
    return False


def is_plain_copy(block) -> bool:
    """``out[.., i, j, ..] = in[.., i, j, ..]``: the same iter vars in the same order on both sides
    (constant indices, such as a unit batch dim, ignored), no arithmetic, no condition."""
    body = block.body
    # (``tirx.BufferLoad`` is a constructor function in this TVM; the node class is ``ir.TensorLoad``)
    if not isinstance(body, tirx.BufferStore) or not isinstance(body.value, tvm.ir.expr.TensorLoad):
        return False
    dst, src = _var_indices(body.indices), _var_indices(body.value.indices)
    iters = [it.var for it in block.iter_vars]
    return (
        all(isinstance(i, tirx.Var) for i in dst + src)
        and len(dst) == len(src) == len(iters)
        and all(a.same_as(b) and a.same_as(c) for a, b, c in zip(dst, src, iters))
    )


def is_piece_select(block) -> bool:
    """``out[..] = if_then_else(c, a[..], if_then_else(c2, b[..], ..))``: each element one of the
    pieces' elements, chosen by its index (a concat the policy fused in front of the conv).
    Inlined, the conv reads the pieces where they lie; a pad (a constant leaf) does not qualify."""
    body = block.body
    if not isinstance(body, tirx.BufferStore):
        return False

    def pieces(expr) -> bool:
        if isinstance(expr, tvm.ir.expr.TensorLoad):
            return True
        if _is_if_then_else(expr):
            return pieces(expr.args[1]) and pieces(expr.args[2])
        if isinstance(expr, tirx.Select):
            return pieces(expr.true_value) and pieces(expr.false_value)
        return False

    value = body.value
    return not isinstance(value, tvm.ir.expr.TensorLoad) and pieces(value)


def piece_bounds(block, var) -> list[int]:
    """The constants ``c`` of the piece conditions (``var < c``, ``c <= var``, ...) that the
    if_then_else chains in ``block``'s value test ``var`` against: where an inlined concat
    switches from one piece to the next along ``var``. Sorted, without duplicates."""
    bounds = set()
    todo = [block.body.value] if isinstance(block.body, tirx.BufferStore) else []
    while todo:
        node = todo.pop()
        if _is_if_then_else(node):
            bound = _piece_bound(node.args[0], var)
            if bound is not None:
                bounds.add(bound)
        todo += _operands(node)
    return sorted(bounds)


# var OP c is true from this index on (GE, GT) or below it (LT, LE): the bound is where it flips
_FLIPS_AT = {tirx.LT: 0, tirx.GE: 0, tirx.LE: 1, tirx.GT: 1}
_MIRRORED = {tirx.LT: tirx.GT, tirx.LE: tirx.GE, tirx.GT: tirx.LT, tirx.GE: tirx.LE}


def _piece_bound(cond, var) -> int | None:
    """``c`` of ``var < c`` (or ``<=``, ``>``, ``>=``, either side): the first index on the
    condition's other side; None for any other condition."""
    kind = type(cond)
    if kind not in _FLIPS_AT:
        return None
    a, b = cond.a, cond.b
    if isinstance(a, tirx.IntImm) and b.same_as(var):  # c OP var is var MIRRORED c
        kind, a, b = _MIRRORED[kind], b, a
    if not (isinstance(b, tirx.IntImm) and a.same_as(var)):
        return None
    return int(b) + _FLIPS_AT[kind]


def _piece_axis(block) -> tuple[tirx.Var, int] | None:
    """The iter a piece select switches pieces along, and how many equal steps a loop over it
    needs so that no step straddles two pieces (its extent over the gcd of its bounds); None
    unless the block is a piece select along exactly one static iter."""
    if not is_piece_select(block):
        return None
    split = [(iv, bounds) for iv in block.iter_vars if (bounds := piece_bounds(block, iv.var))]
    if len(split) != 1 or not isinstance(split[0][0].dom.extent, tirx.IntImm):
        return None
    (iv, bounds), extent = split[0], int(split[0][0].dom.extent)
    return iv.var, extent // math.gcd(extent, *bounds)


def _is_if_then_else(node) -> bool:
    return isinstance(node, tvm.ir.expr.Call) and str(getattr(node.op, "name", "")).endswith(".if_then_else")


def _operands(node) -> list:
    """The sub-expressions of an arithmetic / call / select / cast node (not of loads)."""
    if isinstance(node, tvm.ir.expr.Call):
        return list(node.args)
    if isinstance(node, tirx.Select):
        return [node.condition, node.true_value, node.false_value]
    if isinstance(node, tirx.Cast):
        return [node.value]
    if hasattr(node, "a") and hasattr(node, "b"):
        return [node.a, node.b]
    return []


def flatten_plane(sch, main_info) -> bool:
    """Merge the contraction's last two spatial iters (H, W) into one, with its epilogue, when
    every access that uses them reads ``[.., h, w]`` of an ``[.., H, W]`` buffer. True if done."""
    spatial = [it for it in main_info.iters if it.kind == "S"]
    if len(spatial) < 2:
        return False
    h_it, w_it = spatial[-2], spatial[-1]
    pos = main_info.iters.index(h_it)
    if pos + 1 >= len(main_info.iters) or main_info.iters[pos + 1] is not w_it:
        return False
    if not isinstance(h_it.dom, int) or not isinstance(w_it.dom, int):
        return False
    plane = (h_it.dom, w_it.dom)
    main = main_info.block_rv
    params = set(sch.mod["main"].params)  # in this TVM a PrimFunc param is its buffer
    if any(w.source in params for w in sch.get(main).writes):
        # no epilogue: the rule would stage the accumulator through a cache of the [.., H, W]
        # output, whose write-back cannot cover a span of the flattened plane exactly
        return False
    blocks = [main] + reachable_blocks(sch, main, sch.get_consumers)
    pairs = []
    for blk in blocks:
        pair = _plane_iters(sch.get(blk), plane)
        if pair is None:
            return False
        pairs.append(pair)
    # a producer of a plane operand (a strided 1x1 conv's subsampled input) keeps its own loops
    # (its reads need not be [.., h, w]); only the layout of the buffer it writes changes
    writers = blocks + list(sch.get_producers(main))
    flat = {}  # intermediate [.., H, W] buffers -> the plane block that writes them
    for blk in blocks:
        stmt = sch.get(blk)
        for region in list(stmt.reads) + list(stmt.writes):
            buf = region.source
            if buf not in params and tuple(int(d) for d in buf.shape[-2:]) == plane:
                writer = next(
                    (b for b in writers if any(w.source.same_as(buf) for w in sch.get(b).writes)), None
                )
                if writer is None:
                    return False  # written outside the plane blocks (e.g. a padded copy)
                flat[buf.name] = (buf, writer)
    for buf, writer in flat.values():
        index = next(i for i, w in enumerate(sch.get(writer).writes) if w.source.same_as(buf))
        sch.transform_layout(
            writer, ("write", index), _merge_map(len(buf.shape), len(buf.shape) - 2, plane[1])
        )
    for blk, (hi, _) in zip(blocks, pairs):
        sch.transform_block_layout(blk, _merge_map(len(sch.get(blk).iter_vars), hi, plane[1]))
    return True


def _merge_map(ndim: int, at: int, width: int) -> tirx.IndexMap:
    """``(.., i[at], i[at + 1], ..) -> (.., i[at] * width + i[at + 1], ..)``."""

    def merge(*i):
        return [*i[:at], i[at] * width + i[at + 1], *i[at + 2 :]]

    return tirx.IndexMap.from_func(merge, ndim=ndim, index_dtype="int64")


def _plane_iters(block, plane) -> tuple[int, int] | None:
    """Positions of the block's (h, w) iters: adjacent spatial iters with extents ``plane``, used
    by every access only as the bare last two indices of an ``[.., H, W]`` buffer."""
    iters = list(block.iter_vars)
    for k in range(len(iters) - 1):
        h, w = iters[k], iters[k + 1]
        if not all(isinstance(it.dom.extent, tirx.IntImm) for it in (h, w)):
            continue
        if (int(h.dom.extent), int(w.dom.extent)) != plane:
            continue
        if h.iter_type != tirx.IterVar.DataPar or w.iter_type != tirx.IterVar.DataPar:
            continue
        if all(
            _plane_access(region, h.var, w.var, plane) for region in list(block.reads) + list(block.writes)
        ):
            return k, k + 1
    return None


def _plane_access(region, h, w, plane) -> bool:
    mins = [rng.min for rng in region.region]
    used = [d for d, m in enumerate(mins) if uses_var(m, h) or uses_var(m, w)]
    if not used:
        return True
    nd = len(mins)
    return (
        used == [nd - 2, nd - 1]
        and mins[-2].same_as(h)
        and mins[-1].same_as(w)
        and tuple(int(d) for d in region.source.shape[-2:]) == plane
        and all(isinstance(rng.extent, tirx.IntImm) and int(rng.extent) == 1 for rng in region.region[-2:])
    )


def _var_indices(indices) -> list:
    return [i for i in indices if not isinstance(i, tirx.IntImm)]

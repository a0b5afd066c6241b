"""Pooling windows: parallel over output rows, the padded input computed per row.

A max/avg pool is a reduction over a small window of one input (no weights). Scheduled like a
contraction, its padded input was materialised whole (ResNet-18's stem pool: a 3.3 MB copy of a
3.2 MB tensor) and every 8x8 register tile paid the tile set-up for 9 steps. Here each parallel
iteration is one output row of one channel: it pads only the input rows that row reads (they stay
in L1) and then runs the window as plain loops. ResNet-18's 3x3/2 max pool: 0.38-0.56 ms ->
0.12 ms (the schedule Meta-Schedule found for it, made the default). A stride-1 window runs its
taps outside the output columns (one contiguous row add per tap), and the whole epilogue chain
(PoolFormer's ``(pool(x) - x) * s + y``) is computed per row too: PoolFormer's 12 pools 1.0 ->
0.6 ms.
"""

from __future__ import annotations

import math

from tvm import tirx
from tvm.sym import detect_linear_equation
from tvm.target import Target

from ._util import (
    CpuRule,
    layout_free_params,
    operand_reads,
    reverse_compute_within,
    safe_rule,
    schedule_injective_block,
    try_primitive,
    uses_var,
)

MAX_WINDOW = 64  # reduction steps per output: pooling windows, not global pools or GEMMs


class WindowReduction(CpuRule):
    @safe_rule
    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool):
        opened = self.normalized(func, target)
        if opened is None:
            return None
        sch, infos = opened
        reductions = [b for b in infos if not b.is_injective()]
        if len(reductions) != 1 or not _is_window(sch, reductions[0], func):
            return None
        main = reductions[0].block_rv
        loops = sch.get_loops(main)
        n_spatial = reductions[0].dom_kind().count("S")
        rows = sch.fuse(*loops[: n_spatial - 1]) if n_spatial > 2 else loops[0]
        sch.parallel(rows)
        handled = {sch.get(main).name_hint}
        for prod in sch.get_producers(main):
            if try_primitive(sch.compute_at, prod, rows, True):
                handled.add(sch.get(prod).name_hint)
        consumers = sch.get_consumers(main)
        n_reduce = len(loops) - n_spatial
        columns = _columns_inside_window(sch, main, n_reduce)
        first_window_loop = sch.get_loops(main)[-n_reduce - (1 if columns else 0)]
        init = sch.decompose_reduction(main, first_window_loop)
        if columns:  # (the update's own column loop: LLVM vectorizes it; TVM refuses, a reduction)
            try_primitive(sch.vectorize, sch.get_loops(init)[-1])
        handled |= {sch.get(init).name_hint, sch.get(main).name_hint}  # main is now "<name>_update"
        # the epilogue (avg pool's divide, then e.g. PoolFormer's ``(pool(x) - x) * s + y``): per
        # row too, block after block, instead of whole-tensor passes over materialised intermediates
        frontier, epilogue = [(cons, main) for cons in consumers], []
        while frontier:
            cons, producer = frontier.pop(0)
            if sch.get(cons).name_hint in handled:
                continue
            if reverse_compute_within(sch, cons, producer, rows, True):
                handled.add(sch.get(cons).name_hint)
                epilogue.append(cons)
                frontier += [(nxt, cons) for nxt in sch.get_consumers(cons)]
        for blk in epilogue:  # its columns, as the whole-tensor injective schedule had them
            try_primitive(sch.vectorize, sch.get_loops(blk)[-1])
        for blk in sch.get_child_blocks(sch.get_sblock("root")):
            if sch.get(blk).name_hint not in handled:
                schedule_injective_block(sch, blk, target)
        return sch


def _columns_inside_window(sch, block, n_reduce: int) -> bool:
    """Move the innermost output loop (NCHW's columns; the channels of a channels-last pool)
    inside the window loops when the input's last index advances by 1 with it (a stride-1 NCHW
    window, any channels-last one): each tap is then one contiguous vector load and add. True if
    moved. Strided NCHW windows keep their columns outside (a vector would gather)."""
    stmt = sch.get(block)
    column = stmt.iter_vars[-n_reduce - 1].var
    source = operand_reads(stmt)[0]
    coeffs = detect_linear_equation(source.region[-1].min, [column])
    if len(coeffs) != 2 or not isinstance(coeffs[0], tirx.IntImm) or int(coeffs[0]) != 1:
        return False
    loops = sch.get_loops(block)
    return try_primitive(sch.reorder, *loops[-n_reduce:], loops[-n_reduce - 1])


def _is_window(sch, info, func) -> bool:
    """A pooling window: spatial iters (at least a row and a column) then a few reduction iters,
    one input read through them, and that input not a constant weight."""
    kinds = info.dom_kind()
    n_spatial = kinds.count("S")
    if kinds != "S" * n_spatial + "R" * (len(kinds) - n_spatial) or n_spatial < 2 or n_spatial == len(kinds):
        return False
    if any(not isinstance(d, int) for d in info.dom()[1:]):  # a symbolic batch is an outer loop
        return False
    if not 2 <= math.prod(info.dom()[n_spatial:]) <= MAX_WINDOW:
        return False
    reads = operand_reads(sch.get(info.block_rv))
    if len({r.source for r in reads}) != 1 or reads[0].source in layout_free_params(func):
        return False
    # a window slides: some input index mixes an output position with a window offset (oh*2 + kh);
    # a plain axis reduction (sum over the last dim) does not
    s_vars = [it.var for it in info.iters[:n_spatial]]
    r_vars = [it.var for it in info.iters[n_spatial:]]
    return any(
        any(uses_var(rng.min, v) for v in s_vars) and any(uses_var(rng.min, v) for v in r_vars)
        for rng in reads[0].region
    )

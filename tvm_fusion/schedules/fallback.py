"""Last-resort CPU rule: every root loop nest gets a parallel outer loop where that is legal.

Runs after the specific rules, so every PrimFunc that reaches the build is at least parallel (and
vectorized where the nest is spatial). Only loops that carry nothing but data-parallel block iters
are parallelized (TVM checks this again in ``sch.parallel``), so a reduction is never split
across threads.
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.target import Target

from ._util import (
    get_sblock_realize,
    int_extent,
    is_cpu,
    num_cores,
    schedule_injective_block,
    try_primitive,
    uses_var,
)


class ParallelFallback(ScheduleRule):
    def is_target_available(self, target: Target) -> bool:
        return is_cpu(target)

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool):
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        sch = s_tir.Schedule(func)
        try:
            blocks = sch.get_child_blocks(sch.get_sblock("root"))
        except Exception:  # pylint: disable=broad-except
            return sch  # no root block (opaque / already lowered): leave the body as it is
        for blk in blocks:
            try:
                schedule_nest(sch, blk, target)
            except Exception:  # pylint: disable=broad-except
                continue
        return sch


def schedule_nest(sch, blk, target):
    stmt = sch.get(blk)
    loops = sch.get_loops(blk)
    if not loops:
        return
    if all(it.iter_type == tirx.IterVar.DataPar for it in stmt.iter_vars):
        schedule_injective_block(sch, blk, target)
        return
    prefix = spatial_loop_prefix(sch, blk)
    if not prefix:
        return
    exts = [int_extent(sch, lp) for lp in prefix]
    k, prod = 0, 1
    while k < len(prefix) and exts[k] is not None and prod < 16 * num_cores(target):
        prod *= exts[k]
        k += 1
    if k == 0:
        try_primitive(sch.parallel, prefix[0])
        return
    fused = sch.fuse(*prefix[:k]) if k > 1 else prefix[0]
    if prod > 1:
        try_primitive(sch.parallel, fused)


def spatial_loop_prefix(sch, blk) -> list:
    """Outermost loops of blk's nest that bind only data-parallel iters (and only this block)."""
    realize = get_sblock_realize(sch, blk)
    stmt = sch.get(blk)
    loops = sch.get_loops(blk)
    out = []
    for lp in loops:
        loop = sch.get(lp)
        if len(sch.get_child_blocks(lp)) != 1:
            break
        ok = True
        for it, val in zip(stmt.iter_vars, realize.iter_values):
            if uses_var(val, loop.loop_var) and it.iter_type != tirx.IterVar.DataPar:
                ok = False
                break
        if not ok:
            break
        out.append(lp)
    return out

"""Root stages around a CPU contraction: a GEMM input computed with its row reductions
(``layer_norm`` or ``rms_norm -> matmul``: the norm as the GEMM's prologue), and any other stage next to the
micro-kernel. Shared by ``Contraction``, ``Strassen`` and ``RowReduction``."""

from __future__ import annotations

from tvm import tirx

from ._util import (
    access_class,
    get_sblock_realize,
    int_extent,
    logger,
    reachable_blocks,
    schedule_injective_block,
    try_primitive,
    uses_var,
    vector_lanes,
)
from .fallback import schedule_nest


def reads_varying_with_reduction(stmt) -> list:
    """Read buffers (other than the output) whose access moves with a reduction iter."""
    out_buf = stmt.writes[0].source if stmt.writes else None
    r_vars = [it.var for it in stmt.iter_vars if it.iter_type == tirx.IterVar.CommReduce]
    bufs = []
    for region in stmt.reads:
        if out_buf is not None and region.source.same_as(out_buf):
            continue
        if any(access_class(region, v) != "invariant" for v in r_vars):
            if not any(region.source.same_as(b) for b in bufs):
                bufs.append(region.source)
    return bufs


def _leading_spatial(stmt) -> int:
    n = 0
    for it in stmt.iter_vars:
        if it.iter_type != tirx.IterVar.DataPar:
            break
        n += 1
    return n


def schedule_row_prologue(sch, anchor, target) -> set:
    """Schedule a materialized GEMM input and the row reductions it needs (layer_norm: sum,
    mean, variance, normalize) as one root stage: parallel over rows, every block of a row
    computed under that loop (the row stays in L1), injective blocks vectorized, reductions
    vectorized by an rfactor over SIMD lanes. Returns the names of the blocks it scheduled
    (empty when anchor has no reduction upstream: plain pads / transposes are left to the
    injective stage code)."""
    anchor_stmt = sch.get(anchor)
    if not all(it.iter_type == tirx.IterVar.DataPar for it in anchor_stmt.iter_vars):
        return set()
    group = reachable_blocks(sch, anchor, sch.get_producers)
    if not any(not all(it.iter_type == tirx.IterVar.DataPar for it in sch.get(b).iter_vars) for b in group):
        return set()
    stmts = [sch.get(b) for b in group]
    n_lead = min([_leading_spatial(st) for st in stmts] + [len(anchor_stmt.iter_vars) - 1])
    if n_lead < 1:
        return set()
    lanes = vector_lanes(target, str(anchor_stmt.writes[0].source.dtype))
    # root order: producers before consumers (compute_at below goes consumers first)
    order = {sch.get(b).name_hint: i for i, b in enumerate(sch.get_child_blocks(sch.get_sblock("root")))}
    names = sorted((st.name_hint for st in stmts), key=lambda n: order.get(n, -1))
    # vectorized row reductions: ki (SIMD lanes) becomes a spatial axis of an rf block that
    # accumulates lanes partial sums; the write-back block adds the lanes up. rfactor needs the
    # block alone under its loops, so it runs while the blocks are still at root.
    scheduled = []
    for name in names:
        blk = sch.get_sblock(name)
        st = sch.get(blk)
        if all(it.iter_type == tirx.IterVar.DataPar for it in st.iter_vars):
            scheduled.append(name)
            continue
        loops = sch.get_loops(blk)
        ext = int_extent(sch, loops[-1])
        if ext is not None and ext % lanes == 0 and ext >= 2 * lanes:
            _, ki = sch.split(loops[-1], factors=[None, lanes])
            try:
                rf = sch.rfactor(ki, factor_axis=len(st.writes[0].region))
                scheduled += [sch.get(rf).name_hint, name]
                continue
            except Exception as err:  # pylint: disable=broad-except
                logger.debug("rfactor of %s failed: %s", name, err)
        scheduled.append(name)
    loops = sch.get_loops(anchor)
    rows = sch.fuse(*loops[:n_lead]) if n_lead > 1 else loops[0]
    sch.parallel(rows)
    for name in reversed(scheduled):
        sch.compute_at(sch.get_sblock(name), rows, preserve_unit_loops=True)
    for blk in [sch.get_sblock(n) for n in scheduled] + [anchor]:
        vectorize_row_inner(sch, blk, lanes)
    # everything under the row loop now (rf init blocks included) is taken care of
    return {sch.get(b).name_hint for b in sch.get_child_blocks(rows)} | {anchor_stmt.name_hint}


def vectorize_row_inner(sch, blk, lanes):
    """Vectorize the innermost loop of a block under the row loop, if it binds a spatial iter."""
    st = sch.get(blk)
    loops = sch.get_loops(blk)[1:]
    if not loops:
        return
    inner = loops[-1]
    ext = int_extent(sch, inner)
    if ext is None or ext < 2:
        return
    if _binds_reduction(sch, blk, inner):
        # an rf block (compute_at put its lanes axis first): reduction loops out, lanes in
        spatial = [lp for lp in loops if not _binds_reduction(sch, blk, lp) and int_extent(sch, lp) == lanes]
        if spatial and try_primitive(
            sch.reorder, *[lp for lp in loops if lp is not spatial[-1]], spatial[-1]
        ):
            try_primitive(sch.vectorize, sch.get_loops(blk)[-1])
            r_loops = [lp for lp in sch.get_loops(blk)[1:] if _binds_reduction(sch, blk, lp)]
            if r_loops and st.init is not None:
                init = sch.decompose_reduction(blk, r_loops[0])
                try_primitive(sch.vectorize, sch.get_loops(init)[-1])
            return
        # reduction innermost (no rfactor): unroll by lanes so LLVM pipelines the scalar chain
        if ext > lanes and ext % lanes == 0:
            _, inner = sch.split(inner, factors=[None, lanes])
            sch.annotate(inner, ann_key="pragma_auto_unroll_max_step", ann_val=lanes)
            sch.annotate(inner, ann_key="pragma_unroll_explicit", ann_val=1)
        return
    if ext > lanes and ext % lanes == 0:
        _, inner = sch.split(inner, factors=[None, lanes])
    elif ext > lanes:
        return
    try_primitive(sch.vectorize, inner)


def _binds_reduction(sch, blk, loop) -> bool:
    """Whether ``loop`` drives one of ``blk``'s reduction iters."""
    var = sch.get(loop).loop_var
    realize = get_sblock_realize(sch, blk)
    return any(
        it.iter_type != tirx.IterVar.DataPar and uses_var(val, var)
        for it, val in zip(sch.get(blk).iter_vars, realize.iter_values)
    )


def schedule_leftover_stage(sch, blk, target) -> None:
    """A root stage next to a contraction that no other step took (a pad, a transpose, a
    prologue reduction the row stage could not take): parallel and vectorized if injective, at
    least parallel rows otherwise."""
    if all(it.iter_type == tirx.IterVar.DataPar for it in sch.get(blk).iter_vars):
        schedule_injective_block(sch, blk, target)
    else:
        try_primitive(schedule_nest, sch, blk, target)

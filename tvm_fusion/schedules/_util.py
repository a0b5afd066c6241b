"""Helpers shared by the CPU schedule rules: target facts, access analysis, injective loop nests."""

from __future__ import annotations

import functools
import logging
import math
import os

import tvm
from tvm import DataType, s_tir, sym, tirx
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.s_tir.dlight.base import ScheduleRule
from tvm.target import Target
from tvm.target.codegen import target_has_features

from ..ir import tir_stmts

logger = logging.getLogger("tvm_fusion.schedules")

# Annotation the meta-schedule RewriteLayout postproc puts on a weight-packing block; the Relax pass
# SplitLayoutRewritePreproc lifts blocks carrying it into their own PrimFunc, so FoldConstant can
# evaluate the packing at compile time when the weight is a relax.Constant.
LAYOUT_REWRITE_PREPROC = "meta_schedule.layout_rewrite_preproc"
# Below this many elements an injective nest or a plain reduction runs single-threaded: a fork-join
# of the thread pool costs ~1.5 us here, more than the work (2 threads vs 1, znver4: a global mean
# 32x16x16 1.5 vs 0.9 us, 96x14x14 2.1 vs 1.8, 576x7x7 2.9 vs 3.5; a channel-scale multiply
# 32x16x16 1.9 vs 1.3, 96x14x14 2.3 vs 2.3, 576x7x7 3.2 vs 4.2).
PARALLEL_MIN_ELEMENTS = 20_000

get_sblock_realize = tvm.get_global_func("s_tir.schedule.GetSBlockRealize")


def vector_bits(target: Target) -> int:
    """SIMD register width. (``llvm_get_vector_width`` answers 512 for every x86 CPU in this TVM.)"""
    try:
        if target_has_features("avx512f", target):
            return 512
        if target_has_features("avx", target):
            return 256
    except Exception:  # pragma: no cover - non-x86 LLVM target
        pass
    return 128


def vector_lanes(target: Target, dtype: str = "float32") -> int:
    bits = DataType(str(dtype)).bits
    return max(vector_bits(target) // max(bits, 8), 1)


def num_vector_registers(target: Target) -> int:
    return 32 if vector_bits(target) == 512 else 16


def num_cores(target: Target) -> int:
    cores = target.attrs.get("num-cores") if target is not None else None
    return int(cores) if cores else (os.cpu_count() or 1)


def is_cpu(target: Target) -> bool:
    return target is not None and target.kind.name in ("llvm", "c")


def int_extent(sch: s_tir.Schedule, loop) -> int | None:
    ext = sch.get(loop).extent
    return int(ext) if isinstance(ext, tirx.IntImm) else None


def layout_free_params(func: tirx.PrimFunc) -> set:
    """The params of ``func`` marked layout-free (constant weights a schedule may repack); in this
    TVM a PrimFunc param *is* its buffer."""
    idx = func.attrs.get("layout_free_buffers") if func.attrs is not None else None
    return {func.params[int(i)] for i in idx} if idx else set()


def operand_reads(stmt) -> list:
    """A reduction block's read regions other than its own output (the accumulator it reads back)."""
    out = stmt.writes[0].source
    return [r for r in stmt.reads if not r.source.same_as(out)]


def access_class(region, var) -> str:
    """How a block iter var moves a buffer access: 'invariant', 'contiguous' (last dim, stride 1) or 'strided'."""
    ndim = len(region.region)
    used_dims = []
    for d, rng in enumerate(region.region):
        if not is_one(rng.extent):
            # a range access (not a point): treat as strided unless v is absent from it
            if uses_var(rng.min, var) or uses_var(rng.extent, var):
                return "strided"
            continue
        if uses_var(rng.min, var):
            used_dims.append(d)
    if not used_dims:
        return "invariant"
    if used_dims == [ndim - 1]:
        coeff = linear_coeff(region.region[-1].min, var)
        if coeff == 1:
            return "contiguous"
    if used_dims == [ndim - 2, ndim - 1] and _is_split_plane(region, var):
        return "contiguous"  # [.., v // W, v % W] of an [.., H, W] buffer: v walks it linearly
    return "strided"


def group_width(region, var) -> int | None:
    """``G`` when ``var`` moves the access only through ``var // G`` (a grouped conv's input
    channel ``oc // G * Cg + rc``, ``G`` output channels a group; the gcd when several such
    divisions use it), else None: the access is then invariant along any tile of ``var`` whose
    width divides ``G`` and starts at a multiple of it."""
    widths = []

    def visit(expr) -> bool:  # False: var used otherwise than as var // G
        if isinstance(expr, tirx.FloorDiv) and expr.a.same_as(var) and isinstance(expr.b, tirx.IntImm):
            widths.append(int(expr.b))
            return True
        if not uses_var(expr, var):
            return True
        operands = [getattr(expr, f) for f in ("a", "b") if hasattr(expr, f)]
        return bool(operands) and all(visit(x) for x in operands)

    for rng in region.region:
        if not (visit(rng.min) and visit(rng.extent)):
            return None
    return math.gcd(*widths) if widths else None


def _is_split_plane(region, var) -> bool:
    """``[.., v // W, v % W]`` on a buffer whose last dim is W (a flattened plane, see plane.py)."""
    hi, lo = region.region[-2].min, region.region[-1].min
    width = region.source.shape[-1]
    return (
        isinstance(hi, tirx.FloorDiv)
        and isinstance(lo, tirx.FloorMod)
        and hi.a.same_as(var)
        and lo.a.same_as(var)
        and all(isinstance(x, tirx.IntImm) and int(x) == int(width) for x in (hi.b, lo.b))
    )


def last_dim_stride(region, var) -> int | None:
    """The constant stride of var when it moves only the last dim of a point access, else None."""
    ndim = len(region.region)
    for d, rng in enumerate(region.region):
        if not is_one(rng.extent):
            return None
        if d < ndim - 1 and uses_var(rng.min, var):
            return None
    return linear_coeff(region.region[-1].min, var)


def bare_var_dim(region, var) -> int | None:
    """The single dim of region indexed exactly by var (and var used nowhere else), else None."""
    found = None
    for d, rng in enumerate(region.region):
        if uses_var(rng.min, var) or uses_var(rng.extent, var):
            if found is not None or not (isinstance(rng.min, tirx.Var) and rng.min.same_as(var)):
                return None
            if not is_one(rng.extent):
                return None
            found = d
    return found


def linear_coeff(expr, var) -> int | None:
    try:
        res = sym.detect_linear_equation(expr, [var])
    except Exception:  # pragma: no cover
        return None
    if len(res) != 2 or not isinstance(res[0], tirx.IntImm):
        return None
    return int(res[0])


def is_one(expr) -> bool:
    return isinstance(expr, tirx.IntImm) and int(expr) == 1


def uses_var(expr, var) -> bool:
    """Whether expr mentions var."""
    return any(v.same_as(var) for v in tirx.analysis.undefined_vars(expr))


def computed_within(sch: s_tir.Schedule, consumer, producer, loop) -> bool:
    """Whether ``consumer``, computed under ``loop`` (after ``reverse_compute_at``), reads per
    iteration at most as many of ``producer``'s points as the producer writes there.

    ``reverse_compute_at`` gives the consumer the box around the image of the producer's
    iteration. For an elementwise epilogue that box is the tile itself; a reshape that scatters the
    tile gets a larger box, whose extra points read values other iterations compute: wrong numbers
    (MobileViT's unfold ``[144, 32, 32] -> [2304, 2, 16, 2]`` after a 1x1 conv tiled 8 channels x 1
    row: 113 x 16 x 2 points per tile of 256, relative error 1.3). Such a consumer has to stay a
    stage of its own. Only the consumer's loops that index the producer count: a broadcast
    consumer (a row's sum times each of its C elements) reads one point per row."""
    stmt = sch.get(consumer)
    buffer = sch.get(producer).writes[0].source
    indexing = {
        v
        for region in stmt.reads
        if region.source.same_as(buffer)
        for r in region.region
        for v in tirx.analysis.undefined_vars(r.min)
    }
    reading = [
        value
        for iv, value in zip(stmt.iter_vars, get_sblock_realize(sch, consumer).iter_values)
        if any(iv.var.same_as(v) for v in indexing)
    ]
    produced = _points_under(sch, producer, loop, _spatial_bindings(sch, producer))
    read = _points_under(sch, consumer, loop, reading)
    return produced is not None and read is not None and read <= produced


def reverse_compute_within(sch: s_tir.Schedule, consumer, producer, loop, preserve_unit_loops=False) -> bool:
    """``reverse_compute_at(consumer, loop)`` if the consumer then reads within the producer's
    iteration (:func:`computed_within`), or, with ``producer`` None, within the iteration of every
    block it reads (a chain of epilogue blocks placed one after the other), and its loops still
    cover its whole domain (:func:`_covers_domain`); else False, with ``sch`` untouched."""
    probe = sch.copy()
    if not try_primitive(probe.reverse_compute_at, consumer, loop, preserve_unit_loops):
        return False
    producers = [producer] if producer is not None else probe.get_producers(consumer)
    if not all(computed_within(probe, consumer, p, loop) for p in producers):
        return False
    if not _covers_domain(probe, consumer):
        return False
    sch.reverse_compute_at(consumer, loop, preserve_unit_loops)
    return True


def _covers_domain(sch: s_tir.Schedule, block) -> bool:
    """Whether ``block``'s loops run at least as many iterations as its domain has points.
    ``reverse_compute_at`` can infer a box that misses part of the consumer: ConvBERT's 192 -> 27
    linear, its output padded to 32 columns and reshaped to [384, 9, 1] as the epilogue, got
    25 x 5 points per tile of 8 rows (24 x 9 needed), so columns 5-8 were never written (NaN
    outputs). Unknown with a symbolic extent (True: nothing to compare)."""
    iterations = 1
    for loop in sch.get_loops(block):
        extent = int_extent(sch, loop)
        if extent is None:
            return True
        iterations *= extent
    points = 1
    for iv in sch.get(block).iter_vars:
        if not isinstance(iv.dom.extent, tirx.IntImm):
            return True
        points *= int(iv.dom.extent)
    return iterations >= points


def _spatial_bindings(sch: s_tir.Schedule, block) -> list:
    stmt = sch.get(block)
    realize = get_sblock_realize(sch, block)
    return [
        value
        for iv, value in zip(stmt.iter_vars, realize.iter_values)
        if iv.iter_type == tirx.IterVar.DataPar
    ]


def _points_under(sch: s_tir.Schedule, block, loop, bindings) -> int | None:
    """Iterations of ``block``'s loops below ``loop`` that some of ``bindings`` (the block's iter
    values) use; None if ``loop`` is not around the block or such a count is not static."""
    loops = sch.get_loops(block)
    at = next((i for i, lp in enumerate(loops) if sch.get(lp).same_as(sch.get(loop))), None)
    if at is None:
        return None
    points = 1
    for lp in loops[at + 1 :]:
        if not any(uses_var(value, sch.get(lp).loop_var) for value in bindings):
            continue
        extent = int_extent(sch, lp)
        if extent is None:
            return None
        points *= extent
    return points


def divisors_upto(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def schedule_injective_block(sch: s_tir.Schedule, block, target: Target, parallel: bool = True) -> None:
    """Parallelize the outer loops and vectorize the inner loop of a root-level spatial block."""
    loops = sch.get_loops(block)
    if not loops:
        return
    stmt = sch.get(block)
    dtype = stmt.writes[0].source.dtype if stmt.writes else "float32"
    lanes = vector_lanes(target, dtype)
    extents = [int_extent(sch, lp) for lp in loops]
    symbolic_outer = extents[0] is None
    if None in extents[1:] or (symbolic_outer and len(loops) == 1):
        try_primitive(sch.parallel, loops[0]) if parallel else None
        return
    # drop the unit loops, they only get in the way of fuse/split decisions
    inner = loops[-1]
    inner_ext = extents[-1]
    vec = None
    outer_loops = loops[:-1]
    vec_tiles = [lanes] if inner_ext % lanes == 0 else []
    if vec_tiles:
        if inner_ext > vec_tiles[0]:
            o, vec = sch.split(inner, factors=[None, vec_tiles[0]])
            outer_loops = outer_loops + [o]
        else:
            vec = inner
    elif 2 <= inner_ext <= lanes:
        vec = inner
    else:
        # odd inner extent: split off a divisor (never a tail: a predicate would scalarize the loop)
        cands = [d for d in divisors_upto(inner_ext, lanes) if d >= 4]
        if cands:
            o, vec = sch.split(inner, factors=[None, cands[-1]])
            outer_loops = outer_loops + [o]
        else:
            outer_loops = outer_loops + [inner]
    if parallel and outer_loops:
        cores = num_cores(target)
        # fuse leading loops until there is enough parallel work, keep the rest serial
        outer_ext = [int_extent(sch, lp) or 1 for lp in outer_loops]
        k, prod = 0, 1
        while k < len(outer_loops) and prod < 16 * cores:
            prod *= outer_ext[k]
            k += 1
        fused = sch.fuse(*outer_loops[:k]) if k > 1 else outer_loops[0]
        if prod > 1 or symbolic_outer:
            try_primitive(sch.parallel, fused)
    if vec is not None:
        try_primitive(sch.vectorize, vec)


def try_primitive(fn, *args) -> bool:
    """Apply a schedule primitive; False (and the schedule unchanged) if it refuses."""
    try:
        fn(*args)
        return True
    except Exception as err:  # schedule primitives validate and raise before mutating
        logger.debug("schedule primitive %s failed: %s", getattr(fn, "__name__", fn), err)
        return False


def safe_rule(apply):
    """Wrap a rule's apply (or a method it schedules with) so that any schedule error means 'not
    applicable': None, and the next rule runs."""

    @functools.wraps(apply)
    def wrapper(self, *args, **kwargs):
        try:
            sch = apply(self, *args, **kwargs)
            missing = undefined_buffers(sch.mod["main"]) if isinstance(sch, s_tir.Schedule) else None
        except Exception as err:  # pylint: disable=broad-except
            logger.debug("%s did not apply: %s", type(self).__name__, err)
            return None
        if missing:
            logger.warning(
                "%s scheduled a kernel that reads %s, which it no longer defines (a schedule "
                "primitive's bug); the kernel gets the next rule's schedule instead",
                type(self).__name__,
                ", ".join(sorted(missing)),
            )
            return None
        return sch

    return wrapper


def undefined_buffers(func: tirx.PrimFunc) -> set:
    """Names of the buffers blocks of ``func`` read or write that are neither parameters nor
    allocated anywhere in it: lowering fails on them ("used before its definition")."""
    defined = [p for p in func.params if isinstance(p, tirx.Buffer)]
    blocks = []
    for node in tir_stmts(func):
        if isinstance(node, s_tir.SBlock):
            blocks.append(node)
            defined.extend(node.alloc_buffers)
            defined.extend(m.buffer for m in node.match_buffers)
        elif isinstance(node, (tirx.AllocBuffer, tirx.DeclBuffer)):
            defined.append(node.buffer)
    return {
        region.source.name
        for blk in blocks
        for region in (*blk.reads, *blk.writes)
        if not any(region.source.same_as(buf) for buf in defined)
    }


class Declining(ScheduleRule):
    """Another rule, made to decline where it raises (dlight's GPU GEMV rule asserts on a
    multiply+add+relu+mean kernel instead of returning None), so the next rule in the list runs,
    as ``safe_rule`` does for our CPU rules. ``ApplyDefaultSchedule`` lets one exception abort the
    whole pass."""

    def __init__(self, rule: ScheduleRule):
        self.rule = rule

    def is_target_available(self, target: Target) -> bool:
        return self.rule.is_target_available(target)

    def apply(self, func, target, tunable):
        try:
            return self.rule.apply(func, target, tunable)
        except Exception as err:  # pylint: disable=broad-except
            logger.debug("%s declined: %s: %s", type(self.rule).__name__, type(err).__name__, err)
            return None

    def __repr__(self) -> str:
        return f"Declining({type(self.rule).__name__})"


def collect_loops(func_or_stmt) -> list:
    """All tirx.For loops under a PrimFunc / Stmt."""
    return [node for node in tir_stmts(func_or_stmt) if isinstance(node, tirx.For)]


def loop_kinds(func) -> set:
    return {loop.kind for loop in collect_loops(func)}


def stage_blocks(sch: s_tir.Schedule, annotation: str) -> dict:
    """``{stage: block}`` for the root blocks of a schedule annotated ``annotation`` (how the
    rules for our legalized ops, Winograd and depthwise, find their stages after FuseTIR)."""
    found = {}
    for blk in sch.get_child_blocks(sch.get_sblock("root")):
        stage = sch.get(blk).annotations.get(annotation)
        if stage is not None:
            found[str(stage)] = blk
    return found


def reachable_blocks(sch, block, step) -> list:
    """Every block reachable from block by ``step`` (``sch.get_producers`` or
    ``sch.get_consumers``), transitively, nearest first, without duplicates."""
    seen, out, queue = set(), [], list(step(block))
    while queue:
        blk = queue.pop(0)
        name = sch.get(blk).name_hint
        if name in seen:
            continue
        seen.add(name)
        out.append(blk)
        queue.extend(step(blk))
    return out


def elementwise_epilogue(sch, block) -> list | None:
    """The elementwise blocks after ``block`` (crop, bias, clip, a residual add, SiLU's
    ``x * sigmoid(x)``, which reads the value twice), nearest first, ending with the one that
    writes the result; None when the result feeds a reduction or more than one output (another
    rule's kernel). Every block but the last can be ``compute_inline``-d into its consumers."""
    blocks = reachable_blocks(sch, block, sch.get_consumers)
    if any(iv.iter_type != tirx.IterVar.DataPar for b in blocks for iv in sch.get(b).iter_vars):
        return None
    sinks = [b for b in blocks if not sch.get_consumers(b)]
    if len(sinks) != 1:
        return None
    last = sch.get(sinks[0]).name_hint
    return [b for b in blocks if sch.get(b).name_hint != last] + sinks


class CpuRule(ScheduleRule):
    """A dlight schedule rule for LLVM CPU targets."""

    def is_target_available(self, target: Target) -> bool:
        return is_cpu(target)

    def normalized(self, func, target: Target):
        """``(schedule, block infos)`` of func in dlight's normal form, or None when this rule
        cannot look at it (not a PrimFunc, not a CPU target, not normalizable)."""
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        sch = s_tir.Schedule(func)
        infos = normalize_prim_func(sch)
        return (sch, infos) if infos else None

    def staged(self, func, target: Target, annotation: str):
        """``(schedule, {stage: block})`` of a kernel our legalizations wrote (its root blocks
        annotated ``annotation``: see :func:`stage_blocks`), or None when this rule cannot look at
        it (not a PrimFunc, not a CPU target)."""
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        sch = s_tir.Schedule(func)
        return sch, stage_blocks(sch, annotation)

"""Helpers for the kernels our legalizations write in stages (Winograd conv, Strassen matmul).

Such a kernel ends with an ``output`` block that computes the op's result from a small
intermediate; FuseTIR appends the fused epilogue (bias, activation, residual add) after it. The
schedules inline the whole chain into its last block, tile that block into parallel tasks and
compute the intermediate under each task, so it never goes to memory at full size.
"""

from __future__ import annotations

import math

import tvm
from tvm import tirx
from tvm.sym import Analyzer

from ._util import CpuRule, elementwise_epilogue, safe_rule
from .knobs import Knobs


def static_domain(sch, block) -> list[int | None]:
    """The extents of ``block``'s iterators, None where symbolic."""
    extents = [iv.dom.extent for iv in sch.get(block).iter_vars]
    return [int(e) if isinstance(e, tirx.IntImm) else None for e in extents]


def iterate_as_output(sch, chain: list, dims: list[int | None]) -> bool:
    """Make the last block of the epilogue ``chain`` iterate over the op's output (``dims``: a
    conv's ``[b, k, h, w]``), which the schedule's task tiling splits. A reshape at the end of the
    chain (a GroupNorm's grouped view of the conv's output, ``[N, G, C/G, H, W]`` as BiT's
    GroupNorm(32) gives it, or ``[N, 1, C·H·W]`` for one group) iterates over its own shape; it
    is re-indexed in row-major order, which changes only the order of its iterations, not what
    each one writes. A last block of the output's rank is taken as it is (a crop, a bias add).
    Re-indexed only when every other block iterates over ``dims`` and the last one over another
    rank (only views change the rank; a transpose after the reshape would be a block of its own,
    not over ``dims``) with as many points, all static; else False."""
    own = static_domain(sch, chain[-1])
    if len(own) == len(dims):
        return True
    if any(static_domain(sch, blk) != dims for blk in chain[:-1]):
        return False
    if None in own or None in dims or math.prod(own) != math.prod(dims):
        return False
    block = chain[-1]

    def row_major(*old):
        # simplified per dim (k = g * C/G + j // HW, not (g * C/G * HW + j) // HW): the inverse
        # TVM derives from it then indexes the conv's output plainly, which compute_at needs
        analyzer = Analyzer()
        flat = 0
        for var, extent in zip(old, own):
            analyzer.bind(var, tvm.ir.Range(0, extent))
            flat = flat * extent + var
        new = []
        for extent in reversed(dims):
            new.append(analyzer.simplify(flat % extent))
            flat = flat // extent
        return new[::-1]

    sch.transform_block_layout(block, tirx.IndexMap.from_func(row_major, ndim=len(own)))
    return True


def drop_unit_dims(sch, block, dims: list[int | None]) -> bool:
    """Make ``block`` iterate over ``dims`` when its own domain differs from it only by unit dims
    (a ``[1, 128, 768]`` view of a ``[128, 768]`` result, as GPT-2's TorchScript export reshapes
    its linear layers' output before the residual add): the same points in the same order, the
    unit iterators dropped or added, so every index stays as plain as it was. False otherwise
    (then nothing changed)."""
    own = static_domain(sch, block)
    if own == dims:
        return True
    if None in own or None in dims or [d for d in own if d != 1] != [d for d in dims if d != 1]:
        return False

    index_dtype = "int64"  # the iterators IndexMap.from_func makes (a Var has no .dtype here)

    def without_units(*old):
        kept = iter([var for var, extent in zip(old, own) if extent != 1])
        return [tirx.const(0, index_dtype) if extent == 1 else next(kept) for extent in dims]

    sch.transform_block_layout(
        block, tirx.IndexMap.from_func(without_units, ndim=len(own), index_dtype=index_dtype)
    )
    return True


def inline_epilogue(sch, output) -> tuple | None:
    """Inline ``output`` and its elementwise epilogue into the chain's last block: ``(final,
    kept)``, the block that writes the result and the blocks left as stages (in program order,
    for the caller to compute under ``final``'s loops), or None when the epilogue is not an
    elementwise chain over the output's shape (``iterate_as_output``). A value feeding two
    blocks (SiLU's ``x * sigmoid(x)``) stays a stage: inlined, the output's sums would be copied
    into every use (LLVM took 15 s instead of 1.6 s on one Winograd conv)."""
    epilogue = elementwise_epilogue(sch, output) if sch.get_consumers(output) else []
    if epilogue is None:
        return None
    chain = [output, *epilogue]
    if not iterate_as_output(sch, chain, static_domain(sch, output)):
        return None
    return chain[-1], inline_chain(sch, chain)


def inline_chain(sch, chain: list) -> list:
    """Inline every block of an elementwise ``chain`` but its last into its consumers, except a
    value two blocks read (see :func:`inline_epilogue`): those are returned, in program order, as
    stages for the caller to place."""
    shared = {sch.get(b).name_hint for b in chain[:-1] if len(sch.get_consumers(b)) > 1}
    kept = [b for b in sch.get_child_blocks(sch.get_sblock("root")) if sch.get(b).name_hint in shared]
    for blk in chain[:-1]:
        if sch.get(blk).name_hint not in shared:
            sch.compute_inline(blk)
    return kept


def read_index(sch, block, buf) -> int:
    """The position of ``buf`` among ``block``'s reads."""
    for i, region in enumerate(sch.get(block).reads):
        if region.source.same_as(buf):
            return i
    raise ValueError("buffer not read by block")


class StagedKernelRule(CpuRule):
    """A rule for the kernels one of our legalizations writes in stages: it takes a kernel whose
    root blocks carry ``STAGE`` annotations (a ``gemm`` stage among them, annotated
    ``SIGNATURE`` with the op's shapes) and hands it to ``_schedule``; where that returns None,
    ``declined`` says what happens (the kernel is this rule's to schedule all the same).
    ``knobs`` forces decisions (tuning), ``last_knobs`` holds those of the last ``apply``."""

    STAGE = ""
    SIGNATURE = ""

    def __init__(self, prepack: bool = True, knobs: dict[str, int] | None = None):
        self.prepack = prepack
        self.knobs = dict(knobs or {})
        self.last_knobs: Knobs | None = None

    @safe_rule
    def apply(self, func: tirx.PrimFunc, target, tunable: bool):
        opened = self.staged(func, target, self.STAGE)
        if opened is None or "gemm" not in opened[1]:
            return None  # not a kernel this rule's legalization wrote
        sch, stages = opened
        signature = str(sch.get(stages["gemm"]).annotations.get(self.SIGNATURE, "?"))
        scheduled = self._schedule(sch, stages, func, target, tunable)
        return self.declined(func, target, signature) if scheduled is None else scheduled

    def _schedule(self, sch, stages: dict, func, target, tunable: bool):
        raise NotImplementedError

    def declined(self, func, target, signature: str):
        """The schedule of a kernel ``_schedule`` could not take (None: the next rules')."""
        return None

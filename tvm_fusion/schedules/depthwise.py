"""CPU schedule for the depthwise / narrow grouped conv kernels ``legalize/depthwise_conv.py``
writes (+ epilogue).

The stages are found by their ``tvm_fusion.depthwise`` block annotations (FuseTIR keeps them).
One parallel task is one group (one channel, for a depthwise conv) and a block of ``rows`` output
rows:

* ``pad`` (zero padding; with stride 2, the ``phase`` split after it, which computes the padding
  too) is computed inside the task, only for the input rows the task reads: they stay in L1 (a
  whole padded copy of a 112×112×96 input is 5 MB of memory traffic);
* ``conv``: per block of ``channels`` output channels of the group and vector of output columns,
  the ``cig × kh × kw`` window unrolled around ``channels × rows`` vector accumulators in
  registers; every step is one contiguous (misaligned) vector load per row, shared by the block's
  channels, and one FMA per accumulator with a broadcast weight (a depthwise channel's 9 weights
  are loop-invariant: LLVM keeps them in registers for the whole task);
* the epilogue (crop, bias, clip, residual add) is computed from the accumulators right after
  each vector of columns, so the conv's result never goes to memory before it.

Tunable decisions (:mod:`.knobs`): ``rows`` (output rows per task: the model's pick, then the
other divisors of the height up to ``MAX_ROWS``), ``lanes`` (a whole SIMD vector or half one per
accumulator), ``channels`` (output channels per micro-kernel, for grouped convs) and, with a
stride, ``pad`` (the zero padding inside the phase copy, the default, or as its own copy).
"""

from __future__ import annotations

from tvm import tirx
from tvm.target import Target

from ..legalize.depthwise_conv import GROUP_OUT, PAD_COLUMNS, STAGE
from ._util import (
    CpuRule,
    divisors_upto,
    elementwise_epilogue,
    int_extent,
    num_vector_registers,
    reverse_compute_within,
    safe_rule,
    try_primitive,
    vector_lanes,
)
from .knobs import Knobs

MAX_ROWS = 8  # output rows per task
PAD_IN_PHASE_COPY = 0  # the "pad" decision's choice that inlines the padding (stride > 1 only)


def row_choices(height: int, group_out: int = 1, registers: int = 32) -> list[int]:
    """Rows per task, the default first: the most (≤ ``MAX_ROWS``) that divide the height. With
    several output channels per group, the rows and channels of a micro-kernel share its
    accumulators, and each step loads one input vector per row and one weight per channel: the
    default is then the divisor whose micro-kernel loads least per FMA (RGB stem 3->64 7x7 stride
    2: 4 rows x 4 channels 1.13 ms, 8 x 2 1.29 ms)."""
    rows = divisors_upto(height, MAX_ROWS)[::-1]
    if group_out > 1:

        def loads_per_fma(r):
            together = channel_choices(group_out, r, registers)[0]
            return (r + together) / (r * together)

        rows.sort(key=lambda r: (round(loads_per_fma(r), 3), -r))
    return rows[:4]


def channel_choices(group_out: int, rows: int, registers: int) -> list[int]:
    """Output channels computed together (they share each input vector load), the default first:
    as many as keep the accumulators (``rows`` each) within half the vector registers (RegNet's
    104x28x28 conv in groups of 8: 14 accumulators 0.041-0.043 ms in two of three runs, 28: 0.061
    ms). The tuner may also try up to all of the registers (an input vector and a weight need two)."""
    fits = [d for d in divisors_upto(group_out, group_out) if d * rows + 2 <= registers] or [1]
    half = [d for d in fits if d * rows <= registers // 2] or [1]
    return [half[-1]] + [d for d in fits[::-1] if d != half[-1]][:3]


def lane_choices(width: int, lanes: int) -> list[int]:
    """Vector widths that divide the (padded) output width, the widest first."""
    return [v for v in (lanes, lanes // 2) if v >= 4 and width % v == 0] or [width]


class Depthwise(CpuRule):
    """The depthwise / narrow grouped conv schedule (see module docstring); declines anything else."""

    def __init__(self, knobs: dict[str, int] | None = None, **_):
        self.knobs = dict(knobs or {})
        self.last_knobs: Knobs | None = None

    @safe_rule
    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool):
        opened = self.staged(func, target, STAGE)
        if opened is None:
            return None
        sch, stages = opened
        if set(stages) - {"crop", "phase"} != {"pad", "conv"}:
            return None
        conv, pad = stages["conv"], stages["pad"]
        epilogue = elementwise_epilogue(sch, conv)
        staged = 3 if "phase" in stages else 2
        if epilogue is None or len(sch.get_child_blocks(sch.get_sblock("root"))) != staged + len(epilogue):
            return None
        loops = sch.get_loops(conv)
        extents = [int_extent(sch, lp) for lp in loops]
        if len(loops) != 7 or None in extents[1:]:  # the batch may be symbolic (an outer loop)
            return None
        group_out = int(sch.get(conv).annotations.get(GROUP_OUT, 1))
        knobs = self.last_knobs = Knobs(self.knobs, tunable)
        registers = num_vector_registers(target)
        rows_options = row_choices(extents[2], group_out, registers)
        rows = rows_options[knobs.choose(sch, "rows", len(rows_options))]
        lane_options = lane_choices(extents[3], vector_lanes(target, "float32"))
        vt = lane_options[knobs.choose(sch, "lanes", len(lane_options))]
        channel_options = channel_choices(group_out, rows, registers)
        together = channel_options[knobs.choose(sch, "channels", len(channel_options))]

        # accumulators in registers; the epilogue reads them (write-back, crop and every
        # elementwise step inlined into its last block)
        epilogue.insert(0, sch.cache_write(conv, 0, "local"))
        for blk in epilogue[:-1]:
            sch.compute_inline(blk)
        final = epilogue[-1]

        b_l, k_l, y_l, x_l, ic_l, kh_l, kw_l = sch.get_loops(conv)
        # a task: one group's channels (k_o x k_u), a block of rows
        g_l, k_o, k_u = sch.split(k_l, factors=[None, group_out // together, together])
        y_o, y_i = sch.split(y_l, factors=[None, rows])
        x_o, x_i = sch.split(x_l, factors=[None, vt])
        sch.reorder(b_l, g_l, y_o, k_o, x_o, ic_l, kh_l, kw_l, k_u, y_i, x_i)
        task = sch.fuse(b_l, g_l, y_o)
        sch.parallel(task)
        for loop in (kh_l, kw_l, k_u, y_i):
            sch.unroll(loop)
        sch.vectorize(x_i)
        init = sch.decompose_reduction(conv, ic_l)
        try_primitive(sch.vectorize, sch.get_loops(init)[-1])

        # the epilogue right after each vector of columns (accumulators still in registers); when
        # the width was padded, once per block of channels over whole rows instead: a cropped
        # last vector would need a predicate, which keeps TVM from vectorizing
        if not reverse_compute_within(sch, final, conv, k_o if "crop" in stages else x_o, True):
            return None  # a reshape that scatters the tile: another rule computes it apart
        f_k, f_y, f_x = sch.get_loops(final)[-3:]
        sch.unroll(f_k)
        sch.unroll(f_y)
        try_primitive(sch.vectorize, f_x)

        # the copies into the task's padded rows stay plain loops: LLVM's loop vectorizer turns
        # the stride-2 reads of the phase split into wide loads + shuffles (TVM's vectorizer
        # would load lane by lane: 0.27 vs 0.17 ms at 96x112x112), and the pad's border
        # condition into masked loads (decompose_padding would give a condition-free copy, but
        # TVM 0.27 cannot print a trace that uses it, which aborts Meta-Schedule's search)
        if "phase" in stages:
            sch.compute_at(stages["phase"], task, preserve_unit_loops=True)
            # in the padded row's order (phase innermost, unrolled): LLVM then sees one
            # interleaved load group and ``stride`` contiguous stores. Phase-major, it vectorized
            # the short rows of small planes across rows with gathers and scatters instead
            # (efficientnet_b0's 672x14x14 5x5: 0.108 -> 0.037 ms; mobilenet_v3's 288x14x14: 0.050
            # -> 0.019 ms)
            _, phase_r, phase_q = sch.get_loops(stages["phase"])[-3:]
            sch.reorder(phase_q, phase_r)
            sch.unroll(phase_r)
        if "phase" in stages and knobs.choose(sch, "pad", 2) == PAD_IN_PHASE_COPY:
            _pad_in_phase_copy(sch, pad, stages["phase"])
        else:
            sch.compute_at(pad, task, preserve_unit_loops=True)
        return sch


def _pad_in_phase_copy(sch, pad, phase) -> None:
    """Compute the zero padding inside the phase copy, with that copy's column loop split into
    its two borders and the interior, where every column is inside the input: the interior
    copies without column masks (the simplifier drops the test; the row test does not depend on
    the column), one copy instead of two. Measured against the padding's own (masked) copy on 12
    stride-2 shapes, 3x3 and 5x5: 10-33 % faster on every one (96x112x112 0.114 -> 0.092 ms,
    144x56x56 0.060 -> 0.047). Without the split, LLVM vectorized the conditional stride-2 copy
    of some shapes badly (144x56x56: 0.13-0.19 ms)."""
    columns = sch.get(pad).annotations.get(PAD_COLUMNS)
    q_loop, r_loop = sch.get_loops(phase)[-2:]
    stride = int(sch.get(phase).writes[0].source.shape[3])  # P[b, c, y, r, q]
    phases = int_extent(sch, r_loop)  # the phases the conv reads: fewer than stride if kw < stride
    sch.compute_inline(pad)
    if columns is None:
        return
    left, width = (int(v) for v in columns)
    # input column q * stride + r - left, for every r < phases, is inside [0, width) from q_start
    # up to q_stop
    extent = int_extent(sch, q_loop)
    q_start = min(-(-left // stride), extent)
    q_stop = max(q_start, min((width + left - phases) // stride + 1, extent))
    parts = [n for n in (q_start, q_stop - q_start, extent - q_stop) if n > 0]
    if len(parts) > 1:
        sch.loop_partition(q_loop, parts[:-1])  # the last part is the rest

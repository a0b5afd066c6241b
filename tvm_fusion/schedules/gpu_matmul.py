"""dlight's GPU ``Matmul`` rule with its configuration as tunable decisions (:mod:`.knobs`).

dlight picks one fixed configuration per target kind (for CUDA: 8x16 threads, 4x4 micro-tiles,
k-step 16, 2-wide vectors, unroll 256) and takes no tunable instructions. Here each field of that
configuration is a decision whose choice 0 is the rule's own pick, and the tuner
(``tuning.rule_space``) searches thread-block shape, micro-tile, k-step, vector width and unroll
per kernel. The decisions are recorded in the schedule's trace.

The rule's own pick is dlight's, with one change on CUDA: dlight's 32x64 output tile gives a GEMM
with a small output (BERT's 128x768 projections, a 7x7x512 conv) fewer thread blocks than an
A100/H100-class GPU has SMs, and each block walks the whole reduction alone; measured on an H200,
tuning halved such kernels with smaller tiles. So when dlight's grid has fewer than
:data:`MIN_BLOCKS` blocks, choice 0 is the first smaller tile that reaches it
(:data:`SMALLER_TILES`); dlight's own tile stays a point of the space.
"""

from __future__ import annotations

import dataclasses

from tvm import tirx
from tvm.s_tir import dlight as dl

from ._util import collect_loops
from .knobs import Knobs

# Alternatives per config field, tried after the rule's own pick (which is always choice 0).
ALTERNATIVES = {
    "threads": [(8, 16), (16, 16), (8, 8), (16, 8), (32, 8), (8, 32)],  # (block_size_x, block_size_y)
    "micro": [(4, 4), (2, 2), (4, 2), (2, 4), (8, 4), (4, 8)],  # (micro_size_x, micro_size_y)
    "k_step": [16, 8, 32],
    "vector": [2, 1, 4],
    "unroll": [256, 64, 0],
}
_FIELDS = {
    "threads": ("block_size_x", "block_size_y"),
    "micro": ("micro_size_x", "micro_size_y"),
    "k_step": ("micro_size_k",),
    "vector": ("vector_size",),
    "unroll": ("unroll",),
}

# About one thread block per SM on A100/H100-class GPUs (108 / 132 SMs), where it was measured;
# on a smaller GPU it only picks smaller tiles than needed (the tuner still tries dlight's).
MIN_BLOCKS = 128
# (threads, micro-tile) tried in order when dlight's 8x16 threads x 4x4 micro-tiles leave SMs idle.
SMALLER_TILES = [((8, 16), (4, 2)), ((8, 16), (2, 2)), ((8, 8), (2, 2))]


def thread_blocks(sch) -> int | None:
    """Thread blocks the scheduled kernel launches (None when the grid is not static). Assumes one
    kernel per function, as dlight's Matmul makes: every blockIdx loop is that kernel's grid."""
    blocks = 1
    for loop in collect_loops(sch.mod["main"]):
        if loop.thread_binding is not None and loop.thread_binding.thread_tag.startswith("blockIdx"):
            if not isinstance(loop.extent, tirx.IntImm):
                return None
            blocks *= loop.extent.value
    return blocks


class TunableMatmul(dl.gpu.Matmul):
    """``dl.gpu.Matmul`` whose config fields are knobs (``TunableMatmul(knobs={"threads": 1})``)."""

    def __init__(self, knobs: dict[str, int] | None = None):
        super().__init__()
        self.knobs = dict(knobs or {})
        self.last_knobs: Knobs | None = None
        self._config = None

    def get_configs(self, target):
        return self._config if self._config is not None else super().get_configs(target)

    def apply(self, func, target, tunable):
        base, checked = self._own_config(func, target, super().get_configs(target))
        if base is None:
            return None
        knobs = self.last_knobs = Knobs(self.knobs, tunable)
        changes = {}
        for name, alternatives in ALTERNATIVES.items():
            fields = _FIELDS[name]
            own = tuple(getattr(base, f) for f in fields)
            options = [own] + [tuple(a) if isinstance(a, tuple) else (a,) for a in alternatives]
            options = list(dict.fromkeys(options))  # the rule's own pick first, each value once
            changes.update(zip(fields, options[knobs.choose(None, name, len(options))]))
        if not self.knobs and not tunable:  # the knobs above still count the choices (rule_space)
            return checked  # untuned: the rule's own pick, which the check already built
        sch = self._apply_with(func, target, dataclasses.replace(base, **changes), tunable)
        if sch is not None:
            knobs.record(sch)
        return sch

    def _apply_with(self, func, target, config, tunable=False):
        self._config = config
        try:
            return super().apply(func, target, tunable)
        finally:
            self._config = None

    def _own_config(self, func, target, dlight_config):
        """``(config, its schedule)``: dlight's, or on CUDA the first smaller tile whose grid fills
        the GPU (else the one with the most blocks); ``(None, None)`` when dlight declines ``func``.
        Only dlight's own attempt decides whether the rule applies: a smaller tile that fails is
        skipped."""
        sch = self._apply_with(func, target, dlight_config)
        if sch is None:
            return None, None
        blocks = thread_blocks(sch)
        if (
            target.kind.name != "cuda"
            or blocks is None
            or blocks >= MIN_BLOCKS
            or any(inst.kind.name == "Tensorize" for inst in sch.trace.insts)  # config unused
        ):
            return dlight_config, sch
        best = (dlight_config, sch, blocks)
        for threads, micro in SMALLER_TILES:
            config = dataclasses.replace(
                dlight_config, **dict(zip(_FIELDS["threads"], threads)), **dict(zip(_FIELDS["micro"], micro))
            )
            try:
                smaller = self._apply_with(func, target, config)
            except Exception:  # noqa: BLE001  (dlight's own failure modes; its tile still works)
                continue
            blocks = None if smaller is None else thread_blocks(smaller)
            if blocks is None:
                continue
            if blocks >= MIN_BLOCKS:
                return config, smaller
            if blocks > best[2]:
                best = (config, smaller, blocks)
        return best[0], best[1]

"""dlight's GPU ``Matmul`` rule with its configuration as tunable decisions (:mod:`.knobs`).

dlight picks one fixed configuration per target kind (for CUDA: 8x16 threads, 4x4 micro-tiles,
k-step 16, 2-wide vectors, unroll 256) and takes no tunable instructions. Here each field of that
configuration is a decision whose choice 0 is dlight's own value, so untuned this is exactly
dlight's schedule, and the tuner (``tuning.rule_space``) searches thread-block shape, micro-tile,
k-step, vector width and unroll per kernel. The decisions are recorded in the schedule's trace.

One change to dlight's pick: its 32x64 output tile gives a GEMM with a small output (BERT's
128x768 projections, a 7x7x512 conv) fewer thread blocks than the GPU has SMs, and each block
walks the whole reduction alone; measured on an H200, tuning halved such kernels with smaller
tiles. So choice 0 is dlight's tile unless its grid leaves SMs idle, then the first smaller tile
that fills them (:data:`SMALLER_TILES`); dlight's own tile stays in the space.
"""

from __future__ import annotations

import dataclasses

from tvm import tirx
from tvm.s_tir import dlight as dl

from ._util import collect_loops
from .knobs import Knobs

# Alternatives per config field, tried after dlight's own value (which is always choice 0).
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

# About one thread block per SM on the GPUs we target (A100: 108 SMs, H100/H200: 132).
MIN_BLOCKS = 128
# (threads, micro-tile) tried in order when dlight's 8x16 threads x 4x4 micro-tiles leave SMs idle.
SMALLER_TILES = [((8, 16), (4, 2)), ((8, 16), (2, 2)), ((8, 8), (2, 2))]


def thread_blocks(sch) -> int | None:
    """Thread blocks the scheduled kernel launches (None when the grid is not static)."""
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
        base = self._own_config(func, target, super().get_configs(target))
        if base is None:
            return None
        knobs = self.last_knobs = Knobs(self.knobs, tunable)
        changes = {}
        for name, alternatives in ALTERNATIVES.items():
            fields = _FIELDS[name]
            own = tuple(getattr(base, f) for f in fields)
            options = [own] + [tuple(a) if isinstance(a, tuple) else (a,) for a in alternatives]
            options = list(dict.fromkeys(options))  # dlight's own value first, each value once
            changes.update(zip(fields, options[knobs.choose(None, name, len(options))]))
        self._config = dataclasses.replace(base, **changes)
        try:
            sch = super().apply(func, target, tunable)
        finally:
            self._config = None
        if sch is not None:
            knobs.record(sch)
        return sch

    def _own_config(self, func, target, dlight_config):
        """dlight's config, or the first smaller tile whose grid fills the GPU (else the one with
        the most blocks); None when the rule does not apply to ``func``."""
        best, best_blocks = dlight_config, -1
        for threads, micro in [(None, None), *SMALLER_TILES]:
            config = dlight_config
            if threads is not None:
                config = dataclasses.replace(
                    config,
                    block_size_x=threads[0],
                    block_size_y=threads[1],
                    micro_size_x=micro[0],
                    micro_size_y=micro[1],
                )
            self._config = config
            try:
                sch = super().apply(func, target, False)
            finally:
                self._config = None
            if sch is None:
                return None
            blocks = thread_blocks(sch)
            if blocks is None or blocks >= MIN_BLOCKS:
                return config
            if blocks > best_blocks:
                best, best_blocks = config, blocks
        return best

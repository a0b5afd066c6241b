"""dlight's GPU ``Matmul`` rule with its configuration as tunable decisions (:mod:`.knobs`).

dlight picks one fixed configuration per target kind (for CUDA: 8x16 threads, 4x4 micro-tiles,
k-step 16, 2-wide vectors, unroll 256) and takes no tunable instructions. Here each field of that
configuration is a decision whose choice 0 is dlight's own value, so untuned this is exactly
dlight's schedule, and the tuner (``tuning.rule_space``) searches thread-block shape, micro-tile,
k-step, vector width and unroll per kernel. The decisions are recorded in the schedule's trace.
"""

from __future__ import annotations

import dataclasses

from tvm.s_tir import dlight as dl

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
        base = super().get_configs(target)
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

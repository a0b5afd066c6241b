"""Tuning over our own rules' decisions: the search space is what the default schedule chose
among, so every candidate is a strong schedule and the space contains the default.

Meta-Schedule's stock space (generic multi-level tiling) measured 1.3-7x slower than our rules at
the trial counts a user can afford, so searching it mostly wastes trials. Here a task whose kernel
a rule with knobs schedules is tuned over that rule's decisions (:mod:`..schedules.knobs`; on CPU
``Contraction``: micro-kernel plan, reduction cache blocking, inputs computed per task,
accumulator placement; ``Winograd``: GEMM plan, tile blocks, loop order; ``Strassen``: plan;
``Depthwise``: rows, lanes, channels per task, where the padding is copied; on GPU
``TunableMatmul``: dlight's matmul config). The rule runs again from
scratch for each point, with the decisions forced and recorded in the trace as
``sample_categorical`` instructions, so a decision may change everything after it (the packed
weight layout follows the tile) and a record replays to exactly the schedule measured.

:class:`RuleSpaceSearch` is a Meta-Schedule search strategy: the default point first (the anchor),
then the points nearest the default, and once measurements exist, the points Meta-Schedule's
XGBoost cost model ranks best among a pool of unmeasured ones (with a share of random picks, so
the model keeps learning). It runs inside ``ms.tune.tune_tasks`` like any strategy: the same
builder, runner, database, cost-model updates and measure callbacks.
"""

from __future__ import annotations

import dataclasses
import itertools
import random

import tvm
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

from ..schedules import default_rules
from .packed_weights import measure_candidate

# Which algorithm a conv uses (direct / Winograd F(2) / F(4)) is decided before legalization, so it
# is no knob here: tuning measures each algorithm's kernel as a task of its own (conv_algorithms.py).
POOL_FACTOR = 4  # unmeasured points scored by the cost model per measured one
EXPLORE = 0.25  # share of each batch picked at random from the pool


@dataclasses.dataclass
class RuleSpace:
    """The knobs of the rule that schedules one kernel: the rule's class, the decision names and
    how many choices each has."""

    rule_type: type
    names: list[str]
    counts: list[int]

    @property
    def size(self) -> int:
        size = 1
        for count in self.counts:
            size *= count
        return size

    def points(self) -> list[tuple[int, ...]]:
        """Every point, nearest the default (all zeros) first."""
        return sorted(itertools.product(*(range(c) for c in self.counts)), key=lambda p: (sum(p), p))

    def schedule(self, func: tvm.tirx.PrimFunc, target, point: tuple[int, ...]):
        """``(schedule, effective point)`` for a point, or None when the rule declines it. The
        effective point says what was really decided (a knob not asked for under this plan is 0),
        so points that give the same schedule are measured once."""
        rule = self.rule_type(knobs=dict(zip(self.names, point)))
        try:
            sch = rule.apply(func, target, False)
        except Exception:  # a point the rule cannot realise (e.g. a GPU config too big for the kernel)
            return None
        if sch is None:
            return None
        asked = rule.last_knobs.counts
        effective = tuple(min(v, asked[n] - 1) if n in asked else 0 for n, v in zip(self.names, point))
        return sch, effective


def rule_space(func: tvm.tirx.PrimFunc, target) -> RuleSpace | None:
    """The tunable space of the rule that schedules ``func`` by default (a rule with knobs:
    ``Contraction``, ``Winograd``, ``Strassen`` and ``Depthwise`` on CPU, ``TunableMatmul`` on GPU),
    or None when that rule has no decision to make."""
    for rule in default_rules(target):
        rule = getattr(rule, "rule", rule)  # the rule inside a Declining wrapper (GPU list)
        try:
            sch = rule.apply(func, target, False)
        except Exception:
            sch = None
        if sch is None:
            continue
        knobs = getattr(rule, "last_knobs", None)
        if knobs is None:
            return None
        counts = {name: n for name, n in knobs.counts.items() if n > 1}
        # later knobs may have more choices under another choice of the first (Contraction's
        # "block" depends on the plan): take the widest seen
        first = next(iter(counts), None)
        for choice in range(1, counts.get(first, 1)):
            probe = type(rule)(knobs={first: choice})
            try:
                if probe.apply(func, target, False) is None:
                    continue
            except Exception:
                continue
            for name, n in probe.last_knobs.counts.items():
                if n > 1:
                    counts[name] = max(counts.get(name, 0), n)
        space = RuleSpace(type(rule), list(counts), list(counts.values()))
        return space if space.size > 1 else None
    return None


@dataclasses.dataclass
class SpaceProgress:
    """Points measured so far and in the batch being measured (shared with the caller, who keeps
    them in the manifest so a resumed run skips them)."""

    measured: set = dataclasses.field(default_factory=set)
    pending: list = dataclasses.field(default_factory=list)

    def done(self) -> list[list[int]]:
        return sorted(list(p) for p in self.measured | set(self.pending))


@derived_object
class RuleSpaceSearch(ms.search_strategy.PySearchStrategy):
    """Cost-model-guided search over a :class:`RuleSpace` (see module docstring)."""

    def __init__(self, space: RuleSpace, progress: SpaceProgress, seed: int = 0):
        super().__init__()
        self.space = space
        self.progress = progress
        self.seed = seed
        self.rng = random.Random(seed)

    def _initialize_with_tune_context(self, context) -> None:
        self.context = context
        self.func = context.mod["main"]
        self.target = context.target

    def pre_tuning(self, max_trials, num_trials_per_iter, design_spaces, database=None, cost_model=None):
        self.max_trials = int(max_trials)
        self.per_iter = int(num_trials_per_iter)
        self.cost_model = cost_model
        self.trials = 0
        self.todo = [p for p in self.space.points() if p not in self.progress.measured]

    def post_tuning(self) -> None:
        pass

    def _build(self, points) -> list[tuple]:
        """``(point, effective point, schedule)`` for the points the rule accepts, each effective
        point once and never one measured already."""
        built, seen = [], set(self.progress.measured)
        for point in points:
            result = self.space.schedule(self.func, self.target, point)
            if result is not None and result[1] not in seen:
                seen.add(result[1])
                built.append((point, result[1], result[0]))
        return built

    def _pool(self, need: int) -> list[tuple]:
        """Unmeasured points to choose ``need`` from: before any measurement the nearest to the
        default; then the nearest plus random ones, ranked by the cost model."""
        if self.trials == 0 or self.cost_model is None:
            points, self.todo = self.todo[:need], self.todo[need:]
            return self._build(points)
        nearest, rest = self.todo[:need], self.todo[need:]
        sampled = self.rng.sample(rest, min(len(rest), (POOL_FACTOR - 1) * need))
        taken = set(nearest) | set(sampled)
        self.todo = [p for p in self.todo if p not in taken]
        pool = self._build(nearest + sampled)
        if len(pool) <= need:
            return pool
        scores = self.cost_model.predict(self.context, [measure_candidate(sch) for *_, sch in pool])
        ranked = [pool[i] for i in sorted(range(len(pool)), key=lambda i: -float(scores[i]))]
        n_random = int(round(EXPLORE * need))
        chosen = ranked[: need - n_random]
        chosen += self.rng.sample(ranked[need - n_random :], min(n_random, len(ranked) - len(chosen)))
        picked = {id(c) for c in chosen}
        self.todo += [c[0] for c in pool if id(c) not in picked]  # scored low: after the unscored points
        return chosen

    def generate_measure_candidates(self):
        want = min(self.per_iter, self.max_trials - self.trials)
        batch: list[tuple] = []
        while want > len(batch) and self.todo:
            batch += self._pool(want - len(batch))
        if not batch:
            return None
        self.progress.pending = [effective for _, effective, _ in batch]
        return [measure_candidate(sch) for *_, sch in batch]

    def notify_runner_results(self, measure_candidates, results) -> None:
        self.trials += len(results)
        self.progress.measured.update(self.progress.pending)
        self.progress.pending = []

    def clone(self):
        return RuleSpaceSearch(self.space, self.progress, self.seed)

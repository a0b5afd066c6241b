"""The real decisions of our schedule rules, as Meta-Schedule sampling instructions.

A rule asks :meth:`Knobs.choose` for each decision it makes (which micro-kernel plan, how to
cache-block the reduction, where the accumulator lives). Choice 0 is always the rule's own pick
(its cost model's plan), so the untuned schedule is the all-zero point of the space.

* untuned (``tunable=False``, nothing forced): 0 everywhere, and no instruction is added, so the
  default schedule is exactly what it always was;
* forced (``Knobs({"plan": 3})``, what the tuner's search does): the decision is recorded in the
  trace as ``sample_categorical(..., decision=3)``;
* tunable (``tunable=True``, dlight's convention): decisions are sampled, biased to the rule's pick.

Because the rule runs again from scratch for every point (not by mutating a trace), a decision may
change the structure of everything after it, e.g. the packed weight layout follows the tile
shape; and a record's trace (decisions included) replays to exactly the schedule measured.
:attr:`Knobs.counts` tells the search how many choices each decision had for this kernel.
"""

from __future__ import annotations

import random

from tvm import s_tir

DEFAULT_BIAS = 0.5  # probability of the rule's own pick when sampling


class Knobs:
    def __init__(self, forced: dict[str, int] | None = None, tunable: bool = False):
        self.forced = dict(forced or {})
        self.tunable = tunable
        self.counts: dict[str, int] = {}  # decision name -> number of choices (filled while applying)
        self._unrecorded: list[tuple[int, int]] = []  # (count, choice) decided before a schedule existed

    def choose(self, sch: s_tir.Schedule | None, name: str, count: int) -> int:
        """The choice in ``range(count)`` for decision ``name`` (0: the rule's own pick). A rule that
        must decide before it has a schedule (dlight's GPU rules pick their config first) passes
        ``sch=None`` and calls :meth:`record` on the schedule it returns."""
        self.counts[name] = count
        forced = self.forced.get(name)
        if count <= 1 or (forced is None and not self.tunable):
            return 0
        probs = _probs(count)
        decision = None if forced is None else min(max(int(forced), 0), count - 1)
        if sch is None:
            choice = decision if decision is not None else random.choices(range(count), probs)[0]
            self._unrecorded.append((count, choice))
            return choice
        rv = sch.sample_categorical(candidates=list(range(count)), probs=probs, decision=decision)
        return int(sch.get(rv))

    def record(self, sch: s_tir.Schedule) -> None:
        """Write the decisions taken with ``sch=None`` into ``sch``'s trace."""
        for count, choice in self._unrecorded:
            sch.sample_categorical(candidates=list(range(count)), probs=_probs(count), decision=choice)
        self._unrecorded = []


def _probs(count: int) -> list[float]:
    return [DEFAULT_BIAS] + [(1.0 - DEFAULT_BIAS) / (count - 1)] * (count - 1)

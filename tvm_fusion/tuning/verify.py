"""The tuned build must never be slower than the untuned one: time each task's best record next to
its default schedule (the one the build would otherwise run, weights pre-packed) and keep both
numbers in the manifest, so :func:`records.slower_than_default` can leave out the losers."""

from __future__ import annotations

from collections.abc import Callable

import tvm

from .defaults import schedule_fingerprint
from .records import RecordSet
from .tasks import default_schedule_modules
from .workers import measure_modules


def verify_against_default(
    rset: RecordSet,
    tasks: list,
    summaries: list,
    target: tvm.target.Target,
    builder,
    runner,
    *,
    rounds: int = 5,
    again: bool = False,
    build_target: tvm.target.Target | None = None,
    say: Callable[[str], None] | None = None,
) -> None:
    """Time each task's default schedule and its best tuned record side by side; store
    ``default_us``, ``tuned_us``, ``verified_trials`` and the default's fingerprint
    (``default_hash``, on ``build_target``: the user's target, which the build checks it with) in
    the manifest. ``tasks`` and ``summaries`` are parallel lists. Tasks checked already with the
    trials now on disk and the same default schedule are skipped unless ``again``."""
    build_target = build_target or target
    built_defaults = default_schedule_modules(tasks, build_target)  # what the build runs untuned
    todo = []
    for task, summary in zip(tasks, summaries):
        entry = rset.manifest["tasks"][summary.workload_key]
        summary.default_hash = schedule_fingerprint(built_defaults[summary.workload_key])
        if (
            not again
            and entry.get("verified_trials") == summary.trials
            and entry.get("default_us") is not None
            and entry.get("default_hash") == summary.default_hash
        ):
            summary.default_us, summary.tuned_us = entry["default_us"], entry.get("tuned_us")
        else:
            todo.append((task, summary))
    if not todo:
        return
    # timed as scheduled for the search target (the same one on CPU: no second scheduling)
    if build_target is target:
        defaults = built_defaults
    else:
        defaults = default_schedule_modules([task for task, _ in todo], target)
    items = []
    for _, summary in todo:
        key = summary.workload_key
        items.append((("default", key), defaults[key]))
        best = rset.best_record(key)
        if best is not None:
            items.append((("tuned", key), replayed(best)))
    if say is not None:
        say(f"timing {len(todo)} default schedules against the best tuned ones ({rounds} rounds)")
    times = measure_modules(builder, runner, target, items, rounds)
    for _, summary in todo:
        key = summary.workload_key
        default, tuned = times.get(("default", key)), times.get(("tuned", key))
        summary.default_us = None if default is None else round(default * 1e6, 4)
        summary.tuned_us = None if tuned is None else round(tuned * 1e6, 4)
        if summary.default_us is None:
            if say is not None:
                say(f"  {summary.name}: could not time the default schedule; records applied unchecked")
            continue
        rset.manifest["tasks"][key].update(
            default_us=summary.default_us,
            tuned_us=summary.tuned_us,
            verified_trials=summary.trials,
            default_hash=summary.default_hash,
        )
    rset.save()


def replayed(record) -> tvm.IRModule:
    """A record's schedule applied to its workload (``TuningRecord.as_measure_candidate`` also
    builds the runner's arguments the Meta-Schedule way, which aborts on computed weight packing)."""
    sch = tvm.s_tir.Schedule(record.workload.mod)
    record.trace.apply_to_schedule(sch, remove_postproc=False)
    return sch.mod

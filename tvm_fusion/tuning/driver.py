"""Tuning a whole model: plan the tasks and their budgets, search each, check against defaults.

``tune_model`` is the entry point the CLI and scripts use: it fuses the model with the build's own
passes (``pipeline.unscheduled_module``), so the records' workloads are the very PrimFuncs the
build looks up, and hands the module to :func:`tune`.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tvm
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.analysis import estimate_tir_flops

from ..errors import TuningRecordError, TvmFusionError, last_line
from ..frontend import as_imported
from ..pipeline import unscheduled_module
from ..shape_cache import symbolic_dims
from ..targets import parse_target
from .conv_algorithms import alternative_modules, choose_algorithms, unchosen_kernels
from .environment import check_environment, load_tensor_intrinsics
from .fleet import parse_rpc
from .in_model import check_in_model
from .records import (
    RecordLock,
    RecordSet,
    check_compatible,
    has_records,
    in_model_verdict,
    new_manifest,
    read_record_set,
    record_dir,
    slower_than_default,
    workload_key,
)
from .search import SearchSettings, StopRequests, TaskSearch, TaskSummary, progress_bar
from .tasks import extract_tasks, split_budget
from .verify import verify_against_default
from .workers import PersistentLocalBuilder, check_can_tune, make_runner, tuning_target


@dataclasses.dataclass
class TuneResult:
    record_dir: Path
    tasks: list[TaskSummary]
    elapsed_s: float
    database: Any = None  # ms MemoryDatabase with the records the build will apply
    messages: list[str] = dataclasses.field(default_factory=list)
    time_budget_s: float | None = None  # with a time budget, per-task trial budgets mean nothing

    def __str__(self) -> str:
        return self.summary()

    @property
    def new_trials(self) -> int:
        return sum(t.new_trials for t in self.tasks)

    @property
    def total_trials(self) -> int:
        return sum(t.trials for t in self.tasks)

    def summary(self) -> str:
        """One line per task plus a total (the resume/move-aside ``messages`` are not repeated)."""
        lines = []
        for t in self.tasks:
            best = f"{t.best_us:.2f} us" if t.best_us is not None else "n/a"
            if t.skipped:
                state = "its whole space measured before" if t.space_exhausted else "at budget before"
            else:
                state = f"+{t.new_trials}" + (", its whole space measured" if t.space_exhausted else "")
            if t.search_error:
                state += f", search failed: {t.search_error}"
            elif t.out_of_time:
                state += ", not searched: the time budget ran out"
            count = f"{t.trials}" if self.time_budget_s is not None else f"{t.trials}/{t.budget}"
            line = f"  {t.name}: {count} trials ({state}), best {best}"
            verdict = "tuned schedule used" if t.applied else "default schedule kept"
            if t.unchosen_algorithm:
                verdict = (
                    f"tuned {'won' if t.applied else 'lost'}; not built (its conv algorithm was not chosen)"
                )
            if t.in_model is not None:
                line += (
                    f"; in the model: tuned {t.in_model['tuned_us']:.2f} us vs default "
                    f"{t.in_model['default_us']:.2f} us -> {verdict}"
                )
            elif t.default_us is not None:
                tuned = "n/a" if t.tuned_us is None else f"{t.tuned_us:.2f} us"
                line += f"; side by side: tuned {tuned} vs default {t.default_us:.2f} us -> {verdict}"
            if t.unchosen_algorithm and t.in_model is None and t.default_us is None:
                line += "; not built (its conv algorithm was not chosen)"
            lines.append(line)
        built = [t for t in self.tasks if not t.unchosen_algorithm]
        used = sum(1 for t in built if t.applied)
        unchosen = len(self.tasks) - len(built)
        lines.append(
            f"{self.new_trials} new trials ({self.total_trials} in all) in {self.elapsed_s:.1f} s; "
            f"{used}/{len(built)} functions will use tuned schedules"
            + (f" (not counted: {unchosen} of conv algorithms not chosen, not built)" if unchosen else "")
            + f"; records in {self.record_dir}"
        )
        if self.ended_early:
            lines.append(
                f"every task's search space is measured: the run ended {self.elapsed_s / 60:.1f} min into "
                f"its {self.time_budget_s / 60:g}-minute budget (more time would measure nothing new)"
            )
        return "\n".join(lines)

    @property
    def ended_early(self) -> bool:
        """A time budget left mostly unused because every task's space was measured."""
        return (
            self.time_budget_s is not None
            and self.elapsed_s < 0.8 * self.time_budget_s
            and bool(self.tasks)
            and all(t.space_exhausted for t in self.tasks)
        )


def open_for_tuning(
    path: Path, model_name: str, model_hash: str, target, messages: list[str], device_key: str | None = None
) -> RecordSet:
    """The existing compatible record set, or a new one (moving an incompatible one aside)."""
    if has_records(path):
        try:
            rset = read_record_set(path)
            problems = check_compatible(rset.manifest, model_hash, target, device_key)
        except TuningRecordError as err:
            problems = [str(err)]
        if not problems:
            messages.append(f"{path}: resuming from {len(rset.records)} existing trials")
            return rset
        aside = path.with_name(f"{path.name}.old-{_dt.datetime.now().strftime('%Y%m%d-%H%M%S-%f')}")
        os.replace(path, aside)
        messages.append(f"{path}: {'; '.join(problems)}: moved to {aside.name}, tuning from scratch")
    return RecordSet(path=path, manifest=new_manifest(model_name, model_hash, target, device_key))


def plan_tasks(rset: RecordSet, tasks: list, budgets: list[int]) -> list[TaskSummary]:
    """A summary per task (what is on disk, what is left to do), its workload and manifest entry
    registered in ``rset``."""
    index = rset.workload_index()
    done = rset.trials_by_workload()
    best = rset.best_by_workload()
    summaries = []
    for task, budget in zip(tasks, budgets):
        wl_mod = task.dispatched[0]
        key = workload_key(wl_mod)
        if key not in index:
            index[key] = len(rset.workloads)
            rset.workloads.append(ms.database.Workload(wl_mod))
        entry = rset.manifest["tasks"].get(key, {})
        trials = done.get(key, 0)
        # A task tuned to its budget earlier may have measured fewer (its search space ran out).
        at_budget = trials >= budget or int(entry.get("budget", 0)) >= budget
        best_us = best[key] * 1e6 if key in best else None
        summaries.append(
            TaskSummary(
                task.task_name,
                key,
                budget,
                trials,
                trials,
                best_us,
                skipped=at_budget,
                space_exhausted=at_budget and trials < budget,  # ended short of its budget before
                in_model=in_model_verdict(entry, trials),
            )
        )
        rset.manifest["tasks"][key] = {
            **entry,  # keeps default_us / tuned_us / verified_trials of an earlier run
            "name": task.task_name,
            "weight": int(task.weight),
            "budget": int(entry.get("budget", 0)),
            "trials": trials,
            "best_us": None if best_us is None else round(best_us, 4),
        }
    return summaries


def tune(
    mod: tvm.IRModule,
    target,
    *,
    model_name: str,
    model_hash: str,
    trials: int,
    log_root: str | os.PathLike = "tuning_logs",
    max_trials_per_task: int | None = None,
    rpc: str | None = None,
    progress: bool = True,
    num_trials_per_iter: int = 16,
    builders: int | None = None,
    timeout_s: float = 60.0,
    seed: int = 0,
    min_repeat_ms: int = 50,
    population_size: int | None = None,
    check_default: bool = True,
    verify_rounds: int = 5,
    verify_again: bool = False,
    time_budget_s: float | None = None,
    on_task_done: Callable[[TaskSummary], None] | None = None,
    on_batch: Callable[[TaskSummary], None] | None = None,
    log: Callable[[str], None] | None = None,
    alternatives: list | None = None,
) -> TuneResult:
    """Tune every fused PrimFunc of ``mod`` for ``target`` and store the records.

    ``mod`` must be the module the build schedules (``pipeline.unscheduled_module``). ``trials``
    is the total budget, split evenly over the tasks (capped by ``max_trials_per_task``). Tasks
    already at their budget in ``<log_root>/<model_name>/<target-key>`` are skipped; others continue
    from the trials on disk. Records for another model/target/TVM found there are moved aside to
    ``<target-key>.old-<date>`` (reported, never mixed in). A second run into the same folder while
    this one holds it stops at once with a message (:class:`records.RecordLock`).

    Search, per task (:class:`search.TaskSearch`): first the points of the scheduling rule's own
    space nearest its default (its runner-up plans), then Meta-Schedule's evolutionary search with
    the XGBoost cost model for the rest, ``num_trials_per_iter`` candidates measured per batch;
    ``population_size`` defaults to 16 x that (64..512; Meta-Schedule's default is 512).
    Candidates are built here by ``builders`` worker processes (default: one per core) and measured
    here, or with ``rpc="host:port:key"`` on every server registered under the key at that TVM RPC
    tracker (:mod:`.fleet`); fleet records go to ``<target-key>@<key>``, apart from local ones.

    ``time_budget_s`` bounds the run's wall time: each task gets a share of what is left, in
    proportion to its FLOPs x occurrences (a few seconds per task are kept for the check below),
    and ends after the batch that spends it; a task stopped that way is not at its budget, so a
    later run goes on with it.

    With ``check_default`` (default), each tuned task's best schedule is then timed side by side
    with the task's default schedule (``verify_rounds`` rounds); the manifest keeps both, and the
    build applies only the tuned schedules that won. ``verify_again`` re-times every task.

    ``on_task_done`` / ``on_batch`` are called after each task / measured batch, once its records
    are on disk (tests use them to simulate Ctrl-C).

    ``alternatives``: the model fused with each conv algorithm forced
    (:func:`.conv_algorithms.alternative_modules`); their kernels are tuned too, and the manifest
    keeps the fastest algorithm per conv (``conv_algorithms``), which the build then uses.
    """
    start = time.time()
    target = parse_target(target)
    say = log or (lambda msg: print(msg, file=sys.stderr))
    if int(trials) < 0:
        raise TvmFusionError(f"trials must be 0 or more, got {trials}")
    if time_budget_s is not None and not time_budget_s > 0:
        raise TvmFusionError(f"the time budget must be positive, got {time_budget_s} s")
    tracker = parse_rpc(rpc) if rpc is not None else None
    num_servers = check_can_tune(target, tracker)
    check_environment()
    device_key = tracker.key if tracker is not None else None
    path = record_dir(log_root, model_name, target, device_key)
    search_target = tuning_target(target)
    messages: list[str] = []
    with _writable(path), RecordLock(path), StopRequests(say) as stop:
        rset = open_for_tuning(path, model_name, model_hash, target, messages, device_key)
        for msg in messages:
            say(msg)
        tasks, default_tasks = _tasks_with_alternatives(mod, alternatives or [], target)
        summaries = plan_tasks(rset, tasks, split_budget(trials, len(tasks), max_trials_per_task))
        with stop.saving():
            rset.save()  # manifest first: any later state on disk says what it is for
        remaining = sum(max(s.budget - s.trials, 0) for s in summaries if not s.skipped)
        settings = SearchSettings(
            num_trials_per_iter=num_trials_per_iter,
            population_size=population_size or min(512, max(64, 16 * num_trials_per_iter)),
            num_threads=max(1, min(os.cpu_count() or 1, 4)),
            seed=seed,
        )
        evaluator = ms.runner.EvaluatorConfig(
            number=3, repeat=1, min_repeat_ms=min_repeat_ms, enable_cpu_cache_flush=False
        )
        builder = runner = None
        if remaining > 0 or (check_default and any(s.best_us is not None for s in summaries)):
            builder = PersistentLocalBuilder(builders or os.cpu_count() or 1, timeout_s)
            runner = make_runner(tracker, num_servers, evaluator, timeout_s)
        deadline = None if time_budget_s is None else start + float(time_budget_s)
        bar = progress_bar(remaining if deadline is None else None, progress and remaining > 0)
        search = TaskSearch(rset, search_target, builder, runner, settings, bar, stop, on_batch)
        search.budget_end = deadline
        try:
            _search_tasks(search, tasks, summaries, deadline, check_default, on_task_done, say)
            bar.close()
            if check_default:
                tuned = [(t, s) for t, s in zip(tasks, summaries) if s.best_us is not None]
                if tuned:
                    load_tensor_intrinsics()
                    with stop.saving():
                        verify_against_default(
                            rset,
                            [t for t, _ in tuned],
                            [s for _, s in tuned],
                            search_target,
                            builder,
                            runner,
                            rounds=verify_rounds,
                            again=verify_again,
                            build_target=target,
                            say=say if progress else None,
                        )
            if alternatives:
                choice = rset.manifest["conv_algorithms"] = choose_algorithms(tasks, summaries)
                for summary, unchosen in zip(summaries, unchosen_kernels(tasks, choice, default_tasks)):
                    summary.unchosen_algorithm = unchosen
                with stop.saving():
                    rset.save()
        except KeyboardInterrupt:
            say(
                f"interrupted: {sum(s.trials for s in summaries)} trials are saved in {path}; run again to resume"
            )
            raise
        finally:
            bar.close()
            if remaining > 0:  # wall time spent tuning this record set, all runs together
                rset.manifest["tuning_seconds"] = round(
                    rset.manifest.get("tuning_seconds", 0) + time.time() - start, 1
                )
                with stop.saving():
                    rset.save()
    skipped, _ = slower_than_default(rset, target)
    database = rset.to_database(exclude=skipped)
    return TuneResult(
        path,
        summaries,
        time.time() - start,
        database=database,
        messages=messages,
        time_budget_s=time_budget_s,
    )


def _search_tasks(search: TaskSearch, tasks, summaries, deadline, check_default, on_task_done, say) -> None:
    """Search each task not yet at its budget, in order; with a ``deadline``, each gets its share
    of the time left (:func:`_task_deadline`) and those left without one are marked out of time.
    One task's search failing is reported and the next goes on."""
    weights = [_task_cost(t) for t in tasks]
    searched = 0
    for i, (task, summary) in enumerate(zip(tasks, summaries)):
        if summary.done:
            continue
        search.stop.check()
        task_deadline = None
        if deadline is not None:
            reserve = _verify_reserve_s(search, check_default)
            task_deadline = _task_deadline(deadline, reserve, searched, i, summaries, weights)
            if task_deadline is None:
                summary.out_of_time = True
                continue
        load_tensor_intrinsics()  # TuneContext imports them; only when there is work
        searched += 1
        try:
            search.run(task, summary, f"{i + 1}/{len(tasks)}", task_deadline)
        except (OSError, TvmFusionError):
            raise  # the record folder itself (disk full, unwritable): every task would fail
        except Exception as err:  # one task's search failing must not end the others'
            summary.search_error = f"{type(err).__name__}: {last_line(err)}"
            say(f"{summary.name}: the search failed ({summary.search_error}); the next task goes on")
        if on_task_done is not None:
            on_task_done(summary)
    late = [s.name for s in summaries if s.out_of_time]
    if late:
        say(
            f"the time budget ran out before {len(late)} task(s) were searched ({', '.join(late[:5])}"
            f"{', ...' if len(late) > 5 else ''}): they keep their default schedules; tune again "
            "(with more --minutes) to go on where this run stopped"
        )


def _tasks_with_alternatives(mod: tvm.IRModule, alternatives: list, target) -> tuple[list, int]:
    """The tasks of ``mod`` (the kernels of the untuned build), then those of each alternative
    module (other conv algorithms) not among them: (tasks, how many are ``mod``'s)."""
    tasks = extract_tasks(mod, target)
    default_tasks = len(tasks)
    seen = {workload_key(t.dispatched[0]) for t in tasks}
    for alt in alternatives:
        for task in extract_tasks(alt, target):
            if workload_key(task.dispatched[0]) not in seen:
                seen.add(workload_key(task.dispatched[0]))
                tasks.append(task)
    return tasks, default_tasks


def _task_deadline(
    deadline: float, reserve: float, searched: int, i: int, summaries, weights
) -> float | None:
    """When task ``i``'s search must end, or None when the run's ``deadline`` leaves no room for
    it. The budget pays for each searched task's check against its default afterwards
    (``reserve`` seconds each): a task starts only if its own check fits, and its share of the
    search time (by ``weights``) is what is left after the checks of every task still to come."""
    now = time.time()
    if deadline - now <= reserve * (searched + 1):
        return None
    left = [j for j in range(i, len(summaries)) if not summaries[j].done]
    spare = max(deadline - now - reserve * (searched + len(left)), 0.0)
    return now + spare * weights[i] / sum(weights[j] for j in left)


VERIFY_RESERVE_S = 14.0  # per task, of a time budget: the side-by-side check with the default
# (measured: 13 s per task for ResNet-18, 34 tasks, 5 rounds, on 2 cores; 8 s made a 15-minute run 18.5)
# ... once this run has measured candidates: the check builds and times two kernels, 5 rounds each,
# measured at ~6 candidates' worth of search time (squeezenet: 3 s per task, 0.45 s per candidate)
VERIFY_CANDIDATES = 6.0


def _verify_reserve_s(search: TaskSearch, check_default: bool) -> float:
    """Seconds of a time budget kept per searched task for its check against the default."""
    if not check_default:
        return 0.0
    per_trial = search.seconds_per_trial
    return (
        VERIFY_RESERVE_S
        if per_trial is None
        else min(VERIFY_RESERVE_S, max(1.0, VERIFY_CANDIDATES * per_trial))
    )


def _task_cost(task) -> float:
    """How much tuning time a task deserves: its FLOPs times how often the model runs it."""
    try:
        flops = float(estimate_tir_flops(task.dispatched[0]))
    except Exception:
        flops = 0.0
    return max(flops, 1e6) * max(int(task.weight), 1)


class _writable:
    """Turn the OS errors of an unusable records folder (a file in the way, read-only, full disk)
    into one line naming the folder."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        for parent in [self.path, *self.path.parents]:
            if parent.exists() and not parent.is_dir():
                raise TuningRecordError(f"{parent}: is a file, cannot hold tuning records")
        return self

    def __exit__(self, kind, err, _tb):
        if isinstance(err, OSError) and not isinstance(err, TuningRecordError):
            where = err.filename or self.path
            raise TuningRecordError(
                f"{where}: cannot write tuning records ({err.strerror or err}); pass a writable --tuning-logs folder"
            ) from None
        return False


def tune_model(
    source,
    target="llvm",
    *,
    trials: int,
    policy=None,
    options: dict | None = None,
    log_root: str | os.PathLike = "tuning_logs",
    name: str | None = None,
    in_model: bool = False,
    **tune_kwargs,
) -> TuneResult:
    """Import (if needed), fuse with the build's own passes and tune a model; ``str(result)`` is
    a per-kernel summary. ``policy``/``options`` must be what the build will get (they shape the
    fused kernels). Other keywords go to :func:`tune` (``rpc``, ``max_trials_per_task``,
    ``num_trials_per_iter``, ``progress``, ...). With ``in_model`` (measuring on this machine),
    each task's best few records and a grid of its rule's main decisions are then timed inside
    the whole model and the schedule fastest there is applied, if it beats the default there
    (``in_model.py``; 1 + ``CANDIDATES`` + 9 builds, and one more that confirms the winners).
    ``tvm_fusion.benchmark.measure_speedup`` then times the tuned build against the untuned one."""
    target = parse_target(target)
    imported = as_imported(source, name)
    dims = symbolic_dims(imported.mod)
    if dims:
        raise TuningRecordError(
            f"{imported.name}: inputs have symbolic dims ({', '.join(dims)}); tuning needs "
            "static shapes: export the model with fixed shapes, or fix them with "
            "onnx.tools.update_model_dims before tuning"
        )
    mod = unscheduled_module(imported.mod, target, policy, name=imported.name, **(options or {}))
    if "alternatives" not in tune_kwargs and "conv_algorithms" not in (options or {}):
        tune_kwargs["alternatives"] = alternative_modules(
            imported.mod, target, policy, name=imported.name, **(options or {})
        )
    result = tune(
        mod,
        target,
        model_name=imported.name,
        model_hash=imported.model_hash,
        trials=trials,
        log_root=log_root,
        **tune_kwargs,
    )
    if in_model:
        _check_in_model(result, imported, target, policy, options, tune_kwargs)
    return result


def _check_in_model(result: TuneResult, imported, target, policy, options, tune_kwargs) -> None:
    """Choose each task's record in the model (``in_model.py``) and update ``result`` to match."""
    say = tune_kwargs.get("log") or (lambda msg: print(msg, file=sys.stderr))
    if tune_kwargs.get("rpc") is not None:
        why_not = "the records were measured on a fleet (the model cannot run here)"
    elif not tune_kwargs.get("check_default", True):
        why_not = "check_default is off"
    elif imported.onnx_model is None:
        why_not = "the model has no ONNX file to make inputs from"
    elif not any(t.best_us is not None for t in result.tasks):
        why_not = "no task has a record"
    else:
        why_not = None
    if why_not:
        say(f"in-model check skipped: {why_not}")
        return
    start = time.time()
    progress = say if tune_kwargs.get("progress", True) else None
    verdicts = check_in_model(
        imported, target, result.record_dir, policy=policy, options=options, say=progress
    )
    for summary in result.tasks:
        summary.in_model = verdicts.get(summary.workload_key, summary.in_model)
        if summary.in_model is not None:
            summary.trials = max(summary.trials, summary.in_model["trials"])  # a grid point added
    rset = read_record_set(result.record_dir)
    skipped, _ = slower_than_default(rset, target)
    result.database = rset.to_database(exclude=skipped)
    result.elapsed_s += time.time() - start

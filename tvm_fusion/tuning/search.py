"""The search for one task: our rule's runner-up plans first, then Meta-Schedule's evolutionary
search with the XGBoost cost model, every measured batch saved to disk before the next one.

Stopping: the first Ctrl-C stops after the batch being measured (it is saved); a second Ctrl-C or
SIGTERM stops at once, with the batches finished so far on disk. Signal handlers never raise:
an exception thrown while C++ (the task scheduler, the cost model) is on the stack ends in
``std::terminate``, so the handler only sets a flag, the measure callback turns it into a
``KeyboardInterrupt`` between batches, and a hard stop waits for a save in progress and exits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

from tqdm.auto import tqdm
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms

from .packed_weights import AsBuiltFeatures
from .records import RecordSet, beats_default, commit_records, is_search_record, mean_secs, workload_key
from .rule_space import RuleSpaceSearch, SpaceProgress, rule_space

INTERRUPTED_EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143}


class TimeUp(Exception):
    """The task's share of a time budget is spent: it ends after the batch just saved (this is
    not an interrupt; the next task runs, and a later run can go on with this one)."""


@dataclasses.dataclass
class TaskSummary:
    name: str
    workload_key: str
    budget: int
    trials_before: int
    trials: int  # measured trials on disk for this task, all runs together
    best_us: float | None
    skipped: bool = False  # already at budget when this run started
    space_exhausted: bool = False  # its search ended with every point of its space measured
    default_us: float | None = None  # default schedule, timed side by side with tuned_us
    tuned_us: float | None = None  # best record re-timed next to the default
    default_hash: str | None = None  # fingerprint of the default schedule timed (defaults.py)
    search_error: str | None = None  # this run's search failed (the default schedule is kept)
    out_of_time: bool = False  # not searched this run: the time budget was spent before its turn
    in_model: dict | None = None  # its records and the default timed inside the model (in_model.py)
    unchosen_algorithm: bool = False  # a kernel of a conv algorithm tuning did not choose: not built

    @property
    def new_trials(self) -> int:
        return self.trials - self.trials_before

    @property
    def done(self) -> bool:
        return self.skipped or self.trials >= self.budget

    @property
    def applied(self) -> bool | None:
        """Whether the build will use the tuned schedule (None: not compared with the default)."""
        if self.in_model is not None:
            return bool(self.in_model.get("trace"))
        if self.default_us is None:
            return None if self.best_us is not None else False
        return beats_default(self.tuned_us if self.tuned_us is not None else self.best_us, self.default_us)


class StopRequests:
    """Ctrl-C and SIGTERM during tuning (see module docstring); a no-op outside the main thread."""

    def __init__(self, say: Callable[[str], None]):
        self.say = say
        self.count = 0
        self._saving = 0
        self._exit_code: int | None = None

    @property
    def requested(self) -> bool:
        return self.count > 0

    def check(self) -> None:
        """Raise ``KeyboardInterrupt`` if a stop was asked for (call between batches)."""
        if self.count:
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def saving(self):
        """A hard stop that arrives while files are written waits until they are."""
        self._saving += 1
        try:
            yield
        finally:
            self._saving -= 1
            if not self._saving and self._exit_code is not None:
                self._exit_now(self._exit_code)

    def _exit_now(self, code: int) -> None:
        self.say("stopped: the trials of every finished batch are saved; run again to resume")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    def _on_signal(self, signum, _frame) -> None:
        self.count += 1
        if signum == signal.SIGINT and self.count == 1:
            self.say("\nstopping after the current batch (Ctrl-C again to stop now)")
            return
        code = INTERRUPTED_EXIT.get(signum, 130)
        if self._saving:
            self._exit_code = code
        else:
            self._exit_now(code)

    def __enter__(self) -> StopRequests:
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in INTERRUPTED_EXIT:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *_exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def progress_bar(total: int | None, enabled: bool):
    """Trials measured out of ``total``; with a time budget ``total`` is None (time, not trials,
    ends the search) and the postfix says how much of the budget is left."""
    return tqdm(total=total, unit="trial", desc="tuning", disable=not enabled, dynamic_ncols=True)


@dataclasses.dataclass
class SearchSettings:
    num_trials_per_iter: int = 16
    population_size: int = 256
    num_threads: int = 1
    seed: int = 0


def stock_space(mod, target):
    """Meta-Schedule's own design space for a kernel no rule of ours has knobs for.

    On CUDA, TVM 0.27's default rules fail together on some kernels (MultiLevelTiling + AutoInline
    + CrossThreadReduction: "Index 6 out of bounds 6" on a layer norm fused in front of a matmul,
    BERT's QKV and FFN kernels); each rule alone and every pair works. Such a kernel is searched
    without CrossThreadReduction (its reductions are then bound like any other loop nest)."""
    if target.kind.name != "cuda":
        return "post-order-apply"
    try:
        ms.TuneContext(mod=mod, target=target, space_generator="post-order-apply").generate_design_space()
        return "post-order-apply"
    except Exception:
        pass
    return ms.space_generator.PostOrderApply(
        sch_rules=[
            r
            for r in ms.ScheduleRule.create("cuda")
            if not isinstance(r, ms.schedule_rule.CrossThreadReduction)
        ],
        postprocs=ms.Postproc.create("cuda"),
        mutator_probs=ms.Mutator.create("cuda"),
    )


class TaskSearch:
    """Tunes tasks one at a time into ``rset``, saving after every measured batch."""

    def __init__(
        self,
        rset: RecordSet,
        target,
        builder,
        runner,
        settings: SearchSettings,
        bar,
        stop: StopRequests,
        on_batch: Callable | None = None,
    ):
        self.rset = rset
        self.target = target
        self.builder = builder
        self.runner = runner
        self.settings = settings
        self.bar = bar
        self.stop = stop
        self.on_batch = on_batch
        self.progress: SpaceProgress | None = None  # the rule-space search's, for the manifest
        self._kept: list = []  # the task's records from earlier runs that the database lacks
        self.pending: BaseException | None = None  # raised in a callback, on its way through C++
        self.deadline: float | None = None
        self.budget_end: float | None = None  # the whole run's time budget, for the progress bar
        self._batch_start = time.time()
        self._measured_s, self._measured_n = 0.0, 0  # wall time and candidates of this run's batches

    def run(self, task, summary: TaskSummary, position: str, deadline: float | None = None) -> None:
        """Search until the task's budget is measured (or ``deadline``, a ``time.time()``, passes),
        saving as it goes: over our rule's decisions when a rule with knobs schedules the kernel
        (:mod:`.rule_space`), else Meta-Schedule's own space."""
        self.deadline = deadline
        self._batch_start = time.time()
        database = ms.database.MemoryDatabase()
        # what is on disk and will not be in the database: every record but the Meta-Schedule
        # search's own, which seed its database below
        self._kept = [r for r in self.rset.records_of(summary.workload_key) if not is_search_record(r)]
        task_mod = task.dispatched[0]
        space = rule_space(task_mod["main"], self.target)
        entry = self.rset.manifest["tasks"][summary.workload_key]
        self.progress = None
        if space is not None:
            self.progress = SpaceProgress(measured={tuple(p) for p in entry.get("space_measured", [])})
            entry["space"] = dict(zip(space.names, space.counts))
            generator = ms.space_generator.ScheduleFn(
                lambda sch: space.schedule(sch.mod["main"], self.target, (0,) * len(space.names))[0],
                sch_rules=[],
                postprocs=[],
                mutator_probs={},
            )
            strategy = RuleSpaceSearch(space, self.progress, self.settings.seed + summary.trials)
        else:
            self._seed(database, summary.workload_key)
            generator = stock_space(task_mod, self.target)
            strategy = ms.search_strategy.EvolutionarySearch(population_size=self.settings.population_size)
        finished = True
        try:
            todo = summary.budget - summary.trials
            if todo > 0:
                self._search(task, summary, database, todo, position, generator, strategy)
        except TimeUp:
            finished = False  # not at its trial budget: a later run goes on with it
        finally:
            self.checkpoint(summary, database)
        if finished:
            entry["budget"] = summary.budget
            # the search ended without a deadline and short of the budget: nothing left to measure
            summary.space_exhausted = summary.trials < summary.budget
        self.save()

    def save(self) -> None:
        with self.stop.saving():
            self.rset.save()

    def checkpoint(self, summary: TaskSummary, database) -> None:
        """Put the task's records (earlier ones kept on disk, this run's from the search database)
        into the record set and save it atomically."""
        key = summary.workload_key
        searched = [r for r in database.get_all_tuning_records() if workload_key(r.workload.mod) == key]
        records = self._kept + searched
        if not records:
            return
        self.rset.records = [r for r in self.rset.records if workload_key(r.workload.mod) != key] + records
        summary.trials = len(records)
        times = [s for s in map(mean_secs, records) if s is not None]
        summary.best_us = min(times) * 1e6 if times else None
        entry = self.rset.manifest["tasks"][key]
        entry.update(
            trials=summary.trials, best_us=None if summary.best_us is None else round(summary.best_us, 4)
        )
        if self.progress is not None:
            entry["space_measured"] = self.progress.done()
        self.save()

    @property
    def seconds_per_trial(self) -> float | None:
        """Wall time per measured candidate so far in this run (build + run), None before any."""
        return self._measured_s / self._measured_n if self._measured_n else None

    def _batch_done(self, summary: TaskSummary, count: int, position: str = "") -> None:
        now = time.time()
        self._measured_s += now - self._batch_start
        self._measured_n += count
        self._batch_start = now
        self.bar.update(count)
        if position:
            best = f"{summary.best_us:.2f}us" if summary.best_us is not None else "n/a"
            left = ""
            if self.budget_end is not None:
                left = f", {max(self.budget_end - time.time(), 0) / 60:.1f} min left"
            self.bar.set_postfix_str(f"task {position} {summary.name} best {best}{left}", refresh=True)
        if self.on_batch is not None:
            self.on_batch(summary)
        self.stop.check()
        if self.deadline is not None and time.time() >= self.deadline:
            raise TimeUp

    def _seed(self, database, key: str) -> None:
        """Give the search the trials it already measured for this task (it starts from the best)."""
        commit_records(database, [r for r in self.rset.records_of(key) if is_search_record(r)])

    def _search(
        self, task, summary: TaskSummary, database, todo: int, position: str, generator, strategy
    ) -> None:
        settings = self.settings
        context = ms.TuneContext(
            mod=task.dispatched[0],
            target=self.target,
            space_generator=generator,
            search_strategy=strategy,
            task_name=task.task_name,
            num_threads=settings.num_threads,
            rand_state=settings.seed + summary.trials,
        ).clone()
        callback = _AfterBatch(self, summary, database, position)
        self.pending = None
        try:
            ms.tune.tune_tasks(
                tasks=[context],
                task_weights=[1.0],
                work_dir=str(self.rset.path),
                max_trials_global=todo,
                max_trials_per_task=todo,
                num_trials_per_iter=min(settings.num_trials_per_iter, todo),
                builder=self.builder,
                runner=self.runner,
                database=database,
                cost_model=ms.cost_model.XGBModel(
                    extractor=AsBuiltFeatures(), num_tuning_cores=settings.num_threads, adaptive_training=True
                ),
                measure_callbacks=ms.measure_callback.MeasureCallback.create("default") + [callback],
                task_scheduler="round-robin",
            )
        except BaseException as err:
            # an exception raised in our callback reaches Python again as a bare RuntimeError
            pending, self.pending = self.pending, None
            raise pending or err from None


@derived_object
class _AfterBatch(ms.measure_callback.PyMeasureCallback):
    """Runs after AddToDatabase: saves the batch, moves the progress bar, and is where a pending
    stop request ends the search (the exception is parked in ``search.pending`` and re-raised by
    :meth:`TaskSearch._search`, since it crosses C++ on its way out)."""

    def __init__(self, search: TaskSearch, summary: TaskSummary, database, position: str):
        super().__init__()
        self.search, self.summary, self.database, self.position = search, summary, database, position

    def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results):
        try:
            self.search.checkpoint(self.summary, self.database)
            self.search._batch_done(self.summary, len(runner_results), self.position)
        except BaseException as err:
            self.search.pending = err
            raise

"""Meta-Schedule tuning of fused PrimFuncs, with records that are stored atomically and reused.

Layout (see ``tuning_logs/README.md``)::

    <log_root>/<model-name>/<target-key>/
        database_workload.json        Meta-Schedule JSONDatabase: one workload (PrimFunc) a line
        database_tuning_record.json   one measured trial a line: [workload index, record]
        manifest.json                 TVM version, target, model hash, trials per task, dates

Why the care:

* Records are keyed by the *structural hash* of each PrimFunc, so ``tune`` must be given the very
  module the build later hands to :func:`apply_records` (same passes, same order), and a record set
  made for another model, target or TVM version is reported and ignored, never applied silently.
* Every file is replaced atomically (temp file in the same folder, fsync, ``os.replace``) after each
  measured batch, so Ctrl-C or ``kill`` leaves the last finished batch on disk, never half a line.
  Files are written in the order workloads, records, manifest; the workload file only ever grows
  (indices are stable), so any mix of old and new files on disk is consistent.
* A re-run resumes: per-task trial counts come from the records themselves, and a task already
  tuned to its budget is skipped.
* A tuned build must never be slower than the untuned one: after the search each task's best
  record is timed side by side with the task's *default* schedule (as the build runs it, weights
  pre-packed), and :func:`load_records` leaves out the records that did not win.
* :func:`tune_model` fuses with the project pipeline (``pipeline_passes(..., schedule=False)``),
  i.e. the very passes ``tvm_fusion.build`` runs before scheduling, so the hashes match.

Two problems of the TVM 0.27 wheel are worked around here: importing
``tvm.s_tir.tensor_intrin`` (done by every ``TuneContext`` and by the default Meta-Schedule build
function in *each* builder worker) takes over a minute because the TVMScript parser calls
``inspect.stack()`` hundreds of times; we import it once with a cheap ``inspect.stack`` and give
the builder workers a build function that skips that import (the schedule is already applied when
the worker builds it, so the intrinsics are not needed there).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import importlib.util
import inspect
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import tvm
from tvm import relax

from .errors import TargetError, TuningRecordError, TvmFusionError, last_line
from .targets import is_gpu, parse_target, target_json, target_key

WORKLOAD_FILE = "database_workload.json"
RECORD_FILE = "database_tuning_record.json"
MANIFEST_FILE = "manifest.json"
# 2: workloads are the layout-free-marked functions (format 1 records never match them any more)
MANIFEST_FORMAT = 2
FAILED_RUN_SECS = 1e9  # Meta-Schedule records failed builds/runs with run_secs = [1e10]
# Before the Meta-Schedule search, each task measures up to this many runner-up plans of our
# Contraction rule (its cost model is a guess; the next-best register tiles are the cheapest
# candidates there are), taking at most half of the task's trial budget.
RULE_CANDIDATES = 7
# A tuned schedule replaces the default one only if it is at least this much faster (side by side
# timings on a busy machine differ by a few percent between identical kernels).
MIN_GAIN = 0.03


def beats_default(tuned_us: float | None, default_us: float | None) -> bool:
    """Whether a tuned kernel is faster than the default schedule by more than timing noise."""
    if tuned_us is None or default_us is None:
        return False
    return float(tuned_us) < float(default_us) * (1.0 - MIN_GAIN)


# tvm-ffi versions known to serialize TVM 0.27 objects correctly / to segfault in ToJSONGraph.
_FFI_GOOD = {"0.1.14.post0"}
_FFI_BAD = {"0.1.15.post2"}


def _ms():
    from tvm.s_tir import meta_schedule as ms  # noqa: PLC0415  (heavy: only when tuning)

    return ms


# --------------------------------------------------------------------------------------------
# Environment checks and work-arounds
# --------------------------------------------------------------------------------------------

_ENV_CHECKED = False
_INTRIN_LOADED = False
_INTRIN_LOCK = threading.Lock()


def check_environment(*, need_workers: bool = True) -> None:
    """Fail with one clear line (not a segfault deep in C++) when tuning cannot work here."""
    global _ENV_CHECKED
    if need_workers and importlib.util.find_spec("cloudpickle") is None:
        raise TvmFusionError(
            "tuning needs the 'cloudpickle' package (TVM's builder/runner worker pool uses it): "
            "pip install cloudpickle"
        )
    if _ENV_CHECKED:
        return
    import tvm_ffi

    version = getattr(tvm_ffi, "__version__", "?")
    broken = version in _FFI_BAD
    if not broken and version not in _FFI_GOOD:
        # Unknown version: probe in a child process, since the failure mode is a segfault.
        probe = "import tvm; tvm.ir.save_json(tvm.tirx.IntImm('int32', 1))"
        proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=300)
        broken = proc.returncode != 0
    if broken:
        raise TvmFusionError(
            f"apache-tvm-ffi {version} cannot serialize TVM {tvm.__version__} IR (segfault in "
            "ToJSONGraph), so tuning records can be neither written nor read: "
            "pip install 'apache-tvm-ffi==0.1.14.post0'"
        )
    _ENV_CHECKED = True


def _fast_stack(context: int = 1) -> list[inspect.FrameInfo]:
    """``inspect.stack`` with source context only for the 3 innermost frames (all TVMScript uses)."""
    frame = sys._getframe(1)
    out = []
    while frame is not None:
        if len(out) < 3:
            info = inspect.getframeinfo(frame, context)
            out.append(inspect.FrameInfo(frame, *info, positions=info.positions))
        else:
            code = frame.f_code
            out.append(
                inspect.FrameInfo(
                    frame, code.co_filename, frame.f_lineno, code.co_name, None, None, positions=None
                )
            )
        frame = frame.f_back
    return out


def load_tensor_intrinsics() -> None:
    """Import ``tvm.s_tir.tensor_intrin`` in seconds instead of minutes (see module docstring)."""
    global _INTRIN_LOADED
    with _INTRIN_LOCK:
        if _INTRIN_LOADED or "tvm.s_tir.tensor_intrin" in sys.modules:
            _INTRIN_LOADED = True
            return
        original = inspect.stack
        inspect.stack = _fast_stack
        try:
            import tvm.s_tir.tensor_intrin  # noqa: F401,PLC0415
        finally:
            inspect.stack = original
        _INTRIN_LOADED = True


def _worker_build(mod: tvm.IRModule, target: tvm.target.Target, _params=None):
    """Meta-Schedule's default_build minus its tensor_intrin import (the schedule is applied already)."""
    from tvm.driver import build as tvm_build  # noqa: PLC0415
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock  # noqa: PLC0415

    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
    return tvm_build(mod, target=target)


def make_builder(max_workers: int = 1, timeout_s: float = 60.0):
    """A local builder whose worker processes live for the whole tuning run.

    Meta-Schedule's LocalBuilder starts fresh workers for every batch (each importing TVM, seconds
    on a busy machine); this one keeps them, and builds with :func:`_worker_build`.
    """
    ms = _ms()
    from tvm.ir.utils import derived_object  # noqa: PLC0415
    from tvm.s_tir.meta_schedule.builder import local_builder as lb  # noqa: PLC0415
    from tvm.support.popen_pool import PopenPoolExecutor, StatusKind  # noqa: PLC0415

    @derived_object
    class PersistentLocalBuilder(ms.builder.PyBuilder):
        def __init__(self):
            super().__init__()
            self.pool = PopenPoolExecutor(max_workers=max_workers, timeout=timeout_s)

        def build(self, build_inputs):
            results = []
            jobs = [
                (_worker_build, None, b.mod, b.target, lb._serialize_params(b.params)) for b in build_inputs
            ]
            for res in self.pool.map_with_error_catching(lambda x: lb._worker_func(*x), jobs):
                if res.status == StatusKind.COMPLETE:
                    results.append(ms.builder.BuilderResult(res.value, None))
                elif res.status == StatusKind.TIMEOUT:
                    results.append(ms.builder.BuilderResult(None, f"build timed out after {timeout_s} s"))
                else:
                    results.append(ms.builder.BuilderResult(None, f"build failed:\n{res.value}"))
            return results

    return PersistentLocalBuilder()


# --------------------------------------------------------------------------------------------
# Record store: atomic files, manifest, validation
# --------------------------------------------------------------------------------------------


def record_dir(log_root: str | os.PathLike, model_name: str, target) -> Path:
    return Path(log_root) / model_name / target_key(parse_target(target))


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


def _tvm_fusion_version() -> str:
    try:
        from . import __version__  # noqa: PLC0415

        return __version__
    except ImportError:  # pragma: no cover
        return "unknown"


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that readers see the old file or the new one, never a part."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; records are shared like any file
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _read_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK = _read_umask()


def _shash(mod: tvm.IRModule) -> str:
    import tvm_ffi

    return str(tvm_ffi.structural_hash(mod))


@dataclasses.dataclass
class RecordSet:
    """The records of one ``<model>/<target-key>`` folder, held in memory."""

    path: Path
    manifest: dict
    workloads: list = dataclasses.field(default_factory=list)  # ms Workload, file order
    records: list = dataclasses.field(default_factory=list)  # ms TuningRecord

    def workload_index(self) -> dict[str, int]:
        return {_shash(w.mod): i for i, w in enumerate(self.workloads)}

    def trials_by_workload(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for rec in self.records:
            key = _shash(rec.workload.mod)
            counts[key] = counts.get(key, 0) + 1
        return counts

    def best_by_workload(self) -> dict[str, float]:
        best: dict[str, float] = {}
        for rec in self.records:
            secs = _mean_secs(rec)
            if secs is None:
                continue
            key = _shash(rec.workload.mod)
            best[key] = min(best.get(key, float("inf")), secs)
        return best

    def to_database(self, exclude: Iterable[str] = ()):
        """A fresh in-memory Meta-Schedule database holding these records (minus the workloads
        whose hash is in ``exclude``)."""
        ms = _ms()
        exclude = set(exclude)
        db = ms.database.MemoryDatabase()
        by_hash = {}
        for wl in self.workloads:
            key = _shash(wl.mod)
            if key not in exclude:
                by_hash[key] = db.commit_workload(wl.mod)
        for rec in self.records:
            wl = by_hash.get(_shash(rec.workload.mod))
            if wl is None:
                continue
            db.commit_tuning_record(
                ms.database.TuningRecord(rec.trace, wl, rec.run_secs, rec.target, rec.args_info)
            )
        return db

    def save(self) -> None:
        """Atomically rewrite the three files (workloads, then records, then manifest)."""
        self.path.mkdir(parents=True, exist_ok=True)
        index = self.workload_index()
        wl_lines = [json.dumps(w.as_json(), separators=(",", ":")) for w in self.workloads]
        rec_lines = [
            json.dumps([index[_shash(r.workload.mod)], _record_json(r)], separators=(",", ":"))
            for r in self.records
        ]
        self.manifest["num_workloads"] = len(wl_lines)
        self.manifest["num_records"] = len(rec_lines)
        self.manifest["updated"] = _now()
        atomic_write_text(self.path / WORKLOAD_FILE, "".join(line + "\n" for line in wl_lines))
        atomic_write_text(self.path / RECORD_FILE, "".join(line + "\n" for line in rec_lines))
        atomic_write_text(self.path / MANIFEST_FILE, json.dumps(self.manifest, indent=2) + "\n")


def _record_json(rec) -> list:
    """``TuningRecord.as_json()`` that also works for traces with ``transform_layout`` (weight
    packing): the record's own JSON leaves the IndexMap an object that Meta-Schedule's Python
    converter rejects, while ``trace.as_json()`` gives it as the string ``from_json`` reads back."""
    from tvm.s_tir.meta_schedule import _ffi_api as ms_api  # noqa: PLC0415

    _trace, *rest = ms_api.TuningRecordAsJSON(rec)
    return [_plain_json(rec.trace.as_json())] + [_plain_json(part) for part in rest]


def _plain_json(obj):
    """TVM containers and scalars (and Python lists of them) as plain JSON values."""
    import tvm_ffi  # noqa: PLC0415

    if obj is None or isinstance(obj, (bool, int, float)):
        return obj
    if isinstance(obj, str):
        return str(obj)
    if isinstance(obj, (tvm.tirx.IntImm, tvm.tirx.FloatImm)):
        return obj.value
    if isinstance(obj, (dict, tvm_ffi.Map)):
        return {_plain_json(k): _plain_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, tvm_ffi.Array)):
        return [_plain_json(x) for x in obj]
    raise TypeError(f"cannot write {type(obj).__name__} into a tuning record")


def _mean_secs(rec) -> float | None:
    if rec.run_secs is None or len(rec.run_secs) == 0:
        return None
    secs = [float(s) for s in rec.run_secs]
    mean = sum(secs) / len(secs)
    return None if mean >= FAILED_RUN_SECS else mean


def new_manifest(model_name: str, model_hash: str, target) -> dict:
    target = parse_target(target)
    return {
        "format": MANIFEST_FORMAT,
        "model_name": model_name,
        "model_hash": model_hash,
        "target_key": target_key(target),
        "target": target_json(target),
        "tvm_version": tvm.__version__,
        "tvm_fusion_version": _tvm_fusion_version(),
        "created": _now(),
        "updated": _now(),
        "tasks": {},
        "num_workloads": 0,
        "num_records": 0,
    }


def read_record_set(path: str | os.PathLike) -> RecordSet:
    """Parse a record folder; raises :class:`TuningRecordError` naming the file that is bad."""
    ms = _ms()
    path = Path(path)
    mpath = path / MANIFEST_FILE
    if not mpath.exists():
        raise TuningRecordError(f"{mpath}: missing, cannot tell which model/target/TVM the records are for")
    try:
        manifest = json.loads(mpath.read_text(encoding="utf-8"))
        if not isinstance(manifest, dict) or "model_hash" not in manifest or "target" not in manifest:
            raise ValueError("not a tvm_fusion tuning manifest")
    except (ValueError, UnicodeDecodeError) as err:
        raise TuningRecordError(f"{mpath}: corrupt or truncated manifest ({err})") from None
    rset = RecordSet(path=path, manifest=manifest)
    wpath, rpath = path / WORKLOAD_FILE, path / RECORD_FILE
    if manifest.get("num_workloads", 0) and not wpath.exists():
        raise TuningRecordError(f"{wpath}: missing, the manifest lists {manifest['num_workloads']} workloads")
    for lineno, obj in _json_lines(wpath):
        try:
            rset.workloads.append(ms.database.Workload.from_json(obj))
        except Exception as err:
            raise TuningRecordError(
                f"{wpath}: line {lineno}: not a Meta-Schedule workload ({last_line(err, 300)})"
            ) from None
    for lineno, obj in _json_lines(rpath):
        try:
            index, body = obj
            workload = rset.workloads[int(index)]
            rset.records.append(ms.database.TuningRecord.from_json(body, workload))
        except Exception as err:
            raise TuningRecordError(
                f"{rpath}: line {lineno}: not a valid tuning record ({last_line(err, 300)})"
            ) from None
    for what, got, file in (("workloads", len(rset.workloads), wpath), ("records", len(rset.records), rpath)):
        want = int(manifest.get(f"num_{what}", 0))
        if got < want:  # more is fine: a run stopped between writing records and the manifest
            raise TuningRecordError(f"{file}: truncated: {got} {what}, the manifest lists {want}")
    return rset


def _json_lines(path: Path) -> Iterable[tuple[int, Any]]:
    if not path.exists():
        return
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise TuningRecordError(f"{path}: not a text file ({err})") from None
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield lineno, json.loads(line)
        except json.JSONDecodeError as err:
            raise TuningRecordError(f"{path}: line {lineno}: corrupt or truncated JSON ({err.msg})") from None


def check_compatible(manifest: dict, path: Path, model_hash: str, target) -> list[str]:
    """Reasons this record set must not be used for (model_hash, target, this TVM); [] if none."""
    target = parse_target(target)
    problems = []
    if manifest.get("format") != MANIFEST_FORMAT:
        problems.append(
            f"record format {manifest.get('format')}, this tvm_fusion reads format {MANIFEST_FORMAT} "
            "(its workloads are not the functions the build schedules)"
        )
    if manifest.get("model_hash") != model_hash:
        problems.append(f"made for model hash {manifest.get('model_hash')}, this model is {model_hash}")
    want = target_json(target)
    if manifest.get("target") != want:
        have = manifest.get("target") or {}
        diff = sorted(k for k in set(have) | set(want) if have.get(k) != want.get(k))
        problems.append(f"made for target {json.dumps(have, sort_keys=True)} (differs in {', '.join(diff)})")
    if manifest.get("tvm_version") != tvm.__version__:
        problems.append(f"made with TVM {manifest.get('tvm_version')}, this is TVM {tvm.__version__}")
    return problems


@dataclasses.dataclass
class RecordReport:
    """What :func:`load_records` found; ``str(report)`` is meant for the user."""

    path: Path
    status: str  # "ok" | "missing" | "mismatch" | "corrupt"
    messages: list[str]
    num_records: int = 0
    num_workloads: int = 0
    num_applied: int = 0  # workloads whose records go into the database
    skipped: list[str] = dataclasses.field(default_factory=list)  # "name: why", not applied

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def __str__(self) -> str:
        return "\n".join(self.messages)


def load_records(
    log_root: str | os.PathLike,
    model_name: str,
    model_hash: str,
    target,
    *,
    strict: bool = False,
    only_faster: bool = True,
):
    """Find the records for (model, target, this TVM): returns ``(database or None, RecordReport)``.

    Records for another model hash, target or TVM version, and corrupt or truncated files, are
    reported and ignored (the build then uses default schedules); ``strict=True`` raises
    :class:`TuningRecordError` for those instead. With ``only_faster`` (default) functions whose
    tuned schedule was not faster than the default schedule are left out of the database (see
    :func:`slower_than_default`), so a tuned build is never slower than the untuned one; the
    database is ``None`` when nothing is left.
    """
    target = parse_target(target)
    path = record_dir(log_root, model_name, target)
    if not (path / MANIFEST_FILE).exists() and not (path / RECORD_FILE).exists():
        others = sorted(
            p.name for p in (Path(log_root) / model_name).glob("*") if (p / MANIFEST_FILE).exists()
        )
        msg = f"{path}: no tuning records: using default schedules"
        if others:
            msg += f" (records exist for other targets: {', '.join(others)})"
        return None, RecordReport(path, "missing", [msg])
    try:
        check_environment(need_workers=False)
        rset = read_record_set(path)
    except TuningRecordError as err:
        if strict:
            raise
        return None, RecordReport(path, "corrupt", [f"{err}: ignored, using default schedules"])
    problems = check_compatible(rset.manifest, path, model_hash, target)
    if problems:
        msg = f"{path}: {'; '.join(problems)}: ignored"
        if strict:
            raise TuningRecordError(msg)
        return None, RecordReport(path, "mismatch", [msg])
    messages = [f"{path}: {len(rset.records)} tuning records for {len(rset.workloads)} functions"]
    skipped, unchecked = ({}, []) if not only_faster else slower_than_default(rset)
    if skipped:
        detail = "; ".join(skipped.values())
        messages.append(
            f"{len(skipped)} of {len(rset.workloads)} tuned functions not faster than the default schedule: "
            f"not applied ({detail})"
        )
    if unchecked:
        messages.append(
            f"{len(unchecked)} tuned functions have no default-schedule timing (tuned by an older "
            f"version): applied unchecked ({', '.join(sorted(unchecked))})"
        )
    applied = len(rset.workloads) - len(skipped)
    report = RecordReport(
        path,
        "ok",
        messages,
        num_records=len(rset.records),
        num_workloads=len(rset.workloads),
        num_applied=applied,
        skipped=sorted(skipped.values()),
    )
    if applied == 0:
        return None, report
    if _uses_tensorize(path):
        load_tensor_intrinsics()
    return rset.to_database(exclude=skipped), report


def slower_than_default(rset: RecordSet) -> tuple[dict[str, str], list[str]]:
    """Which workloads must keep the default schedule: ``({hash: reason}, [unchecked names])``.

    A tuned schedule is applied only if it measured faster (by more than ``MIN_GAIN``) than the
    default schedule of the same function, both timed side by side by the same runner at the end of tuning (``tuned_us`` and
    ``default_us`` in the manifest). If trials were added after that check (an interrupted run),
    the best record's own latency stands in for ``tuned_us``. Workloads whose every trial failed
    are never applied (Meta-Schedule would apply a failed one).
    """
    best = rset.best_by_workload()
    trials = rset.trials_by_workload()
    tasks = rset.manifest.get("tasks", {})
    skipped: dict[str, str] = {}
    unchecked: list[str] = []
    for wl in rset.workloads:
        key = _shash(wl.mod)
        entry = tasks.get(key, {})
        name = entry.get("name", key)
        if key not in best:
            if trials.get(key, 0):
                skipped[key] = f"{name}: every trial failed"
            continue  # no records at all: nothing to apply
        default_us = entry.get("default_us")
        if default_us is None:
            unchecked.append(name)
            continue
        tuned_us = entry.get("tuned_us")
        if tuned_us is None or entry.get("verified_trials") != trials.get(key, 0):
            tuned_us = best[key] * 1e6
        if not beats_default(tuned_us, default_us):
            skipped[key] = f"{name}: tuned {float(tuned_us):.2f} us vs default {float(default_us):.2f} us"
    return skipped, unchecked


def _uses_tensorize(path: Path) -> bool:
    try:
        return '"Tensorize"' in (path / RECORD_FILE).read_text(encoding="utf-8")
    except OSError:
        return False


# --------------------------------------------------------------------------------------------
# Applying records at build time
# --------------------------------------------------------------------------------------------


@tvm.transform.module_pass(opt_level=0, name="tvm_fusion.ApplyTuningRecords")
class ApplyTuningRecords:
    """Replace each PrimFunc that has a record by its best measured schedule.

    Meta-Schedule finds a record by the structural hash of the PrimFunc, so this must run on the
    module exactly as it was tuned; on CPU it first marks constant weights layout-free as tuning
    did (``schedules.mark_prepackable``; a no-op on a module marked already). Applied functions
    get ``tirx.is_scheduled`` and are skipped by the default schedules that run after it.
    """

    def __init__(self, database, target=None, enable_warning: bool = False):
        self.database = database
        self.target = parse_target(target) if target is not None else None
        self.enable_warning = enable_warning

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        if self.database is None:
            return mod
        apply = relax.transform.MetaScheduleApplyDatabase(enable_warning=self.enable_warning)
        with contextlib.ExitStack() as stack:
            if self.target is not None:
                stack.enter_context(self.target)
            elif tvm.target.Target.current(allow_none=True) is None:
                raise TargetError("apply_records needs a target: pass target= or run under `with target:`")
            stack.enter_context(self.database)
            from .schedules import mark_prepackable  # noqa: PLC0415

            marked = tvm.transform.Sequential(mark_prepackable(tvm.target.Target.current()))(mod)
            return apply(marked)


def apply_records(database, target=None, enable_warning: bool = False) -> tvm.transform.Pass:
    """The pass that applies ``database`` (from :func:`load_records`); a no-op for ``None``."""
    return ApplyTuningRecords(database, target=target, enable_warning=enable_warning)


def _is_scheduled(func) -> bool:
    return (
        isinstance(func, tvm.tirx.PrimFunc)
        and func.attrs is not None
        and bool(func.attrs.get("tirx.is_scheduled", False))
    )


@dataclasses.dataclass
class ScheduleCounts:
    tuned: list[str]
    default: list[str]

    def summary(self, default_label: str = "default (dlight)") -> str:
        return f"{len(self.tuned)} functions tuned, {len(self.default)} {default_label}"


def count_scheduled(mod_before: tvm.IRModule, mod_after: tvm.IRModule) -> ScheduleCounts:
    """Which PrimFuncs ``apply_records`` scheduled (``tuned``) and which were left for defaults."""
    tuned, default = [], []
    for gv, func in mod_after.functions_items():
        if not isinstance(func, tvm.tirx.PrimFunc):
            continue
        name = gv.name_hint
        before = mod_before[name] if name in [g.name_hint for g in mod_before.get_global_vars()] else None
        if _is_scheduled(func) and not (before is not None and _is_scheduled(before)):
            tuned.append(name)
        elif not _is_scheduled(func):
            default.append(name)
    return ScheduleCounts(sorted(tuned), sorted(default))


def schedule(mod: tvm.IRModule, target, database=None) -> tuple[tvm.IRModule, ScheduleCounts]:
    """Schedule a fused module as the build does: constant weights marked layout-free, tuned
    records from ``database`` applied, default schedules for the rest."""
    from .schedules import default_schedule_passes, mark_prepackable  # noqa: PLC0415

    target = parse_target(target)
    with target:
        marked = tvm.transform.Sequential(mark_prepackable(target))(mod)
        tuned = apply_records(database)(marked)
        counts = count_scheduled(marked, tuned)
        scheduled = tvm.transform.Sequential(default_schedule_passes(target))(tuned)
    return scheduled, counts


def lower_pipeline(target) -> tvm.transform.Pass:
    """Relax lowering after scheduling: the target's default pipeline minus legalize and fusion."""
    target = parse_target(target)
    from tvm.relax import pipeline as rp  # noqa: PLC0415

    try:
        lower = rp.dataflow_lower_passes(target)
    except AttributeError:  # TVM 0.27: backend.cpu_generic does not export it
        lower = [
            relax.transform.RewriteDataflowReshape(),
            relax.transform.ToNonDataflow(),
            relax.transform.RemovePurityChecking(),
            relax.transform.CallTIRRewrite(),
        ]
    passes = lower + rp.finalize_passes(target)

    @tvm.transform.module_pass(opt_level=0, name="tvm_fusion.LowerScheduled")
    def _lower(mod, _ctx):
        with target:
            return tvm.transform.Sequential(passes)(mod)

    return _lower


def build(mod: tvm.IRModule, target, database=None):
    """Compile a fused module with tuned schedules where records exist: ``(executable, counts)``."""
    target = parse_target(target)
    scheduled, counts = schedule(mod, target, database)
    return tvm.compile(scheduled, target=target, relax_pipeline=lower_pipeline(target)), counts


# --------------------------------------------------------------------------------------------
# The default schedule as a baseline for each task
# --------------------------------------------------------------------------------------------


def default_schedule_modules(mod: tvm.IRModule, target, tasks=None) -> dict[str, tvm.IRModule]:
    """Per task (workload hash): its PrimFunc under the default schedule, as the build runs it.

    Task functions carry the build's layout-free marks (see :func:`extract_tasks`), so the
    Contraction rule packs constant weights in a block annotated as layout-rewrite preproc, and
    the builder drops that block (``RemoveWeightLayoutRewriteBlock``, as it does for tuned
    candidates): the timed kernel reads pre-packed weights like the built one does.
    """
    from tvm.s_tir import dlight as dl  # noqa: PLC0415

    from .schedules import default_rules  # noqa: PLC0415

    target = parse_target(target)
    tasks = extract_tasks(mod, target) if tasks is None else tasks
    rule = dl.ApplyDefaultSchedule(*default_rules(target))
    out = {}
    for task in tasks:
        wl_mod = task.dispatched[0]
        with target:
            out[_shash(wl_mod)] = rule(tvm.IRModule({"main": wl_mod["main"]}))
    return out


def measure_modules(builder, runner, target, items: list[tuple[Any, tvm.IRModule]], rounds: int = 3) -> dict:
    """Build each ``(key, scheduled module)`` once and time it ``rounds`` times, all keys in turn
    (side by side), with the tuning builder/runner: ``{key: fastest round's seconds or None}``.

    The fastest round, not the median: on a shared machine other tenants only ever add time, and
    a median of few rounds still swung 2x between identical kernels here."""
    import shutil  # noqa: PLC0415

    ms = _ms()
    target = parse_target(target)
    args = [ms.arg_info.ArgInfo.from_entry_func(m, remove_preproc=True) for _, m in items]
    built = builder.build([ms.builder.BuilderInput(m, target) for _, m in items])
    ok = [i for i, b in enumerate(built) if b.error_msg is None and b.artifact_path]
    device_type = {"llvm": "cpu", "c": "cpu"}.get(target.kind.name, target.kind.name)
    times: dict = {key: [] for key, _ in items}
    try:
        for _ in range(rounds):
            runs = [ms.runner.RunnerInput(built[i].artifact_path, device_type, args[i]) for i in ok]
            for i, future in zip(ok, runner.run(runs)):
                res = future.result()
                if res.error_msg is None and res.run_secs:
                    secs = [float(x) for x in res.run_secs]
                    times[items[i][0]].append(sum(secs) / len(secs))
    finally:
        for i in ok:
            shutil.rmtree(os.path.dirname(built[i].artifact_path), ignore_errors=True)
    return {key: (min(v) if v else None) for key, v in times.items()}


def _best_record(rset: RecordSet, key: str):
    recs = [
        (s, r)
        for r in rset.records
        if _shash(r.workload.mod) == key
        for s in [_mean_secs(r)]
        if s is not None
    ]
    return min(recs, key=lambda x: x[0])[1] if recs else None


def verify_against_default(
    rset: RecordSet,
    mod,
    target,
    tasks,
    summaries,
    builder,
    runner,
    rounds: int = 5,
    say=None,
    again: bool = False,
) -> None:
    """Time each task's default schedule and its best tuned record side by side; store
    ``default_us``, ``tuned_us`` and ``verified_trials`` in the manifest (read by
    :func:`slower_than_default` when the build loads the records). Tasks checked already with
    the trials now on disk are skipped unless ``again``."""
    target = parse_target(target)
    defaults = default_schedule_modules(mod, target, tasks)
    items = []
    todo = []
    for summary in summaries:
        entry = rset.manifest["tasks"][summary.workload_hash]
        if (
            not again
            and entry.get("verified_trials") == summary.trials
            and entry.get("default_us") is not None
        ):
            summary.default_us, summary.tuned_us = entry["default_us"], entry.get("tuned_us")
            continue
        best = _best_record(rset, summary.workload_hash)
        items.append((("default", summary.workload_hash), defaults[summary.workload_hash]))
        if best is not None:
            items.append((("tuned", summary.workload_hash), best.as_measure_candidate().sch.mod))
        todo.append(summary)
    if not todo:
        return
    if say is not None:
        say(f"timing {len(todo)} default schedules against the best tuned ones ({rounds} rounds)")
    times = measure_modules(builder, runner, tuning_target(target), items, rounds)
    for summary in todo:
        entry = rset.manifest["tasks"][summary.workload_hash]
        d = times.get(("default", summary.workload_hash))
        t = times.get(("tuned", summary.workload_hash))
        summary.default_us = None if d is None else round(d * 1e6, 4)
        summary.tuned_us = None if t is None else round(t * 1e6, 4)
        if summary.default_us is None:
            if say is not None:
                say(f"  {summary.name}: could not time the default schedule; records applied unchecked")
            continue
        entry.update(default_us=summary.default_us, tuned_us=summary.tuned_us, verified_trials=summary.trials)
    rset.save()


# --------------------------------------------------------------------------------------------
# Tuning
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class TaskSummary:
    name: str
    workload_hash: str
    budget: int
    trials_before: int
    trials: int  # measured trials on disk for this task, all runs together
    best_us: float | None
    skipped: bool = False  # already at budget when this run started
    default_us: float | None = None  # default schedule, timed side by side with tuned_us
    tuned_us: float | None = None  # best record re-timed next to the default

    @property
    def new_trials(self) -> int:
        return self.trials - self.trials_before

    @property
    def applied(self) -> bool | None:
        """Whether the build will use the tuned schedule (None: not compared with the default)."""
        if self.default_us is None:
            return None if self.best_us is not None else False
        return beats_default(self.tuned_us if self.tuned_us is not None else self.best_us, self.default_us)


@dataclasses.dataclass
class TuneResult:
    record_dir: Path
    tasks: list[TaskSummary]
    elapsed_s: float
    database: Any = None  # ms MemoryDatabase with the records the build will apply
    messages: list[str] = dataclasses.field(default_factory=list)
    speedup: Any = None  # SpeedupReport, when tune_model(measure=True)

    def __str__(self) -> str:
        text = self.summary()
        return text if self.speedup is None else f"{text}\n{self.speedup}"

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
            state = "skipped (at budget)" if t.skipped else f"+{t.new_trials}"
            line = f"  {t.name}: {t.trials}/{t.budget} trials ({state}), best {best}"
            if t.default_us is not None:
                tuned = "n/a" if t.tuned_us is None else f"{t.tuned_us:.2f} us"
                verdict = "tuned schedule used" if t.applied else "default schedule kept"
                line += f"; side by side: tuned {tuned} vs default {t.default_us:.2f} us -> {verdict}"
            lines.append(line)
        used = sum(1 for t in self.tasks if t.applied)
        lines.append(
            f"{self.new_trials} new trials ({self.total_trials} in all) in {self.elapsed_s:.1f} s; "
            f"{used}/{len(self.tasks)} functions will use tuned schedules; records in {self.record_dir}"
        )
        return "\n".join(lines)


def parse_rpc(spec: str):
    """``"host:port:key"`` -> ``ms.runner.RPCConfig``."""
    ms = _ms()
    parts = spec.rsplit(":", 2) if isinstance(spec, str) else []
    if len(parts) != 3 or not parts[0] or not parts[2] or not parts[1].isdigit():
        raise TargetError(f"bad RPC tracker {spec!r}: expected 'host:port:key', e.g. '127.0.0.1:9190:h100'")
    return ms.runner.RPCConfig(
        tracker_host=parts[0], tracker_port=int(parts[1]), tracker_key=parts[2], session_timeout_sec=60
    )


def check_can_tune(target, rpc: str | None = None) -> None:
    """GPU tuning measures on a GPU: a local one, or one behind an RPC tracker."""
    target = parse_target(target)
    if rpc is not None:
        parse_rpc(rpc)
        return
    if is_gpu(target):
        kind = target.kind.name
        if not tvm.device(kind, 0).exist:
            raise TargetError(
                f"tuning for {kind} measures every candidate on a GPU, and this machine has no {kind} "
                "device: run it on a machine with one, or pass rpc='host:port:key' for a TVM RPC "
                "tracker (building with existing records does not need a GPU)"
            )


# What Meta-Schedule's GPU rules read from the target; the short "cuda" target lacks them.
_CUDA_TUNING_DEFAULTS = {
    "max_threads_per_block": 1024,
    "max_shared_memory_per_block": 49152,
    "registers_per_block": 65536,
    "thread_warp_size": 32,
}


def tuning_target(target) -> tvm.target.Target:
    """``target`` plus the attributes Meta-Schedule's CUDA schedule rules need (when missing).

    Records and manifests still name the user's target: these attributes change the search, not
    the PrimFuncs the records are keyed by.
    """
    target = parse_target(target)
    if target.kind.name != "cuda":
        return target
    spec = target_json(target)
    missing = {k: v for k, v in _CUDA_TUNING_DEFAULTS.items() if k not in spec}
    if not missing:
        return target
    host = spec.pop("host", None)
    spec.update(missing)
    return tvm.target.Target(spec, host=tvm.target.Target(host) if host else target.host)


def _make_runner(target, rpc, evaluator_config, timeout_s, max_workers):
    ms = _ms()
    if rpc is not None:
        return ms.runner.RPCRunner(
            rpc_config=parse_rpc(rpc), evaluator_config=evaluator_config, max_workers=max_workers
        )
    return ms.runner.LocalRunner(timeout_sec=timeout_s, evaluator_config=evaluator_config)


def split_budget(trials: int, num_tasks: int, max_trials_per_task: int | None) -> list[int]:
    """Equal shares of the total (first tasks get the remainder), capped per task."""
    if num_tasks == 0:
        return []
    base, extra = divmod(max(int(trials), 0), num_tasks)
    shares = [base + (1 if i < extra else 0) for i in range(num_tasks)]
    if max_trials_per_task is not None:
        shares = [min(s, int(max_trials_per_task)) for s in shares]
    return shares


def rule_candidates(task_mod: tvm.IRModule, target, first: int = 1, count: int = RULE_CANDIDATES) -> list:
    """Schedules of a task by the Contraction rule's ``first``-th .. plans (rank 0 is the default
    schedule): up to ``count`` ``s_tir.Schedule``s, whose traces replay as tuning records. Empty
    for kernels the rule does not schedule (and on GPU)."""
    from .schedules import Contraction  # noqa: PLC0415

    target = parse_target(target)
    if is_gpu(target):
        return []
    out = []
    for rank in range(first, first + count):
        sch = Contraction(plan_rank=rank).apply(task_mod["main"], target, False)
        if sch is None:
            break
        out.append(sch)
    return out


def _rule_plan_share(budget: int) -> int:
    return min(RULE_CANDIDATES, max(int(budget), 0) // 2)


def extract_tasks(mod: tvm.IRModule, target) -> list:
    """Meta-Schedule tasks of a fused module (one per distinct PrimFunc not scheduled yet).

    On CPU the functions are first marked as the build marks them before applying records
    (``schedules.mark_prepackable``: constant weights are layout-free), so tuned schedules may
    pre-pack weights and the records' workloads are the functions the build looks up."""
    from .schedules import mark_prepackable  # noqa: PLC0415

    ms = _ms()
    target = parse_target(target)
    mod = tvm.transform.Sequential(mark_prepackable(target))(mod)
    tasks = ms.relax_integration.extract_tasks(mod, target)
    return [t for t in tasks if not t.mod.attrs or not t.mod.attrs.get("tirx.is_scheduled", False)]


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
    max_workers: int = 1,
    timeout_s: float = 60.0,
    seed: int = 0,
    min_repeat_ms: int = 50,
    population_size: int | None = None,
    check_default: bool = True,
    verify_rounds: int = 5,
    verify_again: bool = False,
    on_task_done: Callable[[TaskSummary], None] | None = None,
    on_batch: Callable[[TaskSummary], None] | None = None,
    log: Callable[[str], None] | None = None,
) -> TuneResult:
    """Tune every fused PrimFunc of ``mod`` for ``target`` and store the records.

    ``mod`` must be the fused module the build will schedule (see module docstring). ``trials`` is
    the total budget, split evenly over the tasks (capped by ``max_trials_per_task``). Tasks already
    at their budget in ``<log_root>/<model_name>/<target-key>`` are skipped; others continue from
    the trials on disk. Records for another model/target/TVM found there are moved aside to
    ``<target-key>.old-<date>`` (reported, never mixed in).

    Search, per task: first (CPU) the Contraction rule's runner-up plans, at most
    ``RULE_CANDIDATES`` and half the task's budget (:func:`rule_candidates`); then Meta-Schedule's
    evolutionary search with the XGBoost cost model for the rest, ``num_trials_per_iter``
    candidates measured per batch; ``population_size`` defaults to 16 x that (64..512,
    Meta-Schedule's default is 512). Both kinds of trial are records of the same database and
    pack constant weights at compile time (the tasks are marked layout-free, see
    :func:`extract_tasks`).

    With ``check_default`` (default), each tuned task's best schedule is then timed side by side
    with the task's default schedule (``verify_rounds`` rounds, same builder and runner); the
    manifest keeps both, and the build applies only the tuned schedules that won. A task is
    checked once for the trials on disk; ``verify_again`` re-times every task (e.g. after a run
    on a machine that was busy).

    ``on_task_done`` / ``on_batch`` are called after each task / measured batch, once its records
    are on disk (tests use them to simulate Ctrl-C).
    """
    t_start = time.time()
    target = parse_target(target)
    say = log or (lambda msg: print(msg, file=sys.stderr))
    check_can_tune(target, rpc)
    check_environment()
    ms = _ms()

    path = record_dir(log_root, model_name, target)
    messages: list[str] = []
    rset = _open_for_tuning(path, model_name, model_hash, target, messages)
    for msg in messages:
        say(msg)

    tasks = extract_tasks(mod, target)
    budgets = split_budget(trials, len(tasks), max_trials_per_task)
    index = rset.workload_index()
    done = rset.trials_by_workload()
    best = rset.best_by_workload()
    summaries: list[TaskSummary] = []
    for task, budget in zip(tasks, budgets):
        wl_mod = task.dispatched[0]
        key = _shash(wl_mod)
        if key not in index:
            index[key] = len(rset.workloads)
            rset.workloads.append(ms.database.Workload(wl_mod))
        entry = rset.manifest["tasks"].get(key, {})
        trials_done = done.get(key, 0)
        # A task tuned to its budget earlier may have measured fewer (its search space ran out).
        at_budget = trials_done >= budget or int(entry.get("budget", 0)) >= budget
        best_us = best[key] * 1e6 if key in best else None
        summaries.append(
            TaskSummary(task.task_name, key, budget, trials_done, trials_done, best_us, at_budget)
        )
        rset.manifest["tasks"][key] = {
            **entry,  # keeps default_us / tuned_us / verified_trials of an earlier run
            "name": task.task_name,
            "weight": int(task.weight),
            "budget": int(entry.get("budget", 0)),
            "trials": trials_done,
            "best_us": None if key not in best else round(best[key] * 1e6, 4),
        }
    rset.save()  # manifest first: any later state on disk says what it is for

    remaining = sum(max(s.budget - s.trials, 0) for s in summaries if not s.skipped)
    bar = _progress_bar(remaining, progress and remaining > 0)
    evaluator = ms.runner.EvaluatorConfig(
        number=3, repeat=1, min_repeat_ms=min_repeat_ms, enable_cpu_cache_flush=False
    )
    num_threads = max(1, min(os.cpu_count() or 1, 4))
    state = {"task": None, "stop": 0, "pending": None}
    builder = runner = None
    search_target = tuning_target(target)
    population = population_size or min(512, max(64, 16 * num_trials_per_iter))

    def workers():
        """Builder and runner, started once, for the first task that needs them."""
        nonlocal builder, runner
        if builder is None:
            builder = make_builder(max_workers, timeout_s)
            runner = _make_runner(search_target, rpc, evaluator, timeout_s, max_workers)
        return builder, runner

    def checkpoint(database, rule_records=()) -> None:
        """Copy the working database's records (and newly measured rule plans) into the record
        set and save it atomically."""
        summary = state["task"]
        mine = [r for r in rset.records if _shash(r.workload.mod) == summary.workload_hash]
        searched = [
            r for r in database.get_all_tuning_records() if _shash(r.workload.mod) == summary.workload_hash
        ]
        recs = [r for r in mine if not _is_search_record(r)] + list(rule_records) + searched
        if not recs:
            return
        others = [r for r in rset.records if _shash(r.workload.mod) != summary.workload_hash]
        rset.records = others + recs
        summary.trials = len(recs)
        times = [s for s in (_mean_secs(r) for r in recs) if s is not None]
        summary.best_us = min(times) * 1e6 if times else None
        entry = rset.manifest["tasks"][summary.workload_hash]
        entry.update(
            trials=summary.trials, best_us=None if summary.best_us is None else round(summary.best_us, 4)
        )
        rset.save()

    with _interrupt_handling(state, say):
        try:
            for i, (task, summary) in enumerate(zip(tasks, summaries)):
                if summary.skipped or summary.trials >= summary.budget:
                    continue
                if state["stop"]:
                    raise KeyboardInterrupt
                load_tensor_intrinsics()  # TuneContext imports them; only when there is work
                state["task"] = summary
                database = ms.database.MemoryDatabase()
                _seed_database(database, rset, summary.workload_hash)
                builder, runner = workers()
                _measure_rule_plans(
                    task,
                    summary,
                    rset.manifest["tasks"][summary.workload_hash],
                    search_target,
                    builder,
                    runner,
                    num_trials_per_iter,
                    lambda recs, db=database: checkpoint(db, recs),
                    bar,
                    on_batch,
                    state,
                )
                todo = summary.budget - summary.trials
                if todo > 0:
                    callback = _make_checkpoint_callback(
                        ms,
                        lambda db=database: checkpoint(db),
                        bar,
                        summary,
                        f"{i + 1}/{len(tasks)}",
                        on_batch,
                        state,
                    )
                    ctx = ms.TuneContext(
                        mod=task.dispatched[0],
                        target=search_target,
                        space_generator="post-order-apply",
                        search_strategy=ms.search_strategy.EvolutionarySearch(population_size=population),
                        task_name=task.task_name,
                        num_threads=num_threads,
                        rand_state=seed + i + summary.trials,
                    ).clone()
                    _run_scheduler(
                        state,
                        ms.tune.tune_tasks,
                        tasks=[ctx],
                        task_weights=[1.0],
                        work_dir=str(path),
                        max_trials_global=todo,
                        max_trials_per_task=todo,
                        num_trials_per_iter=min(num_trials_per_iter, todo),
                        builder=builder,
                        runner=runner,
                        database=database,
                        cost_model=ms.cost_model.XGBModel(
                            num_tuning_cores=num_threads, adaptive_training=True
                        ),
                        measure_callbacks=ms.measure_callback.MeasureCallback.create("default") + [callback],
                        task_scheduler="round-robin",
                    )
                checkpoint(database)
                rset.manifest["tasks"][summary.workload_hash]["budget"] = summary.budget
                rset.save()
                state["task"] = None
                if on_task_done is not None:
                    on_task_done(summary)
            bar.close()
            if check_default:
                tuned = [s for s in summaries if s.best_us is not None]
                if tuned:
                    load_tensor_intrinsics()
                    verify_against_default(
                        rset,
                        mod,
                        target,
                        [t for t, s in zip(tasks, summaries) if s.best_us is not None],
                        tuned,
                        *workers(),
                        rounds=verify_rounds,
                        say=say if progress else None,
                        again=verify_again,
                    )
        except KeyboardInterrupt:
            if state["task"] is not None:
                with contextlib.suppress(Exception):
                    checkpoint(database)
            say(
                f"interrupted: {sum(s.trials for s in summaries)} trials are saved in {path}; run again to resume"
            )
            raise
        finally:
            bar.close()

    skipped, _ = slower_than_default(rset)
    database = rset.to_database(exclude=skipped)
    return TuneResult(path, summaries, time.time() - t_start, database=database, messages=messages)


def _measure_rule_plans(
    task, summary, entry, target, builder, runner, batch_size, checkpoint, bar, on_batch, state
) -> None:
    """Measure the task's Contraction runner-up plans (see :func:`rule_candidates`) in batches and
    save them as tuning records (``checkpoint(records)``); ``entry["plans_measured"]`` makes a
    resumed run continue where this one stopped. They are kept out of the search's database:
    the search replays its seeds through Meta-Schedule's postprocessors, which abort on a
    schedule that already packs its weights."""
    ms = _ms()
    done = int(entry.get("plans_measured", 0))
    schedules = rule_candidates(
        task.dispatched[0], target, first=done + 1, count=_rule_plan_share(summary.budget) - done
    )
    if not schedules:
        return
    workload = ms.database.Workload(task.dispatched[0])
    for start in range(0, len(schedules), max(batch_size, 1)):
        batch = schedules[start : start + max(batch_size, 1)]
        times = measure_modules(
            builder, runner, target, [(i, sch.mod) for i, sch in enumerate(batch)], rounds=1
        )
        records = [
            ms.database.TuningRecord(
                sch.trace,
                workload,
                [times[i]],
                target,
                ms.arg_info.ArgInfo.from_entry_func(sch.mod, remove_preproc=True),
            )
            for i, sch in enumerate(batch)
            if times.get(i) is not None
        ]
        entry["plans_measured"] = done = done + len(batch)
        checkpoint(records)
        bar.update(len(batch))
        if on_batch is not None:
            on_batch(summary)
        if state["stop"]:
            raise KeyboardInterrupt


def _open_for_tuning(path: Path, model_name, model_hash, target, messages: list[str]) -> RecordSet:
    """The existing compatible record set, or a new one (moving an incompatible one aside)."""
    if (path / MANIFEST_FILE).exists() or (path / RECORD_FILE).exists():
        try:
            rset = read_record_set(path)
            problems = check_compatible(rset.manifest, path, model_hash, target)
        except TuningRecordError as err:
            problems = [str(err)]
        if not problems:
            messages.append(f"{path}: resuming from {len(rset.records)} existing trials")
            return rset
        aside = path.with_name(f"{path.name}.old-{_dt.datetime.now().strftime('%Y%m%d-%H%M%S')}")
        os.replace(path, aside)
        messages.append(f"{path}: {'; '.join(problems)}: moved to {aside.name}, tuning from scratch")
    return RecordSet(path=path, manifest=new_manifest(model_name, model_hash, target))


def _is_search_record(rec) -> bool:
    """Whether a record came from the Meta-Schedule search rather than from a rule plan: the
    search marks where its postprocessors begin (``EnterPostproc``) in every trace it makes."""
    return any(inst.kind.name == "EnterPostproc" for inst in rec.trace.insts)


def _seed_database(database, rset: RecordSet, workload_hash: str) -> None:
    """Give the search the trials it already measured for this task (it starts from the best ones)."""
    ms = _ms()
    recs = [r for r in rset.records if _shash(r.workload.mod) == workload_hash and _is_search_record(r)]
    if not recs:
        return
    wl = database.commit_workload(recs[0].workload.mod)
    for r in recs:
        database.commit_tuning_record(
            ms.database.TuningRecord(r.trace, wl, r.run_secs, r.target, r.args_info)
        )


def _make_checkpoint_callback(ms, save, bar, summary: TaskSummary, position: str, on_batch, state):
    from tvm.ir.utils import derived_object  # noqa: PLC0415

    @derived_object
    class _Checkpoint(ms.measure_callback.PyMeasureCallback):
        """Runs after AddToDatabase: saves the batch to disk, moves the progress bar, and is where
        a pending Ctrl-C stops the search (an exception raised here reaches Python again as a bare
        RuntimeError, so it is parked in ``state["pending"]`` and re-raised by _run_scheduler)."""

        def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results):
            try:
                save()
                bar.update(len(runner_results))
                best = f"{summary.best_us:.2f}us" if summary.best_us is not None else "n/a"
                bar.set_postfix_str(f"task {position} {summary.name} best {best}", refresh=True)
                if on_batch is not None:
                    on_batch(summary)
                if state["stop"]:
                    raise KeyboardInterrupt
            except BaseException as err:
                state["pending"] = err
                raise

    return _Checkpoint()


def _run_scheduler(state, fn, **kwargs):
    """Run the C++ task scheduler; give back the exception a Python callback raised inside it."""
    try:
        return fn(**kwargs)
    except BaseException as err:
        pending, state["pending"] = state["pending"], None
        if pending is not None:
            raise pending from None
        if isinstance(err, KeyboardInterrupt) or state["stop"]:
            raise KeyboardInterrupt(str(err)) from None
        raise


@contextlib.contextmanager
def _interrupt_handling(state, say):
    """First Ctrl-C: stop after the batch being measured (it is saved). Second Ctrl-C or ``kill``
    (SIGTERM): stop now; the batches already finished are on disk either way."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _on_int(_signum, _frame):
        state["stop"] += 1
        if state["stop"] == 1:
            say("\nstopping after the current batch (Ctrl-C again to stop now)")
            return
        raise KeyboardInterrupt

    def _on_term(_signum, _frame):
        state["stop"] += 2
        raise KeyboardInterrupt("SIGTERM")

    old_int = signal.signal(signal.SIGINT, _on_int)
    old_term = signal.signal(signal.SIGTERM, _on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old_int)
        signal.signal(signal.SIGTERM, old_term)


def _progress_bar(total: int, enabled: bool):
    from tqdm.auto import tqdm  # noqa: PLC0415

    return tqdm(total=total, unit="trial", desc="tuning", disable=not enabled, dynamic_ncols=True)


# --------------------------------------------------------------------------------------------
# Speed-up measurement
# --------------------------------------------------------------------------------------------


def time_executable(ex, inputs: dict, device=None, number: int = 20, repeat: int = 5) -> float:
    """Median seconds of one ``main`` call (VM time_evaluator)."""
    device = device or tvm.cpu()
    vm = relax.VirtualMachine(ex, device)
    args = [tvm.runtime.tensor(v, device) for v in inputs.values()]
    timer = vm.time_evaluator("main", device, number=number, repeat=repeat, min_repeat_ms=50)
    return float(timer(*args).median)


def run_executable(ex, inputs: dict, device=None):
    device = device or tvm.cpu()
    vm = relax.VirtualMachine(ex, device)
    out = vm["main"](*[tvm.runtime.tensor(v, device) for v in inputs.values()])
    return out.numpy() if hasattr(out, "numpy") else [o.numpy() for o in out]


@dataclasses.dataclass
class SpeedupReport:
    """Tuned vs untuned build of one model through ``tvm_fusion.build``, timed side by side."""

    model: str
    target_key: str
    untuned_ms: float
    tuned_ms: float
    tuned_kernels: int
    default_kernels: int
    records_note: str
    max_abs_diff: float
    rounds: int

    @property
    def speedup(self) -> float:
        return self.untuned_ms / self.tuned_ms if self.tuned_ms > 0 else float("nan")

    def __str__(self) -> str:
        return (
            f"{self.model} on {self.target_key}: untuned {self.untuned_ms:.4f} ms, tuned {self.tuned_ms:.4f} ms "
            f"(x{self.speedup:.2f}, median of {self.rounds} interleaved rounds); {self.tuned_kernels} kernels tuned, "
            f"{self.default_kernels} default; outputs differ by at most {self.max_abs_diff:.2e}\n"
            f"  records: {self.records_note}"
        )


def measure_speedup(
    model,
    target="llvm",
    *,
    tuning_logs: str | os.PathLike = "tuning_logs",
    policy=None,
    options: dict | None = None,
    inputs: dict | None = None,
    rounds: int = 15,
    number: int = 10,
) -> SpeedupReport:
    """Build ``model`` with the real pipeline twice, with ``tuning_logs`` and with none, and time
    both executables in alternation (``rounds`` rounds of ``number`` calls; medians reported)."""
    import statistics  # noqa: PLC0415

    import numpy as np  # noqa: PLC0415

    from .api import build as api_build  # noqa: PLC0415

    target = parse_target(target)
    if is_gpu(target) and not tvm.device(target.kind.name, 0).exist:
        raise TargetError(f"cannot time {target.kind.name} builds: no {target.kind.name} device here")
    imported = load_model(model)
    options = dict(options or {})
    untuned = api_build(imported, target, policy, tuning_logs=None, **options)
    tuned = api_build(imported, target, policy, tuning_logs=tuning_logs, **options)
    if inputs is None:
        inputs = _random_inputs(imported)
    from .targets import device_for  # noqa: PLC0415

    device = device_for(target)
    out_u = run_executable(untuned.executable, inputs, device)
    out_t = run_executable(tuned.executable, inputs, device)
    diff = max(
        float(np.max(np.abs(np.asarray(a, dtype="float64") - np.asarray(b, dtype="float64"))))
        for a, b in zip(_as_list(out_u), _as_list(out_t))
    )
    timers = []
    for ex in (untuned.executable, tuned.executable):
        vm = relax.VirtualMachine(ex, device)
        args = [tvm.runtime.tensor(v, device) for v in inputs.values()]
        timers.append((vm.time_evaluator("main", device, number=number, repeat=1, min_repeat_ms=50), args))
    samples: list[list[float]] = [[], []]
    for _ in range(rounds):
        for k, (timer, args) in enumerate(timers):
            samples[k].append(float(timer(*args).mean))
    return SpeedupReport(
        model=imported.name,
        target_key=target_key(target),
        untuned_ms=statistics.median(samples[0]) * 1e3,
        tuned_ms=statistics.median(samples[1]) * 1e3,
        tuned_kernels=tuned.tuned_kernels,
        default_kernels=tuned.default_kernels,
        records_note=str(tuned.records_note),
        max_abs_diff=diff,
        rounds=rounds,
    )


def _as_list(out):
    return out if isinstance(out, list) else [out]


def _random_inputs(imported) -> dict:
    import numpy as np  # noqa: PLC0415

    from .models import random_inputs  # noqa: PLC0415

    if imported.onnx_model is not None:
        return random_inputs(imported.onnx_model)
    rng = np.random.default_rng(0)
    return {
        s.name: rng.standard_normal([d if isinstance(d, int) and d > 0 else 1 for d in s.shape]).astype(
            s.dtype
        )
        for s in imported.inputs
    }


# --------------------------------------------------------------------------------------------
# Whole-model entry point (scripts/tune.py, the CLI)
# --------------------------------------------------------------------------------------------


def fuse_for_build(mod: tvm.IRModule, target, policy=None, options: dict | None = None) -> tvm.IRModule:
    """The fused, unscheduled module ``tvm_fusion.build`` schedules: the project pipeline with
    ``schedule=False``, pass by pass under ``with target:`` exactly as the build runs it, then
    (CPU) the layout-free marking the build does before it applies records. Records
    are keyed by PrimFunc hash, so tuning must see these very functions (same policy and options
    as the build, e.g. ``layout``, ``horizontal``)."""
    from .pipeline import pipeline_passes  # noqa: PLC0415
    from .schedules import mark_prepackable  # noqa: PLC0415

    target = parse_target(target)
    opts = {k: v for k, v in (options or {}).items() if k not in ("schedule", "database")}
    passes = pipeline_passes(target, policy, schedule=False, **opts) + mark_prepackable(target)
    with target:
        for p in passes:
            mod = p(mod)
    return mod


def load_model(source, name: str | None = None):
    """Whatever ``tvm_fusion.build`` accepts (ImportedModel, example name, .onnx path, ModelProto, IRModule)."""
    from .api import as_imported  # noqa: PLC0415

    return as_imported(source, name)


def tune_model(
    source,
    target="llvm",
    *,
    trials: int,
    policy=None,
    options: dict | None = None,
    log_root: str | os.PathLike = "tuning_logs",
    name: str | None = None,
    fuse: Callable[[tvm.IRModule, tvm.target.Target], tvm.IRModule] | None = None,
    measure: bool = False,
    **tune_kwargs,
) -> TuneResult:
    """Import (if needed), fuse with the build's own passes and tune a model; ``str(result)`` is
    a per-kernel summary. ``policy``/``options`` must be what the build will get (they shape the
    fused kernels). ``measure=True`` also times the tuned against the untuned build
    (``result.speedup``, see :func:`measure_speedup`). Other keywords go to :func:`tune`
    (``rpc``, ``max_trials_per_task``, ``num_trials_per_iter``, ``progress``, ...)."""
    target = parse_target(target)
    imported = load_model(source, name)
    mod = (
        fuse(imported.mod, target)
        if fuse is not None
        else fuse_for_build(imported.mod, target, policy, options)
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
    if measure:
        result.speedup = measure_speedup(
            imported, target, tuning_logs=log_root, policy=policy, options=options
        )
    return result

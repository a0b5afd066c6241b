"""The record store: one ``<root>/<model>/<target-key>/`` folder per model and target.

Why the care:

* Records are keyed by the *structural hash* of each fused PrimFunc (the workload), and a record
  set made for another model, target or TVM version is reported and ignored, never applied.
* Every file is replaced atomically (``files.write_text_atomic``) after each measured batch, so
  Ctrl-C or ``kill`` leaves the last finished batch on disk, never half a line. Files are written in
  the order workloads, records, manifest; the workload file only grows (indices are stable), so
  any mix of old and new files on disk is consistent.
* One writer at a time: a tuning run holds :class:`RecordLock` on the folder, and a second run
  into the same folder stops at once with a message naming the first (never two runs each
  rewriting the files from their own memory, which loses one run's trials).
* Folder names come from model names users type (``--name``, file stems): they are sanitised so
  a record set can never be written outside the records root.
* A tuned build must never be slower than the untuned one: the manifest keeps each task's default
  schedule timed side by side with its best record, and :func:`load_records` leaves out the
  records that did not win (:func:`slower_than_default`).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import errno
import fcntl
import hashlib
import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import tvm
import tvm_ffi
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule import _ffi_api as ms_api

from .. import __version__
from ..errors import TuningRecordError, last_line
from ..files import write_text_atomic
from ..targets import CUDA_DEFAULTS, target_json, target_key
from .defaults import default_fingerprint
from .environment import check_environment, load_tensor_intrinsics

WORKLOAD_FILE = "database_workload.json"
RECORD_FILE = "database_tuning_record.json"
MANIFEST_FILE = "manifest.json"
LOCK_SUFFIX = ".lock"
# 2: workloads are the layout-free-marked functions (format 1 records never match them any more)
MANIFEST_FORMAT = 2
FAILED_RUN_SECS = 1e9  # Meta-Schedule records failed builds/runs with run_secs = [1e10]
# A tuned schedule replaces the default one only if it is at least this much faster (side by side
# timings on a busy machine differ by a few percent between identical kernels).
MIN_GAIN = 0.03
MAX_NAME_LENGTH = 100


def beats_default(tuned_us: float | None, default_us: float | None) -> bool:
    """Whether a tuned kernel is faster than the default schedule by more than timing noise."""
    if tuned_us is None or default_us is None:
        return False
    return float(tuned_us) < float(default_us) * (1.0 - MIN_GAIN)


def workload_key(mod: tvm.IRModule) -> str:
    """The key of a workload in the manifest: its structural hash, as Meta-Schedule matches it."""
    return str(tvm_ffi.structural_hash(mod))


def safe_folder_name(name: str) -> str:
    """``name`` as one folder name that stays inside the records root: no separators, no ``.``/``..``
    or other leading dots, at most ``MAX_NAME_LENGTH`` characters (long names keep a hash suffix,
    so two long names never share a folder)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", str(name)).lstrip(".") or "model"
    if len(safe) > MAX_NAME_LENGTH:
        digest = hashlib.sha256(str(name).encode()).hexdigest()[:8]
        safe = f"{safe[: MAX_NAME_LENGTH - 9]}-{digest}"
    return safe


def record_dir(
    log_root: str | os.PathLike, model_name: str, target: tvm.target.Target, device_key: str | None = None
) -> Path:
    """``<log_root>/<model>/<target-key>``, or ``<target-key>@<device-key>`` for records measured on
    the RPC servers registered under ``device_key`` (a fleet with two kinds of device keeps two
    record sets); the model name made a safe folder name."""
    folder = target_key(target) + (f"@{safe_folder_name(device_key)}" if device_key else "")
    return Path(log_root) / safe_folder_name(model_name) / folder


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


def mean_secs(rec) -> float | None:
    """A record's mean run time, or None for a failed build/run."""
    return _mean_run_secs(rec.run_secs)


def _mean_run_secs(run_secs) -> float | None:
    """:func:`mean_secs` of run times as a record holds them or as its JSON stores them."""
    if run_secs is None or len(run_secs) == 0:
        return None
    secs = [float(s) for s in run_secs]
    mean = sum(secs) / len(secs)
    return None if mean >= FAILED_RUN_SECS else mean


def commit_records(db, records) -> None:
    """Copy records into a Meta-Schedule database, each under its own workload."""
    workloads: dict[str, Any] = {}
    for rec in records:
        key = workload_key(rec.workload.mod)
        if key not in workloads:
            workloads[key] = db.commit_workload(rec.workload.mod)
        db.commit_tuning_record(
            ms.database.TuningRecord(rec.trace, workloads[key], rec.run_secs, rec.target, rec.args_info)
        )


def is_search_record(rec) -> bool:
    """Whether a record came from the Meta-Schedule search rather than from a rule plan: the
    search marks where its postprocessors begin (``EnterPostproc``) in every trace it makes."""
    return any(inst.kind.name == "EnterPostproc" for inst in rec.trace.insts)


# -- one writer per folder -----------------------------------------------------------------------


class RecordLock:
    """An exclusive ``flock`` on ``<record dir>.lock`` for the duration of a tuning run.

    The lock file sits beside the folder (not in it, because an incompatible folder is moved
    aside while the lock is held). The kernel releases ``flock`` when the process dies, so a killed
    run never leaves a stale lock behind.
    """

    def __init__(self, path: Path):
        self.path = Path(str(path) + LOCK_SUFFIX)
        self._fd: int | None = None

    def __enter__(self) -> RecordLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            if err.errno in (errno.EAGAIN, errno.EACCES):
                raise TuningRecordError(
                    f"{self.path.with_suffix('')}: another tuning run ({holder}) is writing these records; "
                    "wait for it to finish (a second run would lose one run's trials), or tune into "
                    "another --tuning-logs folder"
                ) from None
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *_exc) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the flock; the file stays (removing it would race)
            self._fd = None


# -- the record set in memory ------------------------------------------------------------------


@dataclasses.dataclass
class RecordSet:
    """The records of one ``<model>/<target-key>`` folder, held in memory."""

    path: Path
    manifest: dict
    workloads: list = dataclasses.field(default_factory=list)  # ms Workload, file order
    records: list = dataclasses.field(default_factory=list)  # ms TuningRecord
    # trials per workload key when ``records`` holds only the fastest few (``best_only``)
    trial_counts: dict[str, int] | None = None

    def workload_index(self) -> dict[str, int]:
        return {workload_key(w.mod): i for i, w in enumerate(self.workloads)}

    def records_of(self, key: str) -> list:
        return [r for r in self.records if workload_key(r.workload.mod) == key]

    def trials_by_workload(self) -> dict[str, int]:
        if self.trial_counts is not None:
            return dict(self.trial_counts)
        counts: dict[str, int] = {}
        for rec in self.records:
            key = workload_key(rec.workload.mod)
            counts[key] = counts.get(key, 0) + 1
        return counts

    def best_by_workload(self) -> dict[str, float]:
        best: dict[str, float] = {}
        for rec in self.records:
            secs = mean_secs(rec)
            if secs is not None:
                key = workload_key(rec.workload.mod)
                best[key] = min(best.get(key, float("inf")), secs)
        return best

    def best_record(self, key: str):
        best = self.best_records(key, 1)
        return best[0] if best else None

    def best_records(self, key: str, count: int) -> list:
        """The ``count`` fastest records of a workload, one per distinct schedule (trace)."""
        timed = sorted(
            ((s, r) for r in self.records_of(key) if (s := mean_secs(r)) is not None), key=lambda x: x[0]
        )
        picked, seen = [], set()
        for _, rec in timed:
            if len(picked) == count:
                break
            if (tid := trace_id(rec)) not in seen:
                seen.add(tid)
                picked.append(rec)
        return picked

    def to_database(self, exclude: Iterable[str] = ()):
        """A fresh in-memory Meta-Schedule database holding these records (minus the workloads
        whose key is in ``exclude``)."""
        exclude = set(exclude)
        db = ms.database.MemoryDatabase()
        committed = {
            key: db.commit_workload(wl.mod)
            for wl in self.workloads
            if (key := workload_key(wl.mod)) not in exclude
        }
        trials = self.trials_by_workload()
        tasks = self.manifest.get("tasks", {})
        chosen = {
            key: verdict["trace"]
            for key in committed
            if (verdict := in_model_verdict(tasks.get(key, {}), trials.get(key, 0))) and verdict.get("trace")
        }
        for rec in self.records:
            key = workload_key(rec.workload.mod)
            wl = committed.get(key)
            if key in chosen and trace_id(rec) != chosen[key]:
                continue  # the record chosen in the model is the one applied, not the fastest alone
            if wl is not None:
                db.commit_tuning_record(
                    ms.database.TuningRecord(rec.trace, wl, rec.run_secs, rec.target, rec.args_info)
                )
        return db

    def save(self) -> None:
        """Atomically rewrite the three files (workloads, then records, then manifest)."""
        if self.trial_counts is not None:  # writing it would drop every record it did not read
            raise TuningRecordError(f"{self.path}: a record set read in part (best_only) is never saved")
        self.path.mkdir(parents=True, exist_ok=True)
        index = self.workload_index()
        wl_lines = [json.dumps(w.as_json(), separators=(",", ":")) for w in self.workloads]
        rec_lines = [
            json.dumps([index[workload_key(r.workload.mod)], _record_json(r)], separators=(",", ":"))
            for r in self.records
        ]
        self.manifest["num_workloads"] = len(wl_lines)
        self.manifest["num_records"] = len(rec_lines)
        self.manifest["updated"] = _now()
        write_text_atomic(self.path / WORKLOAD_FILE, "".join(line + "\n" for line in wl_lines))
        write_text_atomic(self.path / RECORD_FILE, "".join(line + "\n" for line in rec_lines))
        write_text_atomic(self.path / MANIFEST_FILE, json.dumps(self.manifest, indent=2) + "\n")


def trace_id(rec) -> str:
    """A short stable name for a record's schedule (its trace, decisions included)."""
    return _trace_json_id(_plain_json(rec.trace.as_json()))


def _trace_json_id(trace_json) -> str:
    """:func:`trace_id` of a trace as stored in the record file (no replay needed)."""
    return hashlib.sha256(json.dumps(trace_json, separators=(",", ":")).encode()).hexdigest()[:16]


def in_model_verdict(entry: dict, trials: int) -> dict | None:
    """A task's in-model verdict (``in_model.py``) while it still speaks for its records: made
    at the task's current trial count (a resumed search may have found better ones since)."""
    verdict = entry.get("in_model")
    if isinstance(verdict, dict) and verdict.get("trials") == trials:
        return verdict
    return None


def _record_json(rec) -> list:
    """``TuningRecord.as_json()`` that also works for traces with ``transform_layout`` (weight
    packing): the record's own JSON leaves the IndexMap an object that Meta-Schedule's Python
    converter rejects, while ``trace.as_json()`` gives it as the string ``from_json`` reads back."""
    _trace, *rest = ms_api.TuningRecordAsJSON(rec)
    return [_plain_json(rec.trace.as_json())] + [_plain_json(part) for part in rest]


def _plain_json(obj):
    """TVM containers and scalars (and Python lists of them) as plain JSON values."""
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


def new_manifest(
    model_name: str, model_hash: str, target: tvm.target.Target, device_key: str | None = None
) -> dict:
    return {
        "format": MANIFEST_FORMAT,
        "model_name": model_name,
        "model_hash": model_hash,
        "target_key": target_key(target),
        "target": target_json(target),
        "device_key": device_key,
        "tvm_version": tvm.__version__,
        "tvm_fusion_version": __version__,
        "created": _now(),
        "updated": _now(),
        "tasks": {},
        "num_workloads": 0,
        "num_records": 0,
    }


# -- reading and checking ----------------------------------------------------------------------

# Manifest fields a reader relies on, with the JSON type each must have (None: may be absent).
_MANIFEST_FIELDS = {
    "model_hash": (str, "a string"),
    "target": (dict, "an object"),
    "format": (int, "an integer"),
    "tasks": (dict, "an object"),
    "num_workloads": (int, "an integer"),
    "num_records": (int, "an integer"),
}
_REQUIRED = ("model_hash", "target")


def set_task_fields(path: Path, fields: dict[str, dict]) -> None:
    """Merge ``{workload key: {field: value}}`` into the manifest's task entries, atomically,
    leaving the record files as they are (the caller holds the folder's :class:`RecordLock`)."""
    mpath = Path(path) / MANIFEST_FILE
    manifest = _check_manifest(json.loads(mpath.read_text(encoding="utf-8")), mpath)
    for key, entry in fields.items():
        manifest["tasks"].setdefault(key, {}).update(entry)
    manifest["updated"] = _now()
    write_text_atomic(mpath, json.dumps(manifest, indent=2) + "\n")


def _check_manifest(manifest: Any, mpath: Path) -> dict:
    if not isinstance(manifest, dict):
        raise TuningRecordError(
            f"{mpath}: not a tvm_fusion tuning manifest (a JSON {type(manifest).__name__})"
        )
    for key, (kind, expected) in _MANIFEST_FIELDS.items():
        if key not in manifest:
            if key in _REQUIRED:
                raise TuningRecordError(f"{mpath}: not a tvm_fusion tuning manifest (no {key!r} field)")
            continue
        value = manifest[key]
        if not isinstance(value, kind) or isinstance(value, bool):
            raise TuningRecordError(
                f"{mpath}: field {key!r} is {json.dumps(value)[:60]}, expected {expected}"
            )
    for key, entry in manifest.get("tasks", {}).items():
        if not isinstance(entry, dict):
            raise TuningRecordError(
                f"{mpath}: task {key!r} is {json.dumps(entry)[:60]}, expected a JSON object"
            )
    return manifest


def read_record_set(path: str | os.PathLike, best_only: int = 0) -> RecordSet:
    """Parse a record folder; raises :class:`TuningRecordError` naming the file that is bad.

    Reading a record replays its trace on the workload (~20 ms each: 27 s for ResNet-18's 1,237
    records, more than the build itself). ``best_only=N`` reads only each workload's N fastest
    schedules and the one its in-model verdict chose, and counts the rest: what a build (N=1) or
    the in-model check (N=3) needs. Such a record set is never saved."""
    path = Path(path)
    mpath = path / MANIFEST_FILE
    if not mpath.exists():
        raise TuningRecordError(f"{mpath}: missing, cannot tell which model/target/TVM the records are for")
    try:
        manifest = json.loads(mpath.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise TuningRecordError(f"{mpath}: corrupt or truncated manifest ({err})") from None
    except OSError as err:
        raise TuningRecordError(f"{mpath}: cannot read ({err.strerror})") from None
    rset = RecordSet(path=path, manifest=_check_manifest(manifest, mpath))
    wpath, rpath = path / WORKLOAD_FILE, path / RECORD_FILE
    for file, what in ((wpath, "workloads"), (rpath, "records")):
        listed = manifest.get(f"num_{what}", 0)
        if listed and not file.exists():
            raise TuningRecordError(f"{file}: missing, the manifest lists {listed} {what}")
    for lineno, obj in _json_lines(wpath):
        try:
            rset.workloads.append(ms.database.Workload.from_json(obj))
        except Exception as err:
            raise TuningRecordError(
                f"{wpath}: line {lineno}: not a Meta-Schedule workload ({last_line(err, 300)})"
            ) from None
    keep = _FastestRecords(rset, best_only) if best_only else None
    parsed = 0
    for lineno, obj in _json_lines(rpath):
        try:
            index, body = obj
            workload = rset.workloads[int(index)]
            if keep is None:
                rset.records.append(ms.database.TuningRecord.from_json(body, workload))
            else:
                keep.see(lineno, int(index), body)
        except Exception as err:
            raise TuningRecordError(
                f"{rpath}: line {lineno}: not a valid tuning record ({last_line(err, 300)})"
            ) from None
        parsed += 1
    if keep is not None:
        keep.read_into(rset, rpath)
    for what, got, file in (("workloads", len(rset.workloads), wpath), ("records", parsed, rpath)):
        want = manifest.get(f"num_{what}", 0)
        if got < want:  # more is fine: a run stopped between writing records and the manifest
            raise TuningRecordError(f"{file}: truncated: {got} {what}, the manifest lists {want}")
    return rset


class _FastestRecords:
    """While the record file is read: per workload, its trial count, its ``count`` fastest
    schedules and the one its in-model verdict chose (kept as JSON until the end)."""

    def __init__(self, rset: RecordSet, count: int):
        self.keys = [workload_key(w.mod) for w in rset.workloads]
        self.count = count
        self.chosen = {
            key: verdict["trace"]
            for key, entry in rset.manifest.get("tasks", {}).items()
            if isinstance(entry, dict)
            and isinstance(verdict := entry.get("in_model"), dict)
            and verdict.get("trace")
        }
        self.counts: dict[str, int] = {}
        self.fastest: dict[str, list] = {}  # key -> [(secs, trace id, lineno, index, body)], sorted
        self.picked: dict[str, tuple[int, int, Any]] = {}  # key -> (lineno, index, body)

    def see(self, lineno: int, index: int, body) -> None:
        key = self.keys[index]
        self.counts[key] = self.counts.get(key, 0) + 1
        tid = None
        mean = _mean_run_secs(body[1])
        fastest = self.fastest.setdefault(key, [])
        if mean is not None and (len(fastest) < self.count or mean < fastest[-1][0]):
            tid = _trace_json_id(body[0])
            same = [f for f in fastest if f[1] == tid]
            if not same or mean < same[0][0]:  # one entry per schedule: its fastest measurement
                fastest[:] = sorted(
                    [f for f in fastest if f[1] != tid] + [(mean, tid, lineno, index, body)],
                    key=lambda f: f[0],
                )[: self.count]
        if key in self.chosen and (tid or _trace_json_id(body[0])) == self.chosen[key]:
            self.picked[key] = (lineno, index, body)

    def read_into(self, rset: RecordSet, rpath: Path) -> None:
        wanted = {(line, index): body for kept in self.fastest.values() for _, _, line, index, body in kept}
        wanted.update({(line, index): body for line, index, body in self.picked.values()})
        for (lineno, index), body in sorted(wanted.items()):
            try:
                rset.records.append(ms.database.TuningRecord.from_json(body, rset.workloads[index]))
            except Exception as err:
                raise TuningRecordError(
                    f"{rpath}: line {lineno}: not a valid tuning record ({last_line(err, 300)})"
                ) from None
        rset.trial_counts = self.counts


def _json_lines(path: Path) -> Iterable[tuple[int, Any]]:
    if not path.exists():
        return
    if path.is_dir():
        raise TuningRecordError(f"{path}: is a folder, expected a file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise TuningRecordError(f"{path}: not a text file ({err})") from None
    except OSError as err:
        raise TuningRecordError(f"{path}: cannot read ({err.strerror})") from None
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield lineno, json.loads(line)
        except json.JSONDecodeError as err:
            raise TuningRecordError(f"{path}: line {lineno}: corrupt or truncated JSON ({err.msg})") from None


def check_compatible(
    manifest: dict, model_hash: str, target: tvm.target.Target, device_key: str | None = None
) -> list[str]:
    """Reasons this record set must not be used for (model_hash, target, device key, this TVM);
    [] if none."""
    problems = []
    if manifest.get("format") != MANIFEST_FORMAT:
        problems.append(
            f"record format {manifest.get('format')}, this tvm_fusion reads format {MANIFEST_FORMAT} "
            "(its workloads are not the functions the build schedules)"
        )
    if manifest.get("model_hash") != model_hash:
        problems.append(f"made for model hash {manifest.get('model_hash')}, this model is {model_hash}")
    want = _without_implied(target_json(target))
    if _without_implied(manifest.get("target") or {}) != want:
        have = _without_implied(manifest.get("target") or {})
        diff = sorted(k for k in set(have) | set(want) if have.get(k) != want.get(k))
        problems.append(f"made for target {json.dumps(have, sort_keys=True)} (differs in {', '.join(diff)})")
    if manifest.get("tvm_version") != tvm.__version__:
        problems.append(f"made with TVM {manifest.get('tvm_version')}, this is TVM {tvm.__version__}")
    if manifest.get("device_key") != device_key:
        problems.append(f"measured on device key {manifest.get('device_key')}, not {device_key}")
    return problems


def _without_implied(spec: dict) -> dict:
    """A target's JSON without the attributes every target of its kind gets implied (CUDA's
    ``max_shared_memory_per_block``, added to CUDA targets after records were made without it)."""
    return {k: v for k, v in spec.items() if CUDA_DEFAULTS.get(k, object()) != v}


def has_records(path: Path) -> bool:
    """Whether ``path`` holds (part of) a record set, complete or not."""
    return any((path / name).exists() for name in (MANIFEST_FILE, RECORD_FILE, WORKLOAD_FILE))


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
    conv_algorithms: dict = dataclasses.field(default_factory=dict)  # conv signature -> algorithm

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def __str__(self) -> str:
        return "\n".join(self.messages)


def load_records(
    log_root: str | os.PathLike,
    model_name: str,
    model_hash: str,
    target: tvm.target.Target,
    *,
    device_key: str | None = None,
    strict: bool = False,
    only_faster: bool = True,
):
    """Find the records for (model, target, this TVM): returns ``(database or None, RecordReport)``.

    ``device_key`` picks the records measured on a fleet's servers under that key; without it the
    locally measured records are used, or the one fleet record set for this target if there is
    exactly one (with several, the report lists them and asks for a key).

    Records for another model hash, target or TVM version, and corrupt, truncated or unreadable
    files, are reported and ignored (the build then uses default schedules); ``strict=True`` raises
    :class:`TuningRecordError` for those instead. With ``only_faster`` (default) functions whose
    tuned schedule was not faster than the default schedule are left out of the database (see
    :func:`slower_than_default`), so a tuned build is never slower than the untuned one; the
    database is ``None`` when nothing is left.
    """
    path = record_dir(log_root, model_name, target, device_key)
    if Path(log_root).exists() and not Path(log_root).is_dir():
        report = RecordReport(
            path, "corrupt", [f"{log_root}: is a file, not a tuning-records folder: ignored"]
        )
        if strict:
            raise TuningRecordError(str(report))
        return None, report
    fleet_sets = _fleet_record_sets(path) if device_key is None and not has_records(path) else []
    if len(fleet_sets) == 1:
        path, device_key = fleet_sets[0], fleet_sets[0].name.split("@", 1)[1]
    if not has_records(path):
        parent = path.parent
        others = (
            sorted(p.name for p in parent.glob("*") if (p / MANIFEST_FILE).exists())
            if parent.is_dir()
            else []
        )
        msg = f"{path}: no tuning records: using default schedules"
        if fleet_sets:
            msg += f" (records from several fleets: {', '.join(p.name for p in fleet_sets)}; pick one with --device-key)"
        elif others:
            msg += f" (records exist for other targets: {', '.join(others)})"
        return None, RecordReport(path, "missing", [msg])
    try:
        check_environment(need_workers=False)
        rset = read_record_set(path, best_only=1)
    except TuningRecordError as err:
        if strict:
            raise
        return None, RecordReport(path, "corrupt", [f"{err}: ignored, using default schedules"])
    problems = check_compatible(rset.manifest, model_hash, target, device_key)
    if problems:
        msg = f"{path}: {'; '.join(problems)}: ignored"
        if strict:
            raise TuningRecordError(msg)
        return None, RecordReport(path, "mismatch", [msg])
    num_records = sum(rset.trials_by_workload().values())
    messages = [f"{path}: {num_records} tuning records for {len(rset.workloads)} functions"]
    skipped, unchecked = slower_than_default(rset, target) if only_faster else ({}, [])
    if skipped:
        messages.append(
            f"{len(skipped)} of {len(rset.workloads)} tuned functions not faster than the default schedule "
            f"by more than {MIN_GAIN:.0%} (timing noise): not applied ({'; '.join(skipped.values())})"
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
        num_records=num_records,
        num_workloads=len(rset.workloads),
        num_applied=applied,
        skipped=sorted(skipped.values()),
        conv_algorithms=dict(rset.manifest.get("conv_algorithms") or {}),
    )
    if applied == 0:
        return None, report
    if any(inst.kind.name == "Tensorize" for rec in rset.records for inst in rec.trace.insts):
        load_tensor_intrinsics()
    return rset.to_database(exclude=skipped), report


def _fleet_record_sets(local: Path) -> list[Path]:
    """Record folders ``<target-key>@<device-key>`` beside the local one."""
    if not local.parent.is_dir():
        return []
    return sorted(p for p in local.parent.glob(f"{local.name}@*") if (p / MANIFEST_FILE).exists())


def slower_than_default(
    rset: RecordSet, target: tvm.target.Target | None = None
) -> tuple[dict[str, str], list[str]]:
    """Which workloads must keep the default schedule: ``({key: reason}, [unchecked names])``.

    A tuned schedule is applied only if it measured faster (by more than ``MIN_GAIN``) than the
    default schedule of the same function, both timed side by side by the same runner at the end
    of tuning (``tuned_us`` and ``default_us`` in the manifest). If trials were added after that
    check (an interrupted run), the best record's own latency stands in for ``tuned_us``.
    Workloads whose every trial failed are never applied (Meta-Schedule would apply a failed one).
    With ``target``, a workload whose default schedule is no longer the one timed (its
    ``default_hash``: this tvm_fusion's rules schedule it differently) is not applied either: the
    comparison is stale, and the new default may be the faster one. Tuning again re-times it.
    """
    best = rset.best_by_workload()
    trials = rset.trials_by_workload()
    tasks = rset.manifest.get("tasks", {})
    skipped: dict[str, str] = {}
    unchecked: list[str] = []
    for wl in rset.workloads:
        key = workload_key(wl.mod)
        entry = tasks.get(key, {})
        name = entry.get("name", key)
        if key not in best:
            if trials.get(key, 0):
                skipped[key] = f"{name}: every trial failed"
            continue  # no records at all: nothing to apply
        verdict = in_model_verdict(entry, trials.get(key, 0))
        if verdict is not None:  # timed inside the model: that decides
            if not verdict.get("trace"):
                skipped[key] = (
                    f"{name}: in the model, tuned {float(verdict['tuned_us']):.2f} us vs default "
                    f"{float(verdict['default_us']):.2f} us"
                )
                continue
        else:
            default_us = entry.get("default_us")
            if default_us is None:
                unchecked.append(name)
                continue
            tuned_us = entry.get("tuned_us")
            if tuned_us is None or entry.get("verified_trials") != trials.get(key, 0):
                tuned_us = best[key] * 1e6
            if not beats_default(tuned_us, default_us):
                skipped[key] = f"{name}: tuned {float(tuned_us):.2f} us vs default {float(default_us):.2f} us"
                continue
        # last: fingerprinting schedules the default, so only records that would be applied pay it
        stored = entry.get("default_hash")
        if (
            target is not None
            and stored is not None
            and stored != default_fingerprint(wl.mod["main"], target)
        ):
            skipped[key] = (
                f"{name}: timed against an older default schedule (this tvm_fusion schedules it "
                "differently; tune again to re-time it)"
            )
    return skipped, unchecked

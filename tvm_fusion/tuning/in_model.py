"""Each kernel's record chosen by its time inside the model, not alone.

The search times every candidate alone, over and over on the same inputs: hot in cache, nothing
running before it. Inside a model a kernel reads what a producer on other cores has just
written, and the plan that wins alone loses there on about a third of the kernels
(docs/performance.md, "Plans timed the way the model runs them": SqueezeNet 1.17x and
MobileNet-V2 1.12x from per-kernel plans chosen in the model). So after the search, the few
best records of every task are built into the whole model and timed there, kernel by kernel
(the VM's instrumentation), interleaved with the default build; each task keeps the record that
is fastest in the model, and only if it beats the default there by more than ``MIN_GAIN``.

The verdict goes into the manifest (``in_model`` per task: both times, the chosen trace, the
trial count it was made at); :func:`..records.slower_than_default` and
:meth:`..records.RecordSet.to_database` follow it while the task has no newer trials.
"""

from __future__ import annotations

import tvm
import tvm_ffi

from .. import models
from ..profiling import kernel_times
from ..targets import device_for
from .records import (
    MIN_GAIN,
    RecordLock,
    commit_records,
    read_record_set,
    set_task_fields,
    trace_id,
    workload_key,
)
from .tasks import extract_tasks

CANDIDATES = 3  # the best records (timed alone) of each task that are tried in the model
ROUNDS = 5  # timing rounds, the builds interleaved; a kernel's time is its fastest round
REPEAT = 10  # inferences per round


def _database(picks: dict):
    from tvm.s_tir import meta_schedule as ms

    db = ms.database.MemoryDatabase()
    commit_records(db, picks.values())
    return db


def kernel_workloads(unscheduled: tvm.IRModule, tasks: list) -> dict[str, str]:
    """Kernel (function) name -> workload key of its task; identical kernels share one task."""
    by_hash = {tvm_ffi.structural_hash(t.dispatched[0]["main"]): workload_key(t.dispatched[0]) for t in tasks}
    names = {}
    for gv, func in unscheduled.functions_items():
        if isinstance(func, tvm.tirx.PrimFunc):
            key = by_hash.get(tvm_ffi.structural_hash(func.with_attr("global_symbol", "main")))
            if key is not None:
                names[gv.name_hint] = key
    return names


def _workload_times(vm, args, device, kernels: dict[str, str]) -> dict[str, float]:
    """µs per inference spent in each workload's kernels (all their call sites)."""
    times: dict[str, float] = {}
    for name, ms, _launches in kernel_times(vm, args, repeat=REPEAT, device=device):
        key = kernels.get(name.removesuffix("_prepacked"))
        if key is not None:
            times[key] = times.get(key, 0.0) + ms * 1e3
    return times


def check_in_model(imported, target, record_dir, *, policy=None, options=None, say=None) -> dict:
    """Build the default and ``CANDIDATES`` tuned variants of the model, time every tuned
    workload's kernels in each (interleaved, fastest of ``ROUNDS``), and write each task's
    verdict into the manifest. Returns ``{workload key: in_model entry}``."""
    from ..api import build
    from ..pipeline import unscheduled_module

    if imported.onnx_model is None:
        return {}  # a Relax module without an ONNX model: no inputs to time it with
    options = dict(options or {})
    with RecordLock(record_dir):
        rset = read_record_set(record_dir, best_only=CANDIDATES)  # the candidates, the rest counted
    trials = rset.trials_by_workload()
    if rset.manifest.get("conv_algorithms") and "conv_algorithms" not in options:
        options["conv_algorithms"] = rset.manifest["conv_algorithms"]  # as the final build will
    unscheduled = unscheduled_module(imported.mod, target, policy, name=imported.name, **options)
    # the tasks of the module the build will run (the conv algorithms tuning chose included)
    kernels = kernel_workloads(unscheduled, extract_tasks(unscheduled, target))
    candidates = {k: c for k in set(kernels.values()) if (c := rset.best_records(k, CANDIDATES))}
    if not candidates:
        return {}
    depth = max(len(c) for c in candidates.values())
    picks = [{}] + [{k: c[j] for k, c in candidates.items() if j < len(c)} for j in range(depth)]
    device = device_for(target)
    args = [tvm.runtime.tensor(v, device) for v in models.random_inputs(imported.onnx_model).values()]
    vms = []
    for i, pick in enumerate(picks):
        if say is not None:
            say(
                f"in-model check: building variant {i + 1}/{len(picks)} ({'default' if not pick else f'records #{i}'})"
            )
        result = build(
            imported, target, policy, tuning_logs=None, database=_database(pick) if pick else None, **options
        )
        vms.append(tvm.relax.VirtualMachine(result.executable, device))
    best: list[dict[str, float]] = [{} for _ in vms]
    for _ in range(ROUNDS):
        for i, vm in enumerate(vms):
            for key, us in _workload_times(vm, args, device, kernels).items():
                best[i][key] = min(best[i].get(key, float("inf")), us)
    verdicts = {}
    for key, recs in candidates.items():
        default_us = best[0].get(key)
        tried = [
            (best[j + 1].get(key), rec) for j, rec in enumerate(recs) if best[j + 1].get(key) is not None
        ]
        if default_us is None or not tried:
            continue
        tuned_us, rec = min(tried, key=lambda x: x[0])
        wins = tuned_us < default_us * (1.0 - MIN_GAIN)
        verdicts[key] = {
            "default_us": round(default_us, 3),
            "tuned_us": round(tuned_us, 3),
            "trace": trace_id(rec) if wins else None,
            "trials": trials.get(key, 0),
        }
    with RecordLock(record_dir):
        set_task_fields(record_dir, {key: {"in_model": verdict} for key, verdict in verdicts.items()})
    return verdicts

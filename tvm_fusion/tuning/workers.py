"""Where candidates are built and timed: a persistent local builder, a local or RPC runner.

Meta-Schedule's ``LocalBuilder`` starts fresh worker processes for every batch (each importing
TVM, seconds on a busy machine) and its default build function imports ``tvm.s_tir.tensor_intrin``
in every worker (over a minute in this wheel, see ``environment``); our builder keeps its workers
for the whole run and builds without that import (the schedule is already applied when a worker
builds it, so the intrinsics are not needed there).
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import tvm
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.builder import local_builder
from tvm.support.popen_pool import PopenPoolExecutor, StatusKind

from ..errors import TargetError
from ..pipeline import tir_pipeline
from ..targets import CUDA_DEFAULTS, is_gpu, target_json
from .fleet import FleetRunner, Tracker, check_fleet
from .packed_weights import candidate_args, kernel_as_built

# What Meta-Schedule's GPU rules read from the target; the short "cuda" target lacks them.
_CUDA_TUNING_DEFAULTS = {
    **CUDA_DEFAULTS,
    "max_threads_per_block": 1024,
    "registers_per_block": 65536,
    "thread_warp_size": 32,
}


def _worker_build(mod: tvm.IRModule, target: tvm.target.Target, _params=None):
    """Meta-Schedule's default_build minus its tensor_intrin import (the schedule is applied
    already), with weight packing split off and the TIR pipeline as the build has them
    (``packed_weights``; on CPUs per-task scratch on the stack, ``StackAllocateLoopBuffers``)."""
    return tvm.tirx.build(kernel_as_built(mod), target=target, pipeline=tir_pipeline(target))


@derived_object
class PersistentLocalBuilder(ms.builder.PyBuilder):
    """A local builder whose worker processes live for the whole tuning run."""

    def __init__(self, max_workers: int = 1, timeout_s: float = 60.0):
        super().__init__()
        self.timeout_s = timeout_s
        self.pool = PopenPoolExecutor(max_workers=max_workers, timeout=timeout_s)

    def build(self, build_inputs):
        jobs = [
            (_worker_build, None, b.mod, b.target, local_builder._serialize_params(b.params))
            for b in build_inputs
        ]
        results = []
        for res in self.pool.map_with_error_catching(lambda job: local_builder._worker_func(*job), jobs):
            if res.status == StatusKind.COMPLETE:
                results.append(ms.builder.BuilderResult(res.value, None))
            elif res.status == StatusKind.TIMEOUT:
                results.append(ms.builder.BuilderResult(None, f"build timed out after {self.timeout_s} s"))
            else:
                results.append(ms.builder.BuilderResult(None, f"build failed:\n{res.value}"))
        return results


def make_runner(tracker: Tracker | None, num_servers: int, evaluator_config, timeout_s: float):
    """A runner on this machine, or on every server under the tracker's key."""
    if tracker is not None:
        return FleetRunner(tracker, evaluator_config, num_servers, timeout_s)
    return ms.runner.LocalRunner(timeout_sec=timeout_s, evaluator_config=evaluator_config)


def check_can_tune(target: tvm.target.Target, tracker: Tracker | None = None) -> int:
    """Fail before any work when there is nothing to measure on: GPU tuning needs a local GPU or
    a fleet, and a fleet needs a tracker with servers under the key. Returns the number of servers
    (0 for local measuring)."""
    if tracker is not None:
        return check_fleet(tracker)
    if is_gpu(target):
        kind = target.kind.name
        if not tvm.device(kind, 0).exist:
            raise TargetError(
                f"tuning for {kind} measures every candidate on a GPU, and this machine has no {kind} "
                "device: run it on a machine with one, or pass rpc='host:port:key' for a TVM RPC "
                "tracker (building with existing records does not need a GPU)"
            )
    return 0


def tuning_target(target: tvm.target.Target) -> tvm.target.Target:
    """``target`` plus the attributes Meta-Schedule's CUDA schedule rules need (when missing).

    Records and manifests still name the user's target: these attributes change the search, not
    the PrimFuncs the records are keyed by.
    """
    if target.kind.name != "cuda":
        return target
    spec = target_json(target)
    missing = {k: v for k, v in _CUDA_TUNING_DEFAULTS.items() if k not in spec}
    if not missing:
        return target
    host = spec.pop("host", None)
    spec.update(missing)
    return tvm.target.Target(spec, host=tvm.target.Target(host) if host else target.host)


def measure_modules(builder, runner, target, items: list[tuple[Any, tvm.IRModule]], rounds: int = 3) -> dict:
    """Build each ``(key, scheduled module)`` once and time it ``rounds`` times, all keys in turn
    (side by side), with the tuning builder/runner: ``{key: fastest round's seconds or None}``.

    The fastest round, not the median: on a shared machine other tenants only ever add time, and
    a median of few rounds still swung 2x between identical kernels here."""
    args = [candidate_args(m) for _, m in items]
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

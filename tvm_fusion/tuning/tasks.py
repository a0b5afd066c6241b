"""What there is to tune: one task per fused kernel, its trial budget, its default schedule.

Tasks are extracted from the module the build schedules (``pipeline.unscheduled_module``: our
passes, then constant weights marked layout-free), so a record's workload is exactly the PrimFunc
the build later looks up, and tuned schedules may pre-pack weights as the default ones do.
"""

from __future__ import annotations

import tvm
from tvm.s_tir import meta_schedule as ms

from .defaults import default_schedule
from .records import workload_key


def extract_tasks(mod: tvm.IRModule, target: tvm.target.Target) -> list:
    """Meta-Schedule tasks of a fused module: one per distinct PrimFunc not scheduled yet."""
    tasks = ms.relax_integration.extract_tasks(mod, target)
    return [t for t in tasks if not _is_scheduled(t.dispatched[0]["main"])]


def _is_scheduled(func) -> bool:
    """Kernels that come scheduled (the fused attention kernel): nothing to tune."""
    return func.attrs is not None and bool(func.attrs.get("tirx.is_scheduled", False))


def split_budget(trials: int, num_tasks: int, max_trials_per_task: int | None) -> list[int]:
    """Equal shares of the total (first tasks get the remainder), capped per task."""
    if num_tasks == 0:
        return []
    base, extra = divmod(max(int(trials), 0), num_tasks)
    shares = [base + (1 if i < extra else 0) for i in range(num_tasks)]
    if max_trials_per_task is not None:
        shares = [min(s, int(max_trials_per_task)) for s in shares]
    return shares


def default_schedule_modules(tasks: list, target: tvm.target.Target) -> dict[str, tvm.IRModule]:
    """Per task (workload key): its PrimFunc under the default schedule, as the build runs it.

    Task functions carry the build's layout-free marks, so the Contraction rule packs constant
    weights in a block annotated as layout-rewrite preproc, and the builder drops that block
    (``RemoveWeightLayoutRewriteBlock``, as it does for tuned candidates): the timed kernel reads
    pre-packed weights like the built one does.
    """
    return {workload_key(t.dispatched[0]): default_schedule(t.dispatched[0]["main"], target) for t in tasks}

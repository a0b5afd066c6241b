"""Meta-Schedule tuning of fused kernels, with records that are stored safely and reused by the build.

One job per module, as in Meta-Schedule itself:

* ``environment`` — what tuning needs from this Python environment; a slow TVM import made fast.
* ``records`` — the record store ``<root>/<model>/<target-key>/`` (Meta-Schedule JSON database +
  manifest): atomic writes, one writer at a time, checks before reuse, ``load_records`` for the build.
* ``tasks`` — one task per fused kernel, budgets, each task's default schedule.
* ``rule_space`` — the search over our own rule's decisions (where our rule schedules the kernel).
* ``workers`` — the persistent local builder, the runner, side-by-side timing.
* ``fleet`` — measuring on the servers under a TVM RPC tracker key (checked before work starts).
* ``search`` — the search for one task (rule space, else Meta-Schedule's own), saved batch by
  batch; Ctrl-C and SIGTERM handling.
* ``verify`` — each task's best record timed next to its default schedule.
* ``driver`` — ``tune`` (a fused module) and ``tune_model`` (an ONNX model, example or IRModule).

The build applies records with ``relax.transform.MetaScheduleApplyDatabase`` in its own pipeline
(``pipeline.pipeline_stages(..., database=...)``); there is no second build path here.
See ``tuning_logs/README.md`` for the files.
"""

from .driver import TuneResult, open_for_tuning, plan_tasks, tune, tune_model
from .environment import check_environment, load_tensor_intrinsics
from .fleet import FleetRunner, Tracker, check_fleet, fleet_report, parse_rpc
from .records import (
    MANIFEST_FILE,
    MANIFEST_FORMAT,
    MIN_GAIN,
    RECORD_FILE,
    WORKLOAD_FILE,
    RecordLock,
    RecordReport,
    RecordSet,
    beats_default,
    check_compatible,
    load_records,
    new_manifest,
    read_record_set,
    record_dir,
    safe_folder_name,
    slower_than_default,
    trace_id,
    workload_key,
)
from .rule_space import RuleSpace, RuleSpaceSearch, rule_space
from .search import TaskSummary
from .tasks import default_schedule_modules, extract_tasks, split_budget
from .workers import check_can_tune, tuning_target

__all__ = [
    "MANIFEST_FILE",
    "MANIFEST_FORMAT",
    "MIN_GAIN",
    "RECORD_FILE",
    "FleetRunner",
    "Tracker",
    "check_fleet",
    "fleet_report",
    "WORKLOAD_FILE",
    "RecordLock",
    "RecordReport",
    "RecordSet",
    "RuleSpace",
    "RuleSpaceSearch",
    "TaskSummary",
    "TuneResult",
    "beats_default",
    "check_can_tune",
    "check_compatible",
    "check_environment",
    "default_schedule_modules",
    "extract_tasks",
    "load_records",
    "load_tensor_intrinsics",
    "new_manifest",
    "open_for_tuning",
    "parse_rpc",
    "plan_tasks",
    "read_record_set",
    "record_dir",
    "rule_space",
    "safe_folder_name",
    "slower_than_default",
    "trace_id",
    "split_budget",
    "tune",
    "tune_model",
    "tuning_target",
    "workload_key",
]

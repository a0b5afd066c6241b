"""A kernel's default schedule (what the untuned build runs) and its fingerprint.

A tuned record is applied only where it measured faster than the default schedule, timed side by
side at tuning time. A newer tvm_fusion may change the default (a better cost model, a new rule):
the stored comparison is then stale and the old record may be slower than the new default. The
fingerprint, stored with the timing, tells the build when that happened.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm.s_tir import dlight as dl

from ..schedules import default_rules


def default_schedule(func: tvm.tirx.PrimFunc, target: tvm.target.Target) -> tvm.IRModule:
    """``func`` (a task's workload, layout-free marks included) under the default rules."""
    with target:
        return dl.ApplyDefaultSchedule(*default_rules(target))(tvm.IRModule({"main": func}))


def schedule_fingerprint(scheduled: tvm.IRModule) -> str:
    """Structural hash of a scheduled ``main``: equal iff the same kernel."""
    return str(tvm_ffi.structural_hash(scheduled["main"]))


def default_fingerprint(func: tvm.tirx.PrimFunc, target: tvm.target.Target) -> str:
    """Fingerprint of ``func``'s default schedule: equal iff the untuned build runs the same kernel."""
    return schedule_fingerprint(default_schedule(func, target))

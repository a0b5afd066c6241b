"""Tuning's choice of conv algorithm: direct, Winograd F(2×2,3×3) or F(4×4,3×3), per conv shape.

The algorithm is fixed when a conv is legalized (``legalize/winograd_conv.py``), before any
schedule exists, so it cannot be a knob of one kernel's schedule space: each algorithm gives a
different PrimFunc (a different workload). Tuning therefore fuses the model once per algorithm
(:func:`alternative_modules`), tunes every kernel that differs as a task of its own, and then picks
per conv signature the algorithm whose kernels ran fastest (:func:`choose_algorithms`: the time the
build will get, tuned or default schedule, summed over the kernels with that conv). The choice is
kept in the record set's manifest (``conv_algorithms``) and the build legalizes with it, so the
kernels it then looks up are the very workloads tuned.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import tirx

from ..legalize.winograd_conv import ALGORITHMS, DIRECT, SIGNATURE, TILE
from ..pipeline import unscheduled_module


def algorithm_of(func: tirx.PrimFunc) -> tuple[str, str | None]:
    """``(algorithm, conv signature)`` of a kernel: ``("winograd<m>", sig)`` for a Winograd kernel
    (its block annotations say so), else ``("direct", None)``."""
    sch = tvm.s_tir.Schedule(func)
    found: list[tuple[str, str | None]] = []
    for blk in sch.get_child_blocks(sch.get_sblock("root")):
        ann = sch.get(blk).annotations
        if TILE in ann:
            sig = ann.get(SIGNATURE)
            found.append((f"winograd{int(ann[TILE])}", None if sig is None else str(sig)))
    with_sig = [f for f in found if f[1]]
    return (with_sig or found or [(DIRECT, None)])[0]


def alternative_modules(mod: tvm.IRModule, target, policy=None, name: str = "model", **options) -> list:
    """The model fused with each algorithm forced for every eligible conv (empty when the model
    has none: then every algorithm gives the same kernels)."""
    options = {k: v for k, v in options.items() if k != "conv_algorithms"}
    modules = [
        unscheduled_module(mod, target, policy, name=name, conv_algorithms=alg, **options)
        for alg in ALGORITHMS
    ]
    keys = [{_func_key(f) for f in _prim_funcs(m)} for m in modules]
    return modules if any(k != keys[0] for k in keys[1:]) else []


def choose_algorithms(tasks: list, summaries: list) -> dict[str, str]:
    """``{conv signature: algorithm}`` from measured tasks: a task's time is what the build will
    run (tuned if that won, else the default schedule); kernels are matched across algorithms by
    their fused function's name, and an algorithm is chosen for a signature only when every kernel
    with that conv was measured in it."""
    by_name: dict[str, dict[str, float]] = {}
    signature_of: dict[str, str] = {}
    for task, summary in zip(tasks, summaries):
        us = _effective_us(summary)
        if us is None:
            continue
        algorithm, signature = algorithm_of(task.dispatched[0]["main"])
        times = by_name.setdefault(task.task_name, {})
        times[algorithm] = min(us, times.get(algorithm, us))
        if signature:
            signature_of[task.task_name] = signature
    totals: dict[str, dict[str, float]] = {}
    complete: dict[str, set] = {}
    for name, signature in signature_of.items():
        times = by_name[name]
        sums = totals.setdefault(signature, {})
        algs = complete.setdefault(signature, set(ALGORITHMS))
        algs &= set(times)
        for alg, us in times.items():
            sums[alg] = sums.get(alg, 0.0) + us
    choice = {}
    for signature, sums in totals.items():
        candidates = {alg: us for alg, us in sums.items() if alg in complete[signature]}
        if len(candidates) > 1:
            choice[signature] = min(candidates, key=candidates.get)
    return dict(sorted(choice.items()))


def unchosen_kernels(tasks: list, choice: dict[str, str], default_tasks: int) -> list[bool]:
    """Per task, whether its kernel belongs to a conv algorithm the build will not use: a variant
    (matched by fused function name, as in :func:`choose_algorithms`) of a conv whose chosen
    algorithm is another. A conv without a choice keeps the cost rule's algorithm, whose kernels
    are the first ``default_tasks`` tasks (those of the model as the build fuses it untuned)."""
    found = [algorithm_of(task.dispatched[0]["main"]) for task in tasks]
    signature_of = {task.task_name: sig for task, (_, sig) in zip(tasks, found) if sig}
    unchosen = []
    for i, (task, (algorithm, _)) in enumerate(zip(tasks, found)):
        signature = signature_of.get(task.task_name)
        if signature is None:
            unchosen.append(False)
        elif signature in choice:
            unchosen.append(algorithm != choice[signature])
        else:
            unchosen.append(i >= default_tasks)
    return unchosen


def _effective_us(summary) -> float | None:
    if summary.default_us is None:
        return summary.best_us
    if summary.applied:
        return summary.tuned_us if summary.tuned_us is not None else summary.best_us
    return summary.default_us


def _prim_funcs(mod: tvm.IRModule) -> list:
    return [f for _, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)]


def _func_key(func) -> int:
    return tvm_ffi.structural_hash(func)

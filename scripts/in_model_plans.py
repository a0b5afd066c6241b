"""How much the Contraction plan knobs are worth *inside* a model: pick each kernel's plan there.

    python scripts/in_model_plans.py model.onnx [--plans 5]

Builds the model once per (plan, accumulator) choice, forced on every Contraction kernel at once,
and reads each kernel's instrumented time in the model; then builds the per-kernel winners together
and times that build against the default one, interleaved. Timed alone, the default plan is within
a few per cent of the best; inside a model the winners differ (docs/performance.md, "Plans timed
the way the model runs them"): MobileNet-V2 4.83 -> 4.32 ms, SqueezeNet 4.77 -> 4.07, ResNet-18
12.25 -> 12.09. A diagnostic, not a tuner: it writes no records.
"""

from __future__ import annotations

import argparse
import contextlib

import numpy as np
import onnx
import tvm
import tvm_ffi

import tvm_fusion
from tvm_fusion import models
from tvm_fusion.benchmark import _timings_ms
from tvm_fusion.frontend import import_onnx
from tvm_fusion.pipeline import unscheduled_module
from tvm_fusion.profiling import kernel_times
from tvm_fusion.schedules.contraction import Contraction
from tvm_fusion.targets import llvm_target

WIN_MARGIN = 0.97  # a choice replaces the default only when 3 % faster in the model (noise)


@contextlib.contextmanager
def forced_knobs(choose):
    """Every Contraction.apply runs with ``choose(func)`` as its forced knobs (None: the default)."""
    original = Contraction.apply

    def apply(self, func, target, tunable):
        self.knobs = choose(func)
        return original(self, func, target, tunable)

    Contraction.apply = apply
    try:
        yield
    finally:
        Contraction.apply = original


def _build(model, target, choose):
    with forced_knobs(choose):
        result = tvm_fusion.build(model, target, tuning_logs=None)
    return tvm.relax.VirtualMachine(result.executable, tvm.cpu())


def _kernel_name(name: str) -> str:
    return name.removesuffix("_prepacked")


def in_model_plans(model: onnx.ModelProto, plans: int = 5, rounds: int = 8):
    """``(choices, default_ms, chosen_ms, outputs)``: per kernel name the forced knobs that won in
    the model, the median latency of the default and the chosen builds (interleaved), and both
    builds' outputs on the same inputs."""
    target = llvm_target()
    args = [tvm.runtime.tensor(v) for v in models.random_inputs(model, seed=0).values()]
    unscheduled = unscheduled_module(import_onnx(model).mod, target)
    name_of = {
        tvm_ffi.structural_hash(f): gv.name_hint
        for gv, f in unscheduled.functions_items()
        if isinstance(f, tvm.tirx.PrimFunc)
    }
    variants = [None] + [{"plan": p, "acc": a} for p in range(plans) for a in (0, 1)]
    times: dict[str, dict[int, float]] = {}
    for i, knobs in enumerate(variants):
        vm = _build(model, target, lambda func, knobs=knobs: knobs)
        for name, ms, _launches in kernel_times(vm, args, repeat=20):
            times.setdefault(_kernel_name(name), {})[i] = ms
    choices = {}
    for name, by_variant in times.items():
        best = min(by_variant, key=by_variant.get)
        if best != 0 and 0 in by_variant and by_variant[best] < WIN_MARGIN * by_variant[0]:
            choices[name] = variants[best]
    builds = {
        "default": _build(model, target, lambda func: None),
        "chosen": _build(model, target, lambda func: choices.get(name_of.get(tvm_ffi.structural_hash(func)))),
    }
    samples = {label: [] for label in builds}
    for _ in range(rounds):
        for label, vm in builds.items():
            samples[label] += _timings_ms(lambda vm=vm: vm["main"](*args), runs=5, warmup=3)
    outputs = {label: vm["main"](*args).numpy() for label, vm in builds.items()}
    return choices, float(np.median(samples["default"])), float(np.median(samples["chosen"])), outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="an .onnx file")
    parser.add_argument("--plans", type=int, default=5, help="plans per kernel to try (default 5)")
    args = parser.parse_args()
    choices, default_ms, chosen_ms, _ = in_model_plans(onnx.load(args.model), args.plans)
    for name, knobs in sorted(choices.items()):
        print(f"{name:48s} {knobs}")
    print(
        f"default {default_ms:.3f} ms, per-kernel winners {chosen_ms:.3f} ms ({len(choices)} kernels changed)"
    )


if __name__ == "__main__":
    main()

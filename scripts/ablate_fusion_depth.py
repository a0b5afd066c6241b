#!/usr/bin/env python3
"""Ablation over max_fusion_depth 1..8: kernel count and latency per example model, side by side.

python scripts/ablate_fusion_depth.py [--models resnet_block_net transformer_block] [--out docs/ablation_fusion_depth.md]
"""

import argparse
import sys
from pathlib import Path

import numpy as np
import tvm
from tvm import relax

from tvm_fusion import FusionPolicy, build, models
from tvm_fusion.targets import llvm_target


def build_vm(model, target, policy, **options):
    result = build(model, target, policy, tuning_logs=None, **options)
    return result.summary.kernels, relax.VirtualMachine(result.executable, tvm.cpu())


def interleaved_medians_ms(vms, feeds, rounds=7, number=20):
    """Median latency per config, timed round-robin so machine noise hits every config alike."""
    args = [tvm.runtime.tensor(v) for v in feeds.values()]
    samples = {key: [] for key in vms}
    for r in range(rounds):
        for key in list(vms) if r % 2 == 0 else list(vms)[::-1]:
            samples[key] += vms[key].time_evaluator("main", tvm.cpu(), number=number, repeat=1)(*args).results
    return {key: float(np.median(v)) * 1e3 for key, v in samples.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["resnet_block_net", "transformer_block"])
    parser.add_argument("--depths", nargs="+", type=int, default=list(range(1, 9)))
    parser.add_argument("--out", default="docs/ablation_fusion_depth.md")
    args = parser.parse_args(argv)
    target = llvm_target()
    lines = [
        "# max_fusion_depth ablation",
        "",
        f"LLVM target `{target}`, untuned (default schedules); median of 7 interleaved rounds × 20 runs; fusion off = one kernel per op.",
        "",
        "| model | depth | kernels | median ms | vs fusion off |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name in args.models:
        model = models.example(name)
        feeds = models.random_inputs(model)
        configs = {"off": build_vm(model, target, None, fusion=False)}
        for depth in args.depths:
            configs[depth] = build_vm(model, target, FusionPolicy(max_fusion_depth=depth))
        ms = interleaved_medians_ms({k: vm for k, (_, vm) in configs.items()}, feeds)
        for key, (kernels, _) in configs.items():
            lines.append(f"| {name} | {key} | {kernels} | {ms[key]:.3f} | {ms['off'] / ms[key]:.2f}x |")
            print(lines[-1], flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

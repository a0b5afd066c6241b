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


def measure(model, target, policy, feeds, number=10, repeat=7, **options):
    result = build(model, target, policy, tuning_logs=None, **options)
    vm = relax.VirtualMachine(result.executable, tvm.cpu())
    args = [tvm.runtime.tensor(v) for v in feeds.values()]
    times = vm.time_evaluator("main", tvm.cpu(), number=number, repeat=repeat)(*args).results
    return result.summary.kernels, float(np.median(times)) * 1e3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["resnet_block_net", "transformer_block"])
    parser.add_argument("--depths", nargs="+", type=int, default=list(range(1, 9)))
    parser.add_argument("--out", default="docs/ablation_fusion_depth.md")
    args = parser.parse_args(argv)
    target = llvm_target()
    lines = ["# max_fusion_depth ablation", "",
             f"LLVM target `{target}`, untuned (default schedules); median of 7×10 runs; fusion off = one kernel per op.", "",
             "| model | depth | kernels | median ms | vs fusion off |", "| --- | ---: | ---: | ---: | ---: |"]
    for name in args.models:
        model = models.example(name)
        feeds = models.random_inputs(model)
        base_kernels, base_ms = measure(model, target, None, feeds, fusion=False)
        lines.append(f"| {name} | off | {base_kernels} | {base_ms:.3f} | 1.00 |")
        print(lines[-1], flush=True)
        for depth in args.depths:
            kernels, ms = measure(model, target, FusionPolicy(max_fusion_depth=depth), feeds)
            lines.append(f"| {name} | {depth} | {kernels} | {ms:.3f} | {base_ms / ms:.2f}x |")
            print(lines[-1], flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

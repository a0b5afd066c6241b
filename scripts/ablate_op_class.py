#!/usr/bin/env python3
"""Ablation of one fusion-policy op class on real models: the default policy against the same
policy without that class (``FusionPolicy.without``), built and timed side by side in one process.

    python scripts/ablate_op_class.py --op-class concat --out docs/ablation_concat.md \\
        /work/zoo/onnx/densenet121.dynamo.onnx /work/zoo/onnx/shufflenet_v2_x1_0.dynamo.onnx

Each model's two builds run in alternating blocks (``benchmark.interleaved_times``), so a slow
phase of the machine hits both alike; the table gives kernel calls, median ms and new / old.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import numpy as np
import onnx
import tvm

from tvm_fusion import FusionPolicy, build
from tvm_fusion.benchmark import interleaved_times
from tvm_fusion.report import kernel_calls
from tvm_fusion.targets import llvm_target

sys.path.insert(0, str(Path(__file__).resolve().parent))
import zoo  # noqa: E402  (scripts/zoo.py: the zoo's model inputs)


def _variant(path: Path, policy: FusionPolicy, args: list):
    result = build(str(path), llvm_target(), policy, name=path.stem, tuning_logs=None)
    vm = tvm.relax.VirtualMachine(result.executable, tvm.cpu())
    out = vm["main"](*args)
    first = out if hasattr(out, "numpy") else out[0]
    return vm, len(kernel_calls(result.lowered)), first.numpy()


def _row(path: Path, new_policy: FusionPolicy, old_policy: FusionPolicy, runs: int) -> str:
    """One model's table row: both builds, their outputs compared, timed side by side."""
    inputs = [tvm.runtime.tensor(v) for v in zoo.feeds_for(onnx.load(str(path))).values()]
    new_vm, new_kernels, new_out = _variant(path, new_policy, inputs)
    old_vm, old_kernels, old_out = _variant(path, old_policy, inputs)
    error = float(np.abs(new_out - old_out).max() / max(float(np.abs(old_out).max()), 1e-30))
    times = interleaved_times([lambda: new_vm["main"](*inputs), lambda: old_vm["main"](*inputs)], runs)
    new_ms, old_ms = (float(np.median(t)) for t in times)
    return (
        f"| {path.name} | {old_kernels} → {new_kernels} | {old_ms:.3f} | {new_ms:.3f} "
        f"| {new_ms / old_ms:.3f} | {error:.1e} |"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", type=Path, help=".onnx files")
    parser.add_argument("--op-class", required=True, help="the class to ablate, e.g. concat")
    parser.add_argument("--runs", type=int, default=20, help="timed runs of each build (default 20)")
    parser.add_argument("--out", type=Path, help="a markdown table to write")
    args = parser.parse_args(argv)
    with_class = FusionPolicy()
    without = with_class.without(args.op_class)
    lines = [
        f"# Ablation: op class `{args.op_class}`",
        "",
        f"Written by `scripts/ablate_op_class.py` on {datetime.date.today()}: each model built for "
        f"`{llvm_target()}` (untuned) with the default policy (new) and without the class (old), "
        f"timed in one process in alternating blocks, {args.runs} runs each; kernels are the "
        "lowered module's kernel calls, error is max |new - old| / max |old| of the first output.",
        "",
        "| model | kernels old → new | ms old | ms new | new / old | error |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for path in args.models:
        lines.append(_row(path, with_class, without, args.runs))
        print(lines[-1], flush=True)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

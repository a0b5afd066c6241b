"""ResNet-18 (224) untuned, with and without Winograd, next to ONNX Runtime, in one process.

Both tvm_fusion builds are untuned (``tuning_logs=None``): "direct" forces the direct conv
everywhere, "winograd" is the default cost rule. Every variant is checked against ONNX Runtime,
then the three are timed interleaved (``rounds`` rounds of ``runs`` runs each); the report gives
the median and minimum per variant. Usage: python scripts/bench_winograd_resnet18.py [--rounds N]
"""

from __future__ import annotations

import argparse
import os

import numpy as np

import tvm_fusion
from tvm_fusion import models
from tvm_fusion.benchmark import _timings_ms, ort_variant, vm_variant


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--size", type=int, default=224)
    args = ap.parse_args(argv)
    model = models.resnet18(size=args.size)
    feeds = models.random_inputs(model)
    variants = [ort_variant(model, feeds, os.cpu_count() or 1)]
    for label, algorithm in (("tvm_fusion direct", "direct"), ("tvm_fusion winograd", None)):
        result = tvm_fusion.build(model, "llvm", tuning_logs=None, conv_algorithms=algorithm)
        variants.append(vm_variant(label, result.executable, None, feeds))
    ref = variants[0].output
    for v in variants[1:]:
        err = float(np.abs(v.output - ref).max() / np.abs(ref).max())
        print(f"{v.label}: max|err|/max|ref| vs ORT {err:.2e}")
    times = {v.label: [] for v in variants}
    for _ in range(args.rounds):
        for v in variants:
            times[v.label] += _timings_ms(v.run, args.runs, 1)
    ort_med = float(np.median(times["onnxruntime"]))
    for v in variants:
        med, best = float(np.median(times[v.label])), min(times[v.label])
        print(f"{v.label:22s} median {med:7.2f} ms  min {best:7.2f} ms  median/ORT {med / ort_med:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""ResNet-18 (224) untuned, with and without Winograd, next to ONNX Runtime, in one process.

Both tvm_fusion builds are untuned (``tuning_logs=None``): "direct" forces the direct conv
everywhere, "winograd" is the default cost rule. Every variant is checked against ONNX Runtime,
then the three are timed interleaved (``rounds`` rounds of ``runs`` runs each); the report gives
the median and minimum per variant. ``--single-thread``: one thread everywhere, timed as the
calling thread's CPU time (``time.thread_time``), which a shared, busy machine disturbs far less
than wall time. Usage: python scripts/bench_winograd_resnet18.py [--rounds N] [--single-thread]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--single-thread", action="store_true")
    args = ap.parse_args(argv)
    if args.single_thread:
        if "tvm" in sys.modules:
            raise SystemExit("--single-thread must be set before TVM is imported")
        os.environ["TVM_NUM_THREADS"] = "1"
    import tvm_fusion  # noqa: PLC0415  (after the thread count is set)
    from tvm_fusion.benchmark import ort_variant, vm_variant  # noqa: PLC0415

    threads = 1 if args.single_thread else os.cpu_count() or 1
    clock = time.thread_time if args.single_thread else time.perf_counter
    from tvm_fusion import models  # noqa: PLC0415

    model = models.resnet18(size=args.size)
    feeds = models.random_inputs(model)
    variants = [ort_variant(model, feeds, threads)]
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
            v.run()
            for _ in range(args.runs):
                start = clock()
                v.run()
                times[v.label].append((clock() - start) * 1e3)
    ort_med = float(np.median(times["onnxruntime"]))
    for v in variants:
        med, best = float(np.median(times[v.label])), min(times[v.label])
        print(f"{v.label:22s} median {med:7.2f} ms  min {best:7.2f} ms  median/ORT {med / ort_med:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

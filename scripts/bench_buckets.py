"""Shape buckets on ResNet-18 (224) with a dynamic batch: bucket entries and the generic ``main``
next to static builds of the same batch sizes, in one process.

Builds the bundled ResNet-18 with ``batch`` symbolic and buckets for batch 1 and 4, and two static
builds (batch 1, batch 4), all untuned. Each entry's output is compared with the static build's
(the relative error is printed), then every (entry, batch) pair is timed interleaved (``--rounds``
rounds of ``--runs`` runs) and a markdown table of the minimum and median ms is printed
(docs/performance.md quotes it).
Usage: python scripts/bench_buckets.py [--rounds N] [--runs N] [--size 224]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

BATCHES = (1, 4)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--size", type=int, default=224)
    args = ap.parse_args(argv)
    import tvm  # noqa: PLC0415

    import tvm_fusion  # noqa: PLC0415
    from tvm_fusion import models  # noqa: PLC0415

    def machine(model, **options):
        start = time.perf_counter()
        result = tvm_fusion.build(model, "llvm", tuning_logs=None, **options)
        print(f"built {model.graph.name} {options or ''} in {time.perf_counter() - start:.1f} s", flush=True)
        return tvm.relax.VirtualMachine(result.executable, tvm.cpu())

    dynamic = machine(
        models.resnet18(batch="batch", size=args.size), shape_buckets=[{"batch": b} for b in BATCHES]
    )
    static = {b: machine(models.resnet18(batch=b, size=args.size)) for b in BATCHES}
    rng = np.random.default_rng(0)
    inputs = {
        b: tvm.runtime.tensor(rng.standard_normal((b, 3, args.size, args.size)).astype(np.float32))
        for b in BATCHES
    }
    cases = {}
    for b in BATCHES:
        cases[("static build", b)] = static[b]["main"]
        cases[("bucket entry", b)] = dynamic[f"main__batch{b}"]
        cases[("generic `main`", b)] = dynamic["main"]
    for (label, b), fn in cases.items():
        ref = static[b]["main"](inputs[b]).numpy()
        err = float(np.abs(fn(inputs[b]).numpy() - ref).max() / np.abs(ref).max())
        print(f"{label} batch {b}: max|err|/max|ref| vs the static build {err:.1e}")
    times = {key: [] for key in cases}
    for r in range(args.rounds):
        for key in list(cases) if r % 2 == 0 else list(cases)[::-1]:
            fn, x = cases[key], inputs[key[1]]
            fn(x)
            for _ in range(args.runs):
                start = time.perf_counter()
                fn(x)
                times[key].append((time.perf_counter() - start) * 1e3)
    labels = list(dict.fromkeys(label for label, _ in cases))
    print("\n| | " + " | ".join(labels) + " |")
    print("| --- |" + " ---: |" * len(labels))
    for b in BATCHES:
        cells = [f"{min(times[(lb, b)]):.2f} ({np.median(times[(lb, b)]):.2f})" for lb in labels]
        print(f"| batch {b}, ms min (median) | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

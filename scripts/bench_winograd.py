"""Winograd vs direct conv per 3x3 conv shape (conv + bias + relu kernels), side by side.

Every shape is built three ways (direct, F(2x2,3x3), F(4x4,3x3)) by the tvm_fusion pipeline with
the choice forced, checked against a float64 reference, and timed interleaved (round-robin over
the variants, ``rounds`` times) in one process; the fastest round per variant is reported
(the machine is shared: the minimum is the least disturbed), with the median in the JSON, plus the max
relative error (max|err| / max|ref|). Usage: python scripts/bench_winograd.py [--quick] [--json F]
"""

from __future__ import annotations

import argparse
import json
import statistics

import numpy as np
import tvm
from numpy.lib.stride_tricks import sliding_window_view
from tvm import relax

from tvm_fusion.legalize.winograd_conv import conv_algorithms
from tvm_fusion.pipeline import pipeline_passes, run_passes
from tvm_fusion.targets import llvm_target

# ResNet-18 (224) 3x3 stride-1 convs: channels, spatial size; (how many in the net)
RESNET18 = [(64, 56, 4), (128, 28, 3), (256, 14, 3), (512, 7, 3)]
ALGORITHMS = ("direct", "winograd2", "winograd4")


def conv_module(cin, cout, size, pad, rng, residual=False):
    w = (rng.standard_normal((cout, cin, 3, 3)) * (1.0 / np.sqrt(9 * cin))).astype("float32")
    b = rng.standard_normal((1, cout, 1, 1)).astype("float32") * 0.1
    osz = size + 2 * pad - 2
    r = rng.standard_normal((1, cout, osz, osz)).astype("float32") if residual else None
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, cin, size, size), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.conv2d(x, relax.const(w), padding=pad))
            y = bb.emit(relax.op.add(y, relax.const(b)))
            if residual:
                y = bb.emit(relax.op.add(y, relax.const(r)))
            out = bb.emit_output(relax.op.nn.relu(y))
        bb.emit_func_output(out)
    return bb.get(), (w, b, r)


def reference(x, params, pad):
    w, b, r = params
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    win = sliding_window_view(xp, (3, 3), axis=(2, 3))
    y = np.einsum("bchwij,kcij->bkhw", win, w.astype(np.float64), optimize=True) + b
    if r is not None:
        y = y + r
    return np.maximum(y, 0)


def build(mod, algorithm, target):
    with conv_algorithms(algorithm):
        lowered = run_passes(mod, pipeline_passes(target), target)
    return tvm.compile(lowered, target=target)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    target = llvm_target()
    rng = np.random.default_rng(0)
    shapes = RESNET18[:1] if args.quick else RESNET18
    rows = []
    for cin, size, count in shapes:
        mod, params = conv_module(cin, cin, size, 1, rng)
        x = rng.standard_normal((1, cin, size, size)).astype("float32")
        ref = reference(x, params, 1)
        funcs, errs = {}, {}
        for alg in ALGORITHMS:
            vm = relax.VirtualMachine(build(mod, alg, target), tvm.cpu())
            xt = tvm.runtime.tensor(x)
            got = vm["main"](xt).numpy()
            errs[alg] = float(np.abs(got - ref).max() / np.abs(ref).max())
            funcs[alg] = (vm, xt)
        times = {alg: [] for alg in ALGORITHMS}
        for _ in range(args.rounds):
            for alg in ALGORITHMS:
                vm, xt = funcs[alg]
                timer = vm.time_evaluator("main", tvm.cpu(), number=1, repeat=3)
                times[alg] += [r * 1e3 for r in timer(xt).results]
        row = {"channels": cin, "size": size, "count": count}
        for alg in ALGORITHMS:
            row[f"{alg}_ms"] = round(min(times[alg]), 4)
            row[f"{alg}_median_ms"] = round(statistics.median(times[alg]), 4)
            row[f"{alg}_err"] = errs[alg]
        rows.append(row)
        print(
            f"{cin:4d}ch {size:3d}x{size:<3d} x{count}: "
            + "  ".join(f"{a} {row[a + '_ms']:.3f} ms (err {row[a + '_err']:.1e})" for a in ALGORITHMS),
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

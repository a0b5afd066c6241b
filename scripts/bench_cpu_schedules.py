#!/usr/bin/env python
"""ONNX Runtime vs stock TVM vs tvm_fusion's untuned default schedules, on the CPU.

    python scripts/bench_cpu_schedules.py            # mobilenet_block, resnet18 (224), bert_layer (seq 128)
    python scripts/bench_cpu_schedules.py --quick    # small shapes, < 2 min
    python scripts/bench_cpu_schedules.py --models bert_layer --no-stock --repeat 20

All three run in one process and are timed in interleaved rounds (a block of ORT runs, a block of
ours, a block of stock, three times), so a noisy shared machine slows them alike; medians are
reported, with ratios to ORT. "stock" is plain TVM: DecomposeOpsForInference,
CanonicalizeBindings and the "zero" pipeline (legalize + FuseOps + FuseTIR), compiled unscheduled.
"ours" is the real project pipeline, ``tvm_fusion.build(model, target, tuning_logs=None)``: BN
folding, activation canonicalisation (+ fast GELU), horizontal fusion, layout rewrite, policy
fusion, then ``apply_default_schedules`` (which also packs constant weights at compile time).
``--zero`` builds "ours" the old way instead (the zero pipeline + ``apply_default_schedules``),
which isolates the schedules from the fusion policy.
The per-kernel table: each kernel of the "ours" build timed on its own with its captured arguments
(this TVM's VirtualMachine has no profile=True; see _kernel_profile).
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

import numpy as np


def _parse():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small shapes (finishes in < 2 min)")
    ap.add_argument("--models", nargs="*", default=None, help="subset of: mobilenet_block resnet18 bert_layer")
    ap.add_argument("--repeat", type=int, default=None, help="timed runs per engine (default 10, quick 5)")
    ap.add_argument("--stock-repeat", type=int, default=3, help="timed runs of the (slow) stock build")
    ap.add_argument("--no-stock", action="store_true", help="skip the unscheduled stock TVM build")
    ap.add_argument("--top", type=int, default=5, help="kernels to list per model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mcpu", default=None, help="LLVM CPU (default: this machine's)")
    ap.add_argument("--zero", action="store_true", help="ours = zero pipeline + default schedules (no project fusion)")
    return ap.parse_args()


def _configs(quick: bool):
    from tvm_fusion import models

    if quick:
        return {
            "mobilenet_block": lambda: models.mobilenet_block(size=28),
            "resnet18": lambda: models.resnet18(size=64),
            "bert_layer": lambda: models.transformer_block(seq=32, hidden=256, heads=4),
        }
    return {
        "mobilenet_block": models.mobilenet_block,
        "resnet18": models.resnet18,
        "bert_layer": models.bert_layer,
    }


def _relax_mod(model, target):
    import tvm
    from tvm import relax
    from tvm.relax.frontend.onnx import from_onnx

    mod = from_onnx(model, keep_params_in_input=False)
    with target:
        mod = relax.transform.DecomposeOpsForInference()(mod)
        mod = relax.transform.CanonicalizeBindings()(mod)
        mod = relax.get_pipeline("zero")(mod)
    return mod


def _build(mod, target, schedule: bool):
    import tvm
    from tvm import relax

    from tvm_fusion.schedules import apply_default_schedules

    if schedule:
        with target:
            mod = apply_default_schedules(target)(mod)
    rt_mod = tvm.compile(mod, target=target).jit()
    return rt_mod, relax.VirtualMachine(rt_mod, tvm.cpu())


def _build_ours(model, target):
    """The project pipeline, untuned: what ``tvm_fusion.build`` gives a user."""
    import tvm
    from tvm import relax

    import tvm_fusion

    res = tvm_fusion.build(model, target, tuning_logs=None)
    rt_mod = res.executable.jit()
    return rt_mod, relax.VirtualMachine(rt_mod, tvm.cpu())


def _first(out):
    return out.numpy() if hasattr(out, "numpy") else out[0].numpy()


def _kernel_profile(rt_mod, vm, args, number=10):
    """Per-kernel time: capture each kernel's arguments with the VM instrument hook during one run,
    then time every kernel on its own with time_evaluator (median of 3 x number calls).

    This TVM's VirtualMachine has no ``profile=True``; timing inside the instrument callback itself
    is unreliable (Python between kernels lets the worker threads fall asleep, and every parallel
    launch then pays a wake-up). Returns {symbol: (ms per model run, calls per run)}."""
    import tvm

    captured, calls = {}, collections.Counter()

    def instrument(func, sym, before, ret, *rest):
        if before:
            calls[sym] += 1
            captured.setdefault(sym, list(rest))
        return 0

    vm.set_instrument(instrument)
    try:
        vm["main"](*args)
    finally:
        vm.set_instrument(lambda *a: 0)
    out = {}
    for sym, kargs in captured.items():
        if sym.startswith("vm.") or not kargs:
            continue
        libs = [m for m in [rt_mod, *rt_mod.imports] if m.implements_function(sym)]
        if not libs:
            continue
        evaluator = libs[0].time_evaluator(sym, tvm.cpu(), number=number, repeat=3)
        out[sym] = (evaluator(*kargs).median * 1e3 * calls[sym], calls[sym])
    return out


def main():
    opts = _parse()
    os.environ.setdefault("TVM_NUM_THREADS", str(opts.threads))
    import onnxruntime as ort
    import tvm

    from tvm_fusion import models
    from tvm_fusion.targets import host_cpu

    target = tvm.target.Target({"kind": "llvm", "mcpu": opts.mcpu or host_cpu(), "num-cores": opts.threads})
    repeat = opts.repeat or (5 if opts.quick else 10)
    configs = _configs(opts.quick)
    names = opts.models or list(configs)
    print(f"target {target}  threads {opts.threads}  repeat {repeat}  {'quick' if opts.quick else 'full'} shapes  "
          f"ours: {'zero pipeline + default schedules' if opts.zero else 'tvm_fusion.build (project pipeline, untuned)'}")
    rows, profiles = [], {}
    for name in names:
        model = configs[name]()
        feeds = models.random_inputs(model)
        so = ort.SessionOptions()
        so.intra_op_num_threads = opts.threads
        so.inter_op_num_threads = 1
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        ref = sess.run(None, feeds)[0]

        t0 = time.perf_counter()
        mod = None
        if opts.zero:
            mod = _relax_mod(model, target)
            ours_rt, ours = _build(mod, target, schedule=True)
        else:
            ours_rt, ours = _build_ours(model, target)
        t_build = time.perf_counter() - t0
        if not opts.no_stock and mod is None:
            mod = _relax_mod(model, target)
        stock = None if opts.no_stock else _build(mod, target, schedule=False)[1]
        args = [tvm.runtime.tensor(v) for v in feeds.values()]

        got = _first(ours["main"](*args))
        err = float(np.max(np.abs(got - ref)))
        rel = err / max(float(np.max(np.abs(ref))), 1e-30)
        err_stock = float(np.max(np.abs(_first(stock["main"](*args)) - ref))) if stock else float("nan")

        engines = {"ort": lambda: sess.run(None, feeds), "ours": lambda: ours["main"](*args)}
        if stock:
            engines["stock"] = lambda: stock["main"](*args)
        times = {k: [] for k in engines}
        rounds = 3
        for r in range(rounds):
            for k, f in engines.items():
                n = opts.stock_repeat if k == "stock" else repeat
                n = max(1, n // rounds + (1 if r < n % rounds else 0))
                # let the other engine's spinning worker threads go to sleep first (ORT and TVM
                # thread pools both spin after a run; back to back they steal each other's cores)
                time.sleep(0.2)
                f()
                for _ in range(n):
                    t = time.perf_counter()
                    f()
                    times[k].append((time.perf_counter() - t) * 1e3)
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append((name, med, err, rel, err_stock, t_build))
        time.sleep(0.2)
        profiles[name] = _kernel_profile(ours_rt, ours, args)
        print(f"  {name}: done (build {t_build:.1f}s)", file=sys.stderr)

    print()
    hdr = f"{'model':16s} {'ORT ms':>9s} {'stock ms':>10s} {'x ORT':>7s} {'ours ms':>9s} {'x ORT':>6s} {'max|err|':>9s} {'rel err':>8s}"
    print(hdr)
    print("-" * len(hdr))
    for name, med, err, rel, err_stock, _ in rows:
        st = med.get("stock")
        st_s = f"{st:10.2f} {st / med['ort']:7.1f}" if st else f"{'-':>10s} {'-':>7s}"
        print(f"{name:16s} {med['ort']:9.2f} {st_s} {med['ours']:9.2f} {med['ours'] / med['ort']:6.2f} {err:9.2e} {rel:8.1e}")
    for name, prof in profiles.items():
        total = sum(v for v, _ in prof.values()) or 1.0
        print(f"\ntop {opts.top} kernels, {name} (ours; each kernel timed alone; ms per model run, % of the kernel sum):")
        for sym, (ms, n) in sorted(prof.items(), key=lambda kv: -kv[1][0])[: opts.top]:
            print(f"  {ms:8.3f} ms {100 * ms / total:5.1f}%  x{n:<3d} {sym}")
    bad = [r[0] for r in rows if r[3] > 1e-4 and r[2] > 1e-4]
    if bad:
        print(f"\nACCURACY: {bad} differ from ONNX Runtime by more than 1e-4 (abs and relative)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""A/B of a default-schedule setting on a GPU: the same models built twice, checked and timed.

    python scripts/gpu_ab.py --set tvm_fusion.schedules.gpu_matmul.MIN_BLOCKS=0
    python scripts/gpu_ab.py --set MOD.NAME=VALUE --models resnet18,bert_layer --out ab.md

Variant A is the build with each ``--set`` applied (a module attribute, set before the build and
restored after: it reaches code that reads ``module.NAME`` when it runs, not a copy made by
``from module import NAME``), variant B the build as the code stands. Both run on CUDA device 0;
each is checked against ONNX Runtime (max |err| / max |ref|) and against the other (max |A - B|),
and the two are timed side by side in interleaved rounds (order alternating), so a change to a GPU
default is measured, not assumed, in one short unattended call. Untuned builds only (no tuning
records). The table is rewritten after every model; a model that fails gets a row saying why.
Without a GPU it builds both variants for CUDA and stops (exit 2).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import zoo  # noqa: E402  (feeds and the relative-error rule)


def parse_setting(text: str) -> tuple[object, str, object]:
    """``pkg.module.NAME=VALUE`` -> (module, NAME, VALUE as a Python literal)."""
    path, sep, value = text.partition("=")
    module_name, _, attr = path.rpartition(".")
    if not sep or not module_name:
        raise SystemExit(f"error: --set {text!r}: expected MODULE.NAME=VALUE")
    module = importlib.import_module(module_name)
    if not hasattr(module, attr):
        raise SystemExit(f"error: --set {text!r}: {module_name} has no attribute {attr!r}")
    return module, attr, ast.literal_eval(value)


def build_variant(name: str, target: dict, settings) -> object:
    from tvm_fusion import build, models

    saved = [(module, attr, getattr(module, attr)) for module, attr, _ in settings]
    try:
        for module, attr, value in settings:
            setattr(module, attr, value)
        return build(models.example(name), target, name=name, tuning_logs=None)
    finally:
        for module, attr, value in saved:
            setattr(module, attr, value)


def compare(name: str, target: dict, settings, device, rounds: int) -> str:
    """One table row: both variants built, checked and (with a device) timed."""
    import onnxruntime as ort
    import tvm

    from tvm_fusion import models

    model = models.example(name)
    feeds = zoo.feeds_for(model)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    reference = session.run(None, feeds)[0]
    built, build_s = {}, {}
    for variant, sets in (("A", settings), ("B", [])):
        start = time.perf_counter()
        built[variant] = build_variant(name, target, sets)
        build_s[variant] = time.perf_counter() - start
    builds = f"{build_s['A']:.1f} / {build_s['B']:.1f}"
    if device is None:
        return f"| {name} | {builds} | (no GPU: built only) | | | | |"
    args_dev = [tvm.runtime.tensor(v, device) for v in feeds.values()]
    outputs, timers, times = {}, {}, {"A": [], "B": []}
    for variant, result in built.items():
        vm = tvm.relax.VirtualMachine(result.executable, device)
        out = vm["main"](*args_dev)
        outputs[variant] = (out if isinstance(out, tvm.runtime.Tensor) else out[0]).numpy()
        timers[variant] = vm.time_evaluator("main", device, number=20, repeat=3)
    errors = {
        v: float(np.max(np.abs(o - reference)) / float(np.max(np.abs(reference)))) for v, o in outputs.items()
    }
    a_vs_b = float(np.max(np.abs(outputs["A"] - outputs["B"])))
    for i in range(rounds):
        for variant in ("A", "B") if i % 2 == 0 else ("B", "A"):
            times[variant].append(float(np.median(timers[variant](*args_dev).results)) * 1e3)
    ms = {v: float(np.median(t)) for v, t in times.items()}
    return (
        f"| {name} | {builds} | {errors['A']:.1e} / {errors['B']:.1e} | {a_vs_b:.1e} "
        f"| {ms['A']:.4f} | {ms['B']:.4f} | {ms['B'] / ms['A']:.2f} |"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--set", action="append", required=True, help="MODULE.NAME=VALUE for variant A")
    p.add_argument("--models", default="resnet18,bert_layer,mobilenet_block", help="bundled examples")
    p.add_argument("--arch", help="CUDA arch (default: the GPU's)")
    p.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds (default 7)")
    p.add_argument("--out", type=Path, default=None, help="write the table here (markdown)")
    args = p.parse_args(argv)

    import tvm

    settings = [parse_setting(s) for s in args.set]
    device = tvm.cuda(0)
    has_gpu = device.exist
    arch = args.arch or ("sm_" + device.compute_version.replace(".", "") if has_gpu else "sm_80")
    target = {"kind": "cuda", "arch": arch}
    label = ", ".join(args.set)
    lines = [
        f"# GPU A/B: A = `{label}`, B = as the code stands",
        "",
        f"{getattr(device, 'device_name', 'no GPU') if has_gpu else 'no GPU'}, target `{target}`, "
        f"untuned builds, {args.rounds} interleaved rounds (median of medians).",
        "",
        "| model | build s A / B | max rel err A / B | max abs A − B | ms A | ms B | B / A |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for name in args.models.split(","):
        try:
            row = compare(name, target, settings, device if has_gpu else None, args.rounds)
        except Exception as err:
            row = f"| {name} | failed: `{zoo._one_line(err)}` | | | | | |"
        lines.append(row)
        print(row, flush=True)
        if args.out:
            args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if has_gpu else 2


if __name__ == "__main__":
    sys.exit(main())

"""Side-by-side benchmark: ONNX Runtime, stock TVM, tvm_fusion (untuned, tuned, unfused).

Everything runs in one process on the same machine with the same thread count, each variant
numerically checked against ONNX Runtime before it is timed. Results: a markdown table (median and
p90 over ``runs`` timed runs after warm-up, ratio vs ONNX Runtime, kernel count, bytes moved at
kernel boundaries), a PNG bar chart, a JSON dump, and the machine's roofline (copy bandwidth and
GEMM FLOP/s measured with numpy) so each model's distance from the machine limit is visible.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import tvm
from tvm import relax

from . import models
from .api import build
from .frontend import as_imported, import_onnx
from .policy import Roofline
from .profiling import kernel_times
from .report import estimated_bytes, kernel_count, model_flops
from .targets import device_for, llvm_target, parse_target, target_key


@dataclasses.dataclass
class Row:
    model: str
    variant: str
    median_ms: float | None
    p90_ms: float | None
    kernels: int | None
    bytes_moved: int | None
    max_abs_err: float | None
    note: str = ""
    ratio_vs_ort: float | None = None
    top_kernels: list = dataclasses.field(default_factory=list)


def _timings_ms(fn: Callable[[], None], runs: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def _stats(times: list[float]) -> tuple[float, float]:
    return float(np.median(times)), float(np.percentile(times, 90))


@dataclasses.dataclass
class _Variant:
    label: str
    run: Callable[[], None]
    output: np.ndarray
    kernels: int | None = None
    bytes_moved: int | None = None
    note: str = ""
    vm: relax.VirtualMachine | None = None
    args: list | None = None
    times: list = dataclasses.field(default_factory=list)


def ort_variant(model, feeds, threads: int) -> _Variant:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return _Variant(
        "onnxruntime",
        lambda: session.run(None, feeds),
        session.run(None, feeds)[0],
        note=f"{threads} threads, ORT_ENABLE_ALL",
    )


def vm_variant(label, executable, lowered, feeds, note="") -> _Variant:
    vm = relax.VirtualMachine(executable, tvm.cpu())
    args = [tvm.runtime.tensor(v) for v in feeds.values()]
    return _Variant(
        label,
        lambda: vm["main"](*args),
        vm["main"](*args).numpy(),
        kernel_count(lowered),
        estimated_bytes(lowered),
        note,
        vm,
        args,
    )


def stock_build(model, target):
    """Stock TVM as a user gets it: ``relax.get_pipeline("zero")`` (FuseOps/FuseTIR) + tvm.compile."""
    mod = import_onnx(model).mod
    with target:
        mod = relax.get_pipeline("zero")(mod)
    return tvm.compile(mod, target=target), mod


def benchmark_model(
    name: str,
    model,
    target,
    *,
    runs: int,
    warmup: int,
    tuning_logs,
    profile_top: int = 5,
    variants=("onnxruntime", "stock", "untuned", "tuned", "unfused"),
    rounds: int = 3,
    log=print,
) -> list[Row]:
    """Build every variant, check it against ONNX Runtime, then time them in interleaved rounds.

    Interleaving (a block of runs of each variant, ``rounds`` times over) makes a noisy, shared
    machine slow every variant alike instead of whichever happened to run during the noise.
    """
    feeds = models.random_inputs(model)
    threads = int(target.attrs.get("num-cores", os.cpu_count() or 1))
    ort = ort_variant(model, feeds, threads)
    built = [ort] if "onnxruntime" in variants else []
    skipped: list[Row] = []
    if "stock" in variants:
        built.append(
            vm_variant(
                "stock TVM (zero pipeline)",
                *stock_build(model, target),
                feeds,
                "FuseOps+FuseTIR, no schedules",
            )
        )
    if "untuned" in variants:
        result = build(model, target, name=name, tuning_logs=None)
        built.append(
            vm_variant("tvm_fusion untuned", result.executable, result.lowered, feeds, "default schedules")
        )
    if "tuned" in variants:
        result = build(model, target, name=name, tuning_logs=tuning_logs)
        if result.records_status == "ok":  # timed even when no record beat its default schedule
            built.append(
                vm_variant(
                    "tvm_fusion tuned",
                    result.executable,
                    result.lowered,
                    feeds,
                    f"{result.tuned_kernels} of {result.tuned_kernels + result.default_kernels} kernel "
                    f"functions from tuning_logs/{name}/{target_key(target)} (the rest: defaults won)",
                )
            )
        else:
            skipped.append(
                Row(
                    name,
                    "tvm_fusion tuned",
                    None,
                    None,
                    None,
                    None,
                    None,
                    f"no applicable records: {result.records_note}",
                )
            )
            log(f"  tuned: skipped ({result.records_note})")
    if "unfused" in variants:
        result = build(model, target, name=name, tuning_logs=None, fusion=False)
        built.append(
            vm_variant(
                "unfused (tvm_fusion, fusion off)",
                result.executable,
                result.lowered,
                feeds,
                "one kernel per op",
            )
        )

    per_round = max(1, runs // rounds)
    for r in range(rounds):
        # Alternate the order each round, and pause between blocks: ORT's worker threads keep
        # spinning for a while after a run and would slow whichever variant comes next.
        for variant in built if r % 2 == 0 else built[::-1]:
            time.sleep(0.2)
            variant.times += _timings_ms(variant.run, per_round, warmup if r == 0 else 1)

    rows = []
    for variant in built:
        top = (
            kernel_times(variant.vm, variant.args, repeat=3)[:profile_top]
            if variant.vm is not None and profile_top and variant.label.startswith("tvm_fusion")
            else []
        )
        err = float(np.max(np.abs(np.asarray(variant.output) - ort.output)))
        rows.append(
            Row(
                name,
                variant.label,
                *_stats(variant.times),
                variant.kernels,
                variant.bytes_moved,
                err,
                variant.note,
                top_kernels=top,
            )
        )
        log(f"  {variant.label}: {rows[-1].median_ms:.3f} ms, max abs err {err:.2g}")
    rows += skipped
    ort_ms = rows[0].median_ms if rows and rows[0].variant == "onnxruntime" else None
    for row in rows:
        if ort_ms and row.median_ms:
            row.ratio_vs_ort = row.median_ms / ort_ms
    return rows


@dataclasses.dataclass
class SpeedupReport:
    """Tuned vs untuned build of one model through ``tvm_fusion.build``, timed side by side."""

    model: str
    target_key: str
    untuned_ms: float
    tuned_ms: float
    tuned_kernels: int
    default_kernels: int
    records_note: str
    max_abs_diff: float
    rounds: int

    @property
    def speedup(self) -> float:
        return self.untuned_ms / self.tuned_ms if self.tuned_ms > 0 else float("nan")

    def __str__(self) -> str:
        return (
            f"{self.model} on {self.target_key}: untuned {self.untuned_ms:.4f} ms, tuned {self.tuned_ms:.4f} ms "
            f"(x{self.speedup:.2f}, median of {self.rounds} interleaved rounds); {self.tuned_kernels} kernels "
            f"tuned, {self.default_kernels} default; outputs differ by at most {self.max_abs_diff:.2e}\n"
            f"  records: {self.records_note}"
        )


def measure_speedup(
    model,
    target="llvm",
    *,
    tuning_logs: str | Path = "tuning_logs",
    policy=None,
    options: dict | None = None,
    rounds: int = 15,
    number: int = 10,
) -> SpeedupReport:
    """Build ``model`` twice with the real pipeline, with the records in ``tuning_logs`` and with
    none, and time both in alternation (``rounds`` rounds of ``number`` calls; medians reported)."""
    target = parse_target(target)
    imported = as_imported(model)
    device = device_for(target)
    builds = [
        build(imported, target, policy, tuning_logs=logs, **(options or {})) for logs in (None, tuning_logs)
    ]
    rng = np.random.default_rng(0)
    feeds = [
        tvm.runtime.tensor(
            rng.standard_normal([d if isinstance(d, int) and d > 0 else 1 for d in spec.shape]).astype(
                spec.dtype
            ),
            device,
        )
        for spec in imported.inputs
    ]
    vms = [relax.VirtualMachine(b.executable, device) for b in builds]
    outputs = [_flat_numpy(vm["main"](*feeds)) for vm in vms]
    diff = max(float(np.max(np.abs(a.astype("float64") - b.astype("float64")))) for a, b in zip(*outputs))
    timers = [vm.time_evaluator("main", device, number=number, repeat=1, min_repeat_ms=50) for vm in vms]
    samples: list[list[float]] = [[], []]
    for _ in range(rounds):
        for k, timer in enumerate(timers):
            samples[k].append(float(timer(*feeds).mean) * 1e3)
    tuned = builds[1]
    return SpeedupReport(
        model=imported.name,
        target_key=target_key(target),
        untuned_ms=float(np.median(samples[0])),
        tuned_ms=float(np.median(samples[1])),
        tuned_kernels=tuned.tuned_kernels,
        default_kernels=tuned.default_kernels,
        records_note=str(tuned.records_note),
        max_abs_diff=diff,
        rounds=rounds,
    )


def _flat_numpy(out) -> list[np.ndarray]:
    if isinstance(out, tvm.runtime.Tensor):
        return [out.numpy()]
    return [a for o in out for a in _flat_numpy(o)]


def model_roofline_ms(model, roofline: Roofline, target) -> tuple[float, float, int]:
    """(lower-bound ms, GFLOP, bytes): the best this machine could do for the model."""
    mod = import_onnx(model).mod
    flops = model_flops(mod)
    result = build(model, target, tuning_logs=None)
    moved = estimated_bytes(result.lowered)
    return roofline.seconds(moved, flops) * 1e3, flops / 1e9, moved


SUITES = {
    "full": [
        ("resnet_block_net", models.resnet_block_net),
        ("mobilenet_block", models.mobilenet_block),
        ("resnet18", models.resnet18),
        ("bert_layer", models.bert_layer),
    ],
    "cpu": [
        ("mobilenet_block", models.mobilenet_block),
        ("resnet18", models.resnet18),
        ("bert_layer", models.bert_layer),
    ],
    "quick": [("resnet_block_net", models.resnet_block_net), ("transformer_block", models.transformer_block)],
}


def run(
    suite: str = "full",
    out_dir: str | Path = "docs",
    runs: int = 30,
    warmup: int = 5,
    tuning_logs: str | Path = "tuning_logs",
    target=None,
    log=print,
    rounds: int = 5,
) -> Path:
    target = target or llvm_target()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    log("measuring the machine roofline (numpy copy bandwidth, GEMM FLOP/s) ...")
    roof = Roofline.measure()
    log(f"  {roof.bandwidth_gbps} GB/s, {roof.peak_gflops} GFLOP/s")
    all_rows, limits = [], {}
    for name, make in SUITES[suite]:
        log(f"== {name}")
        model = make()
        limits[name] = model_roofline_ms(model, roof, target)
        all_rows += benchmark_model(
            name, model, target, runs=runs, warmup=warmup, tuning_logs=tuning_logs, log=log, rounds=rounds
        )
    report = format_markdown(all_rows, limits, roof, target, runs, warmup, rounds)
    md_path = out_dir / ("benchmarks.md" if suite == "full" else f"benchmarks_{suite}.md")
    md_path.write_text(report)
    (md_path.with_suffix(".json")).write_text(
        json.dumps([dataclasses.asdict(r) for r in all_rows], indent=1, default=str)
    )
    plot(all_rows, md_path.with_suffix(".png"))
    log(report)
    log(f"wrote {md_path}, {md_path.with_suffix('.json')}, {md_path.with_suffix('.png')}")
    return md_path


def _fmt(value, spec):
    return "—" if value is None else format(value, spec)


def format_markdown(
    rows: list[Row], limits, roof: Roofline, target, runs: int, warmup: int, rounds: int
) -> str:
    import onnxruntime

    lines = [
        "# Benchmarks",
        "",
        f"Measured {datetime.date.today().isoformat()} on {platform.processor() or platform.machine()} "
        f"({os.cpu_count()} cores), target `{json.dumps(json.loads(str(target)), separators=(',', ':'))}`, "
        f"TVM {tvm.__version__}, ONNX Runtime {onnxruntime.__version__}. Median and p90 over {runs} runs "
        f"after {warmup} warm-up runs, all variants in one process, timed in {rounds} interleaved rounds (order alternating); "
        f"TVM thread pool {os.environ.get('TVM_NUM_THREADS', 'TVM default')} threads; "
        "max abs error is against ONNX Runtime.",
        "",
        f"Machine roofline (numpy): copy bandwidth {roof.bandwidth_gbps} GB/s, GEMM {roof.peak_gflops} GFLOP/s.",
        "",
        "| model | variant | median ms | p90 ms | × ORT | kernels | MB moved | max abs err | notes |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        mb = None if r.bytes_moved is None else r.bytes_moved / 2**20
        lines.append(
            f"| {r.model} | {r.variant} | {_fmt(r.median_ms, '.3f')} | {_fmt(r.p90_ms, '.3f')} | "
            f"{_fmt(r.ratio_vs_ort, '.2f')} | {_fmt(r.kernels, 'd')} | {_fmt(mb, '.1f')} | "
            f"{_fmt(r.max_abs_err, '.1e')} | {r.note} |"
        )
    lines += [
        "",
        "## Distance from the machine limit",
        "",
        "The limit is numpy's (OpenBLAS) GEMM rate and copy bandwidth on this machine, not the "
        "hardware peak: above 100 % our kernels ran faster than numpy's GEMM.",
        "",
        "| model | GFLOP | roofline lower bound ms | best tvm_fusion ms | % of limit |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, (bound_ms, gflop, _moved) in limits.items():
        ours = [
            r.median_ms
            for r in rows
            if r.model == name and r.variant.startswith("tvm_fusion") and r.median_ms
        ]
        best = min(ours) if ours else None
        pct = None if not best else 100 * bound_ms / best
        lines.append(f"| {name} | {gflop:.2f} | {bound_ms:.3f} | {_fmt(best, '.3f')} | {_fmt(pct, '.0f')} |")
    lines += ["", "## Top kernels (VM instrumentation)", ""]
    for r in rows:
        if r.top_kernels:
            lines.append(
                f"**{r.model} — {r.variant}**: "
                + ", ".join(f"`{k}` {ms:.3f} ms" + (f" ×{n}" if n > 1 else "") for k, ms, n in r.top_kernels)
            )
            lines.append("")
    return "\n".join(lines) + "\n"


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r.model for r in rows))
    variants = list(dict.fromkeys(r.variant for r in rows))
    fig, axes = plt.subplots(1, len(names), figsize=(4.5 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names):
        sub = {r.variant: r.median_ms for r in rows if r.model == name}
        vals = [sub.get(v) or 0.0 for v in variants]
        ax.bar(range(len(variants)), vals, color=[f"C{i}" for i in range(len(variants))])
        ax.set_yscale("log")
        ax.set_title(name)
        ax.set_ylabel("median latency, ms (log)")
        ax.set_xticks(range(len(variants)))
        ax.set_xticklabels(variants, rotation=35, ha="right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="small models, few runs: checks that the benchmark completes"
    )
    parser.add_argument(
        "--suite",
        choices=sorted(SUITES),
        default=None,
        help="model set (default: full, or quick with --quick)",
    )
    parser.add_argument("--out", default="docs")
    parser.add_argument("--runs", type=int, default=None)
    parser.add_argument("--tuning-logs", default="tuning_logs")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds (default 5)")
    args = parser.parse_args(argv)
    runs = args.runs or (5 if args.quick else 30)
    suite = args.suite or ("quick" if args.quick else "full")
    run(
        suite,
        args.out,
        runs=runs,
        warmup=2 if args.quick else 5,
        tuning_logs=args.tuning_logs,
        rounds=min(args.rounds, runs),
    )
    return 0

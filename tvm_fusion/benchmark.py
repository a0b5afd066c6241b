"""Side-by-side benchmark: ONNX Runtime, stock TVM, tvm_fusion (untuned, tuned, unfused).

Everything runs in one process on the same machine with the same thread count, each variant
numerically checked against ONNX Runtime before it is timed. Results: a markdown table (median and
p90 over ``runs`` timed runs after warm-up, ratio vs ONNX Runtime, kernel count, bytes moved at
kernel boundaries), a PNG bar chart, a JSON dump, and the machine's roofline (copy bandwidth
measured with numpy, the FMA peak with ``tvm_fusion.fma_peak``) so each model's distance from the
machine limit is visible.
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
from .files import write_json_atomic
from .frontend import as_imported, import_onnx
from .policy import Roofline
from .profiling import kernel_times
from .report import estimated_bytes, kernel_count, model_flops
from .targets import device_for, llvm_target, parse_target, target_key
from .tuning.records import MANIFEST_FILE, record_dir


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


BLOCK_RUNS = 5  # runs of one function in a row


def interleaved_times(
    fns: list[Callable[[], None]], runs: int, rounds: int | None = None, warmup: int = 2
) -> list[list[float]]:
    """Each function's run times (ms), timed side by side: ``rounds`` blocks of each in turn
    (default: blocks of ``BLOCK_RUNS``, at least 3), the order reversed every other round, after
    ``warmup`` runs of each (and one untimed run before every block). Noise then hits all
    alike: this VM has slow phases of minutes, and with three long blocks one of them could fall
    into a phase the other missed."""
    times: list[list[float]] = [[] for _ in fns]
    for fn in fns:
        for _ in range(warmup):
            fn()
    rounds = rounds or max(3, -(-runs // BLOCK_RUNS))
    per_round = max(1, runs // rounds)
    for r in range(rounds):
        for i in range(len(fns)) if r % 2 == 0 else reversed(range(len(fns))):
            time.sleep(0.2)  # ORT's spinning worker threads would slow whoever runs next
            times[i] += _timings_ms(fns[i], per_round, warmup=1)
    return times


def interleaved_ms(fns: list[Callable[[], None]], runs: int) -> list[float]:
    """Median ms of each function, timed by :func:`interleaved_times`."""
    return [round(float(np.median(t)), 3) for t in interleaved_times(fns, runs)]


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
        None if lowered is None else kernel_count(lowered),
        None if lowered is None else estimated_bytes(lowered),
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


def stock_ms_tuned_build(model, target, trials: int, work_dir: Path, log=print):
    """What a TVM user would otherwise do: stock fusion, Meta-Schedule's default space and search
    (``tune_relax``) with ``trials`` trials, the records applied to the stock-fused module. Returns ``(executable, trials, tuning
    seconds)``; the records (and the time they took) are kept in ``work_dir`` and reused, so the
    benchmark tunes only once per budget."""
    from tvm.s_tir import meta_schedule as ms

    from .tuning.environment import load_tensor_intrinsics
    from .tuning.workers import PersistentLocalBuilder

    mod = import_onnx(model).mod
    with target:
        mod = relax.get_pipeline("zero")(mod)  # stock fusion, as in stock_build
    work_dir = Path(work_dir)
    stamp = work_dir / "stock_tuning.json"
    done = json.loads(stamp.read_text()) if stamp.exists() else {}
    load_tensor_intrinsics()
    if done.get("trials", -1) < trials:
        log(f"  stock Meta-Schedule: tuning {trials} trials into {work_dir}")
        start = time.perf_counter()
        database = ms.relax_integration.tune_relax(
            mod,
            params={},
            target=target,
            work_dir=str(work_dir),
            max_trials_global=trials,
            num_trials_per_iter=16,
            builder=PersistentLocalBuilder(os.cpu_count() or 1),
        )
        done = {"trials": trials, "seconds": round(time.perf_counter() - start, 1)}
        write_json_atomic(stamp, done)
    else:
        database = ms.database.JSONDatabase(work_dir=str(work_dir))
    with target, database:
        mod = relax.transform.MetaScheduleApplyDatabase()(mod)
    return tvm.compile(mod, target=target), done["trials"], done["seconds"]


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
    stock_tuning_logs: Path | None = None,
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
    tuned_trials = 0
    if "tuned" in variants:
        result = build(model, target, name=name, tuning_logs=tuning_logs)
        if result.records_status == "ok":  # timed even when no record beat its default schedule
            manifest = json.loads((record_dir(tuning_logs, name, target) / MANIFEST_FILE).read_text())
            tuned_trials = int(manifest.get("num_records", 0))
            seconds = manifest.get("tuning_seconds")
            built.append(
                vm_variant(
                    "tvm_fusion tuned",
                    result.executable,
                    result.lowered,
                    feeds,
                    f"{result.tuned_kernels} of {result.tuned_kernels + result.default_kernels} kernel "
                    f"functions from tuning_logs/{name}/{target_key(target)} (the rest: defaults won); "
                    f"{tuned_trials} trials" + (f" in {seconds / 60:.1f} min" if seconds else ""),
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
    if "stock tuned" in variants and stock_tuning_logs is not None and tuned_trials:
        executable, trials, seconds = stock_ms_tuned_build(
            model, target, tuned_trials, Path(stock_tuning_logs) / name / target_key(target), log
        )
        built.append(
            vm_variant(
                "stock Meta-Schedule tuned",
                executable,
                None,
                feeds,
                f"stock fusion + tune_relax (default space), {trials} trials (same budget) in {seconds / 60:.1f} min",
            )
        )
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

    timings = interleaved_times([v.run for v in built], runs, rounds=rounds, warmup=warmup)
    for variant, times in zip(built, timings, strict=True):
        variant.times = times

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
    stock_tuning_logs: str | Path | None = None,
) -> Path:
    target = target or llvm_target()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    log("measuring the machine roofline (numpy copy bandwidth, FMA peak) ...")
    roof = Roofline.measure(target=target)
    log(f"  {roof.bandwidth_gbps} GB/s, {roof.peak_gflops} GFLOP/s")
    all_rows, limits = [], {}
    for name, make in SUITES[suite]:
        log(f"== {name}")
        model = make()
        limits[name] = model_roofline_ms(model, roof, target)
        all_rows += benchmark_model(
            name,
            model,
            target,
            runs=runs,
            warmup=warmup,
            tuning_logs=tuning_logs,
            log=log,
            rounds=rounds,
            variants=("onnxruntime", "stock", "untuned", "tuned", "stock tuned", "unfused"),
            stock_tuning_logs=stock_tuning_logs,
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
        f"Machine roofline: copy bandwidth {roof.bandwidth_gbps} GB/s (numpy), FMA peak {roof.peak_gflops} "
        "GFLOP/s (`tvm_fusion.fma_peak`: independent FMA chains on every core, no memory traffic).",
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
    tuning_lines = []
    for name in dict.fromkeys(r.model for r in rows):
        by = {r.variant: r for r in rows if r.model == name}
        untuned, tuned, stock = (
            by.get(v) for v in ("tvm_fusion untuned", "tvm_fusion tuned", "stock Meta-Schedule tuned")
        )
        if tuned is None or not tuned.median_ms or untuned is None or not untuned.median_ms:
            continue
        vs_stock = stock.median_ms / tuned.median_ms if stock is not None and stock.median_ms else None
        tuning_lines.append(
            f"| {name} | {untuned.median_ms / tuned.median_ms:.2f}x | {_fmt(tuned.ratio_vs_ort, '.2f')} | "
            f"{_fmt(None if stock is None else stock.median_ms, '.3f')} | {_fmt(vs_stock, '.2f')} | {tuned.note} |"
        )
    if tuning_lines:
        lines += [
            "",
            "## Tuning",
            "",
            "Tuned vs untuned (both tvm_fusion), and tvm_fusion tuned vs stock Meta-Schedule tuned with the "
            "same number of trials (stock fusion, Meta-Schedule's default space and evolutionary search), "
            "from the rows above.",
            "",
            "| model | tuned speed-up over untuned | tuned × ORT | stock MS tuned ms | tuned speed-up over stock MS tuned | records |",
            "| --- | ---: | ---: | ---: | ---: | --- |",
            *tuning_lines,
        ]
    lines += [
        "",
        "## Distance from the machine limit",
        "",
        "The limit is this machine's FMA peak and copy bandwidth (above). FLOPs are counted as direct "
        "convolutions and matmuls: a Winograd conv does fewer, so a conv net can read above 100 %.",
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


def plot(rows: list[Row], path: Path, clip: float = 3.0) -> None:
    """Latency relative to ONNX Runtime per model and variant, on a linear axis (1.0 = ORT, lower is
    faster); bars above ``clip`` (stock TVM untuned is 20-200x) are cut and labelled with their value."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r.model for r in rows))
    variants = [v for v in dict.fromkeys(r.variant for r in rows) if v != "onnxruntime"]
    width = 0.8 / max(len(variants), 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.9 * len(names) + 2), 4.2))
    for k, variant in enumerate(variants):
        xs, heights = [], []
        for i, name in enumerate(names):
            row = next((r for r in rows if r.model == name and r.variant == variant), None)
            if row is not None and row.ratio_vs_ort:
                xs.append(i + (k - (len(variants) - 1) / 2) * width)
                heights.append(row.ratio_vs_ort)
        bars = ax.bar(xs, [min(h, clip) for h in heights], width, label=variant, color=f"C{k}")
        for bar, h in zip(bars, heights):
            if h > clip:
                ax.text(
                    bar.get_x() + bar.get_width() / 2, clip, f"{h:.0f}x", ha="center", va="bottom", fontsize=7
                )
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_ylim(0, clip * 1.08)
    ax.set_ylabel("latency / ONNX Runtime (lower is faster)")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names)
    ax.legend(fontsize=7, ncol=2)
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
    parser.add_argument(
        "--stock-tuning-logs",
        default=None,
        help="also time stock Meta-Schedule tuned with our trial budget (records kept in this folder, "
        "e.g. tuning_logs_stock; tunes once per model)",
    )
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
        stock_tuning_logs=args.stock_tuning_logs,
    )
    return 0

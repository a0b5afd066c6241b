"""Ours vs ONNX Runtime while another process keeps one core busy, with TVM's thread pinning on/off.

TVM pins each thread-pool worker to its own core (``TVM_BIND_THREADS``, on in plain TVM) and splits
every parallel loop statically, so a kernel ends when its slowest thread does. If another process
is busy on a worker's core, that worker gets half the core and every kernel waits for it; the OS
cannot move it. ``import tvm_fusion`` therefore turns the pinning off (unless the user set it).
This script measures why, side by side with ORT in one process per case:

* load: ``idle``; ``busy core`` (a ``while True`` process pinned to the highest-numbered CPU,
  where TVM pins a worker); ``busy, any core`` (the same process, unpinned).
* TVM pool: ``pinned`` (``TVM_BIND_THREADS=1``, plain TVM's default) or ``unpinned`` (``0``,
  tvm_fusion's default).

Each model is built once (untuned, tvm_fusion's defaults) and exported; every case runs in a fresh
child process, since TVM reads ``TVM_BIND_THREADS`` when its pool starts. ORT gets the same number
of threads. Writes docs/contention.md and .json.
Usage: python scripts/bench_contention.py [--models resnet18,mobilenet_block,bert_layer]
[--onnx a.onnx,b.onnx] [--runs 20] [--repeats 3] [--out docs]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LOADS = ("idle", "busy core", "busy, any core")
POOLS = {"pinned": "1", "unpinned": "0"}


def _busy_process(load: str) -> subprocess.Popen | None:
    """A process spinning on one CPU (``busy core``: the highest-numbered one) or on any CPU."""
    if load == "idle":
        return None
    cpu = max(os.sched_getaffinity(0))
    pin = (lambda: os.sched_setaffinity(0, {cpu})) if load == "busy core" else None
    return subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=pin)


def measure(onnx_path: str, library: str, load: str, runs: int) -> tuple[float, float]:
    """Median ms of ORT and of the exported library, interleaved, under ``load`` (child process)."""
    import onnx  # noqa: PLC0415
    import tvm  # noqa: PLC0415

    from tvm_fusion import models  # noqa: PLC0415  (after the env the parent chose)
    from tvm_fusion.benchmark import interleaved_ms, ort_variant  # noqa: PLC0415

    model = onnx.load(onnx_path)
    feeds = models.random_inputs(model)
    ort = ort_variant(model, feeds, os.cpu_count() or 1)
    vm = tvm.relax.VirtualMachine(tvm.runtime.load_module(library), tvm.cpu())
    args = [tvm.runtime.tensor(v) for v in feeds.values()]
    busy = _busy_process(load)
    try:
        time.sleep(0.5)
        ms_ort, ms_ours = interleaved_ms([ort.run, lambda: vm["main"](*args)], runs)
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    return ms_ort, ms_ours


def _child(argv: list[str]) -> int:
    onnx_path, library, load, runs = argv
    print(json.dumps(measure(onnx_path, library, load, int(runs))))
    return 0


def _models(names: list[str], onnx_paths: list[str], tmp: Path) -> dict[str, str]:
    import onnx  # noqa: PLC0415

    from tvm_fusion import models  # noqa: PLC0415

    paths = {}
    for name in names:
        path = tmp / f"{name}.onnx"
        onnx.save(models.example(name), path)
        paths[name] = str(path)
    for path in onnx_paths:
        paths[Path(path).name.removesuffix(".onnx")] = path
    return paths


def _summary(rows: list[dict]) -> list[str]:
    """One line per load: the range over models of the median ours ÷ ORT, per thread pool."""
    lines = []
    for load in LOADS:
        parts = []
        for pool in POOLS:
            ratios = [
                statistics.median(b / a for a, b in zip(r["ms_ort"], r["ms_ours"]))
                for r in rows
                if r["load"] == load and r["pool"] == pool
            ]
            if ratios:
                parts.append(f"{pool} {min(ratios):.2f}–{max(ratios):.2f}")
        if parts:
            lines.append(
                f"- **{load}**: ours ÷ ORT (median per model, range over models): {', '.join(parts)}"
            )
    return lines


def format_markdown(rows: list[dict]) -> str:
    cores = os.cpu_count()
    lines = [
        "# Under contention: another process busy on one core",
        "",
        "Written by `scripts/bench_contention.py`. Untuned tvm_fusion builds next to ONNX Runtime, "
        f"{cores} threads each, timed interleaved in one process. Each case runs in several fresh "
        "processes (the OS places the threads anew each time): ms are medians over them, × ORT is "
        "given per process. `busy core`: a `while True` process pinned to the highest-numbered "
        "CPU, where TVM pins a pool worker; `busy, any core`: the same process, unpinned. `pinned` "
        "is TVM's default thread pool (`TVM_BIND_THREADS=1`), `unpinned` what `import tvm_fusion` "
        "sets (`TVM_BIND_THREADS=0`, unless you set it). Models: the bundled examples "
        "(`tvm_fusion.models`) and ONNX files given with `--onnx` (named by their file).",
        "",
        *_summary(rows),
        "",
        "| model | load | TVM pool | ms ORT | ms ours | × ORT, per process |",
        "| --- | --- | --- | ---: | ---: | ---: |",
    ]
    for r in rows:
        ort_ms, ours_ms = statistics.median(r["ms_ort"]), statistics.median(r["ms_ours"])
        ratios = ", ".join(f"{b / a:.2f}" for a, b in zip(r["ms_ort"], r["ms_ours"]))
        lines.append(
            f"| {r['model']} | {r['load']} | {r['pool']} | {ort_ms:.2f} | {ours_ms:.2f} | {ratios} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return _child(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet18,mobilenet_block,bert_layer")
    ap.add_argument("--onnx", default="", help="comma-separated ONNX files to add")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3, help="child processes per case")
    ap.add_argument("--out", default="docs")
    ap.add_argument("--report", action="store_true", help="only rewrite the .md from the .json")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.report:
        (out / "contention.md").write_text(format_markdown(json.loads((out / "contention.json").read_text())))
        return 0
    import tvm_fusion  # noqa: PLC0415

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        names = [n for n in args.models.split(",") if n]
        paths = _models(names, [p for p in args.onnx.split(",") if p], Path(tmp))
        for name, path in paths.items():
            library = str(Path(tmp) / f"{name}.so")
            tvm_fusion.build(path, "llvm", tuning_logs=None).export(library)
            for load in LOADS:
                for pool, bind in POOLS.items():
                    env = dict(os.environ, TVM_BIND_THREADS=bind)
                    cmd = [sys.executable, __file__, "--child", path, library, load, str(args.runs)]
                    ort_ms, ours_ms = [], []
                    for _ in range(args.repeats):  # fresh processes: the OS places threads anew
                        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
                        ms = json.loads(proc.stdout.strip().splitlines()[-1])
                        ort_ms.append(ms[0])
                        ours_ms.append(ms[1])
                    row = dict(model=name, load=load, pool=pool, ms_ort=ort_ms, ms_ours=ours_ms)
                    rows.append(row)
                    print(f"{name:20s} {load:15s} {pool:9s} ORT {ort_ms}  ours {ours_ms}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "contention.json").write_text(json.dumps(rows, indent=1))
    (out / "contention.md").write_text(format_markdown(rows))
    print(f"wrote {out / 'contention.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python3
"""One unattended command for a machine with an NVIDIA GPU: the model zoo on CUDA, checked and timed.

    python scripts/gpu_check.py               # the zoo (one exporter), ~10 min on an H200 machine
    python scripts/gpu_check.py --quick       # 3 models and a shorter tuning run, ~3 min
    python scripts/gpu_check.py --build-only  # no GPU needed: build + export for CUDA only
    python scripts/gpu_check.py --models vit_b_16,bert --tune-minutes 3   # + a whole model tuned

For each model (``scripts/zoo.py``'s list; the cached ``<cache>/<model>.<exporter>.onnx`` files, or
exported on the spot when torch is installed, else the bundled example models): build with
tvm_fusion for the GPU's arch (builds run in parallel worker processes), export, load the ``.so``
and run it on the GPU, compare with ONNX Runtime (max |err| / max |ref| <= 1e-4), time both
(ORT on its CUDA provider when it has one, else on the CPU: the table says which), then tune one
kernel (a BERT-sized GEMM) briefly and time the tuned against the default schedule; with
``--tune-minutes``, tune a bundled model (``--tune-model``) and time it tuned vs untuned. Writes
docs/cuda.md (``--out``) after every stage, so a run cut short still leaves what it measured.

Without a GPU it stops at once with one ``error:`` line and exit status 2 (unless --build-only).
"""

from __future__ import annotations

import argparse
import concurrent.futures as futures
import datetime
import json
import multiprocessing
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import zoo  # noqa: E402  (scripts/zoo.py: the model list, feeds and exporters)

REL_TOL = zoo.REL_TOL
QUICK_MODELS = ["resnet18", "mobilenet_v3_small", "distilbert"]
TOP_KERNELS = 6  # slowest kernels listed per model
NOTES_MARKER = "<!-- notes below are kept when gpu_check.py rewrites the table -->"


def gpu_arch() -> str | None:
    """``sm_XY`` of CUDA device 0 as TVM sees it, or None when there is none."""
    import tvm

    device = tvm.cuda(0)
    if not device.exist:
        return None
    return "sm_" + str(device.compute_version).replace(".", "")


def no_gpu_message() -> str:
    import tvm

    built_with_cuda = tvm.support.libinfo().get("USE_CUDA", "OFF") not in ("OFF", "NOT-FOUND", "")
    why = "no CUDA device is visible" if built_with_cuda else "this TVM build has no CUDA runtime"
    return (
        f"error: {why} (tvm.cuda(0).exist is False): run scripts/gpu_check.py on a machine with an NVIDIA "
        "GPU, or pass --build-only to build and export for CUDA without running"
    )


# -- stage 1: exports and builds, in parallel worker processes -----------------------------------
def build_one(source: str, name: str, target: dict, so_path: str, export: tuple | None = None) -> dict:
    """Export (when ``export`` names ``(model, exporter, cache)``) and build + export one model for
    CUDA, in a worker process; a dict of what happened."""
    start = time.perf_counter()
    if export is not None:
        try:
            import torch

            torch.set_num_threads(2)  # several exports run side by side
            zoo.export(*export)
        except Exception as err:
            return {
                "export_s": round(time.perf_counter() - start, 1),
                "error": f"export failed: {zoo._one_line(err)}",
            }
    from tvm_fusion import build

    exported = time.perf_counter()
    try:
        result = build(source, target, name=name, tuning_logs=None)
        result.export(so_path)
        return {
            "build_s": round(time.perf_counter() - exported, 1),
            "ops": result.summary.ops,
            "kernels": result.summary.kernels,
            "layout_transforms": result.summary.layout_transforms,
        }
    except Exception as err:
        return {"build_s": round(time.perf_counter() - exported, 1), "error": zoo._one_line(err)}


def model_sources(args) -> list[tuple[str, str, tuple | None]]:
    """``[(row name, .onnx path or bundled example name, export job or None)]``: a cached file is
    used as is; a missing one is exported by the build worker when torch is installed."""
    names = QUICK_MODELS if args.quick and not args.models else zoo._select(args.models, zoo.ZOO, "model")
    exporters = zoo._select(args.exporters, zoo.EXPORTERS, "exporter")
    try:
        import torch  # noqa: F401

        can_export = True
    except ImportError:
        can_export = False
    sources, missing = [], []
    for name in names:
        for exporter in exporters:
            path = zoo.onnx_path(args.cache, name, exporter)
            if path.exists():
                sources.append((f"{name}.{exporter}", str(path), None))
            elif can_export:
                sources.append((f"{name}.{exporter}", str(path), (name, exporter, args.cache)))
            else:
                missing.append(f"{name}.{exporter}")
    if missing:
        print(f"no .onnx file in {args.cache} and no torch to export: {', '.join(missing)}", flush=True)
    if not sources:
        print("falling back to the bundled example models (tvm_fusion.models)", flush=True)
        sources = [(n, n, None) for n in ("resnet18", "bert_layer", "mobilenet_block")]
    return sources


# -- stage 2: numerics and timing on the GPU ------------------------------------------------------
def load_onnx(source: str):
    import onnx

    from tvm_fusion import models

    return models.example(source) if source in models.EXAMPLES else onnx.load(source)


def ort_session(model, threads: int):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    providers = ["CPUExecutionProvider"]
    if "CUDAExecutionProvider" in ort.get_available_providers():
        providers = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    session = ort.InferenceSession(model.SerializeToString(), options, providers=providers)
    return session, session.get_providers()[0].replace("ExecutionProvider", "")


def check_on_gpu(source: str, so_path: str, runs: int) -> dict:
    import tvm

    import tvm_fusion
    from tvm_fusion.profiling import kernel_times

    model = load_onnx(source)
    feeds = zoo.feeds_for(model)
    session, provider = ort_session(model, os.cpu_count() or 1)
    reference = session.run(None, feeds)[0]
    loaded = tvm_fusion.load(so_path)
    out = loaded(*feeds.values())
    ours = np.asarray(out[0] if isinstance(out, list) else out)
    row = {"ort_provider": provider}
    if ours.shape != reference.shape:
        row["error"] = f"output shape {list(ours.shape)}, ONNX Runtime's {list(reference.shape)}"
        return row
    if not np.any(reference):
        row["error"] = "ONNX Runtime's output is all zeros: the comparison would check nothing"
        return row
    row["rel_err"] = float(np.max(np.abs(ours - reference)) / float(np.max(np.abs(reference))))
    row["ms_ours"] = round(float(np.median(loaded.latency_ms(*feeds.values(), number=max(runs // 5, 1)))), 3)
    # where the time goes: each kernel synchronised and timed alone (VM instrumentation); a
    # profile that fails costs the row nothing it has measured
    try:
        args = [tvm.runtime.tensor(v, loaded.device) for v in feeds.values()]
        top = kernel_times(loaded.vm, args, repeat=5, device=loaded.device)[:TOP_KERNELS]
        row["top_kernels"] = [[kernel, round(ms, 4), launches] for kernel, ms, launches in top]
    except Exception as err:
        row["profile_error"] = zoo._one_line(err)
    for _ in range(3):
        session.run(None, feeds)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        session.run(None, feeds)
        times.append((time.perf_counter() - start) * 1e3)
    row["ms_ort"] = round(float(np.median(times)), 3)
    return row


def torch_ms(zoo_name: str, runs: int, device: str = "cuda") -> float | None:
    """Median latency of the same model in PyTorch eager on ``device`` (FP32: TF32 off for convs
    and matmuls, as TVM computes), the anchor a GPU user would otherwise run; None without torch
    or without that device."""
    try:
        import torch
    except ImportError:
        return None
    if device == "cuda" and not torch.cuda.is_available():
        return None
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    model, args, _ = zoo.torch_model(zoo_name)
    model = model.to(device)
    args = tuple(a.to(device) for a in args)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    with torch.inference_mode():
        for _ in range(5):
            model(*args)
        sync()
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            model(*args)
            sync()
            times.append((time.perf_counter() - start) * 1e3)
    return round(float(np.median(times)), 3)


# -- stage 3: tune one kernel briefly -------------------------------------------------------------
def gemm_model():
    """One BERT-sized GEMM + bias (seq 128, 768 -> 3072): a single fused kernel to tune."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    weight = numpy_helper.from_array((rng.standard_normal((768, 3072)) * 0.02).astype(np.float32), "w")
    bias = numpy_helper.from_array(np.zeros(3072, np.float32), "b")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Add", ["y", "b"], ["out"])],
        "gemm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [128, 768])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [128, 3072])],
        initializer=[weight, bias],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def tune_one_kernel(target: dict, trials: int, log_root: str, time_budget_s: float | None = None) -> dict:
    """Tune the GEMM (the rule's own space, checked against the default schedule on the GPU)."""
    from tvm_fusion import tuning

    start = time.perf_counter()
    result = tuning.tune_model(
        gemm_model(),
        target,
        trials=trials,
        name="gemm_128x768x3072",
        log_root=log_root,
        progress=False,
        time_budget_s=time_budget_s,
    )
    return {"seconds": round(time.perf_counter() - start, 1), "trials": trials, "summary": str(result)}


def tune_whole_model(name: str, target: dict, minutes: float, log_root: str) -> dict:
    """``tvm-fusion tune NAME --minutes M --measure`` on the GPU: does tuning pay for a model?"""
    from tvm_fusion import tuning
    from tvm_fusion.benchmark import measure_speedup

    start = time.perf_counter()
    result = tuning.tune_model(
        name,
        target,
        trials=1_000_000,
        time_budget_s=minutes * 60,
        name=name,
        log_root=log_root,
        progress=False,
    )
    speedup = measure_speedup(name, target, tuning_logs=log_root)
    return {
        "model": name,
        "minutes": minutes,
        "seconds": round(time.perf_counter() - start, 1),
        "summary": str(result),
        "speedup": str(speedup),
    }


# -- report ---------------------------------------------------------------------------------------
def write_report(path: Path, header: dict, rows: dict, tuned: dict | None) -> None:
    import tvm

    lines = [
        "# CUDA check: the model zoo on a GPU",
        "",
        f"Written by `scripts/gpu_check.py` on {header['date']}: {header['gpu']}, target "
        f"`{json.dumps(header['target'])}`, TVM {tvm.__version__}, {os.cpu_count()} CPU cores "
        f"({platform.processor() or platform.machine()}). Models: scripts/zoo.py's exports "
        "(random weights, batch 1, 224x224 / 128 tokens), untuned default (dlight) schedules. "
        f"Numerics against ONNX Runtime (max |err| / max |ref|, target {REL_TOL:g}); latency medians, "
        "ours on the GPU (VM time_evaluator), ORT on the provider named per row, PyTorch eager on the "
        "GPU in FP32 (TF32 off) as the anchor a GPU user would otherwise run.",
        "",
    ]
    ok = [r for r in rows.values() if r.get("rel_err") is not None and r["rel_err"] <= REL_TOL]
    built = [r for r in rows.values() if "build_s" in r and "error" not in r]
    lines.append(
        f"**Summary:** {len(built)}/{len(rows)} built and exported; {len(ok)}/{len(rows)} match ORT within "
        f"{REL_TOL:g}{' (build-only run: nothing was run)' if header.get('build_only') else ''}."
    )
    lines += [
        "",
        "| model | ops → kernels | layout transforms | build s | max rel err | ms ORT | ORT on | ms torch | ms ours | × ORT | × torch |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    failures = []
    for name, r in rows.items():
        ratio = r["ms_ours"] / r["ms_ort"] if r.get("ms_ours") and r.get("ms_ort") else None
        vs_torch = r["ms_ours"] / r["ms_torch"] if r.get("ms_ours") and r.get("ms_torch") else None
        kernels = f"{r['ops']} → {r['kernels']}" if "kernels" in r else "—"
        lines.append(
            f"| {name} | {kernels} | {zoo._fmt(r.get('layout_transforms'), 'd')} | {zoo._fmt(r.get('build_s'), '.1f')} "
            f"| {zoo._fmt(r.get('rel_err'), '.1e')} | {zoo._fmt(r.get('ms_ort'), '.3f')} | {r.get('ort_provider', '—')} "
            f"| {zoo._fmt(r.get('ms_torch'), '.3f')} | {zoo._fmt(r.get('ms_ours'), '.3f')} "
            f"| {zoo._fmt(ratio, '.2f')} | {zoo._fmt(vs_torch, '.2f')} |"
        )
        if r.get("error"):
            failures.append(f"- {name}: `{r['error']}`")
    if failures:
        lines += ["", "## Failures", "", *failures]
    profiled = [(name, r["top_kernels"]) for name, r in rows.items() if r.get("top_kernels")]
    if profiled:
        lines += ["", "## Slowest kernels per model (ms per inference × launches, each synchronised)", ""]
        lines += [
            f"- {name}: " + ", ".join(f"`{k}` {ms:.3f}" + (f" ×{n}" if n > 1 else "") for k, ms, n in top)
            for name, top in profiled
        ]
    if tuned:
        lines += ["", "## Tuning one kernel (Meta-Schedule, BERT-sized GEMM 128×768×3072 + bias)", ""]
        if tuned.get("error"):
            lines.append(f"failed: `{tuned['error']}`")
        else:
            lines += [
                f"{tuned['trials']} trials in {tuned['seconds']} s:",
                "",
                "```",
                tuned["summary"],
                "```",
            ]
        whole = tuned.get("whole_model")
        if whole:
            lines += [
                "",
                f"## Tuning a whole model ({whole.get('model')}, `--minutes {whole.get('minutes')}`)",
                "",
            ]
            if whole.get("error"):
                lines.append(f"failed: `{whole['error']}`")
            else:
                lines += [
                    f"{whole['seconds']} s, tuning and the interleaved tuned/untuned timing:",
                    "",
                    "```",
                ]
                lines += [whole["speedup"], "", whole["summary"], "```"]
    path.parent.mkdir(parents=True, exist_ok=True)
    old = path.read_text() if path.exists() else ""
    notes = old[old.index(NOTES_MARKER) :] if NOTES_MARKER in old else ""  # hand-written, kept
    path.write_text("\n".join(lines) + "\n" + ("\n" + notes if notes else ""))
    # the raw rows beside the table, for scripts (and for a run cut short)
    raw = {"header": header, "rows": rows, "tuned": tuned}
    path.with_suffix(".json").write_text(json.dumps(raw, indent=1, default=str) + "\n")


# -- main -----------------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK_MODELS)}; 16 tuning trials")
    p.add_argument("--build-only", action="store_true", help="build and export for CUDA; no GPU needed")
    p.add_argument("--cache", type=Path, default=zoo.DEFAULT_CACHE, help="folder of the zoo's .onnx files")
    p.add_argument("--models", help=f"comma-separated subset of: {', '.join(zoo.ZOO)}")
    p.add_argument(
        "--exporters", default="torchscript", help="torchscript and/or dynamo (default torchscript)"
    )
    p.add_argument("--arch", help="CUDA arch, e.g. sm_90 (default: the GPU's; sm_80 with --build-only)")
    p.add_argument(
        "--workers", type=int, default=None, help="parallel build processes (default cores/2, <= 8)"
    )
    p.add_argument("--budget", type=int, default=540, help="seconds for the whole run (default 540)")
    p.add_argument("--trials", type=int, default=None, help="tuning trials for the one kernel (default 64)")
    p.add_argument("--runs", type=int, default=50, help="timed runs per side (default 50)")
    p.add_argument(
        "--tune-model",
        default="bert_layer",
        help="bundled example to tune whole after the one kernel, when the budget allows (default bert_layer)",
    )
    p.add_argument(
        "--tune-minutes", type=float, default=0, help="its tuning budget in minutes (default 0: not tuned)"
    )
    p.add_argument("--out", type=Path, default=zoo.REPO / "docs" / "cuda.md")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    started = time.monotonic()
    deadline = started + args.budget
    arch = args.arch
    if not args.build_only:
        found = gpu_arch()
        if found is None:
            print(no_gpu_message(), file=sys.stderr)
            return 2
        arch = arch or found
    target = {"kind": "cuda", "arch": arch or "sm_80"}
    header = {
        "date": datetime.date.today().isoformat(),
        "gpu": "no GPU (build only)" if args.build_only else _gpu_name(),
        "target": target,
        "build_only": args.build_only,
    }
    sources = model_sources(args)
    rows: dict[str, dict] = {name: {} for name, _, _ in sources}
    workdir = Path(tempfile.mkdtemp(prefix="gpu_check."))
    workers = args.workers or max(1, min(8, (os.cpu_count() or 2) // 2))
    print(
        f"exporting/building {len(sources)} models for {json.dumps(target)} with {workers} workers",
        flush=True,
    )
    context = multiprocessing.get_context("spawn")  # no forked TVM runtime state in the workers
    with futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        pending = {
            pool.submit(build_one, src, name, target, str(workdir / f"{name}.so"), job): name
            for name, src, job in sources
        }
        build_deadline = started + args.budget * (0.9 if args.build_only else 0.55)
        try:
            for done in futures.as_completed(pending, timeout=max(build_deadline - time.monotonic(), 1)):
                name = pending[done]
                rows[name].update(done.result())
                print(f"{name}: {json.dumps(rows[name])}", flush=True)
                write_report(args.out, header, rows, None)
        except futures.TimeoutError:
            for fut, name in pending.items():
                if not fut.done():
                    fut.cancel()
                    rows[name].setdefault("error", "build not finished within the time budget")
            pool.shutdown(wait=False, cancel_futures=True)
    write_report(args.out, header, rows, None)
    if args.build_only:
        print(f"wrote {args.out}")
        return 0 if all("error" not in r for r in rows.values()) else 1
    sources_by_name = {name: src for name, src, _ in sources}
    torch_times: dict[str, float | None] = {}
    for name, row in rows.items():
        if "error" in row or time.monotonic() > deadline - 60:
            row.setdefault("error", "not run: time budget")
            continue
        try:
            row.update(check_on_gpu(sources_by_name[name], str(workdir / f"{name}.so"), args.runs))
        except Exception as err:
            row["error"] = zoo._one_line(err)
        zoo_name = name.split(".")[0]
        if zoo_name in zoo.ZOO and "error" not in row:
            try:
                if zoo_name not in torch_times:  # one eager timing serves both exporters' rows
                    torch_times[zoo_name] = torch_ms(zoo_name, args.runs)
                row["ms_torch"] = torch_times[zoo_name]
            except Exception as err:
                row["torch_error"] = zoo._one_line(err)
        print(f"{name}: {json.dumps(row)}", flush=True)
        write_report(args.out, header, rows, None)
    tuned = None
    left = deadline - time.monotonic()
    if left > 45:
        trials = args.trials or (16 if args.quick else 64)
        try:
            tuned = tune_one_kernel(target, trials, str(workdir / "tuning_logs"), left - 20)
        except Exception as err:
            tuned = {"error": zoo._one_line(err)}
        print(json.dumps(tuned)[:2000], flush=True)
        write_report(args.out, header, rows, tuned)
        left = deadline - time.monotonic()
        if args.tune_minutes and left > args.tune_minutes * 60 + 60:  # + the two builds and timing
            try:
                whole = tune_whole_model(
                    args.tune_model, target, args.tune_minutes, str(workdir / "tuning_logs")
                )
            except Exception as err:
                whole = {"model": args.tune_model, "minutes": args.tune_minutes, "error": zoo._one_line(err)}
            tuned["whole_model"] = whole
            print(json.dumps(whole)[:3000], flush=True)
    else:
        tuned = {"error": f"skipped: {left:.0f} s of the time budget left"}
    write_report(args.out, header, rows, tuned)
    print(f"wrote {args.out} ({time.monotonic() - started:.0f} s)")
    failed = [n for n, r in rows.items() if r.get("error") or (r.get("rel_err") or 0) > REL_TOL]
    return 1 if failed else 0


def _gpu_name() -> str:
    import tvm

    device = tvm.cuda(0)
    name = getattr(device, "device_name", None) or "CUDA GPU"
    return f"{name} ({device.compute_version})"


if __name__ == "__main__":
    sys.exit(main())

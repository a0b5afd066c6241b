#!/usr/bin/env python3
"""The model zoo: real torchvision / Hugging Face models through both torch ONNX exporters.

Needs the ``zoo`` extra (torch, torchvision, transformers, onnxscript) for exporting; building and
checking the cached ``.onnx`` files needs only the project itself.

    python scripts/zoo.py export                     # export every model with both exporters
    python scripts/zoo.py run --models resnet18,bert # build (llvm + cuda) -> numerics -> timing
    python scripts/zoo.py run --skip-timing --exporters torchscript
    python scripts/zoo.py report                     # docs/zoo.md + docs/zoo.png from the results

Weights are random (torchvision ``weights=None``; Hugging Face models from a ``Config``, never
downloaded), ``model.eval()``, batch 1, 224x224 images, 128 tokens. Exports go to a cache folder
(``--cache``, default /work/zoo/onnx, never committed) as ``<model>.<exporter>.onnx``. Results are
kept per model and exporter in ``<cache>/../results.json``, so a run can stop and resume, and
``--models``/``--exporters`` run a part of the zoo; ``report`` writes the table from all results.
``--note "..."`` (``run`` or ``report``) adds a dated entry to the report's measurement history,
which every rewrite of the report keeps.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

DEFAULT_CACHE = Path(os.environ.get("TVM_FUSION_ZOO", "/work/zoo/onnx"))
REPO = Path(__file__).resolve().parent.parent
CUDA_TARGET = {"kind": "cuda", "arch": "sm_80"}
REL_TOL = 1e-4  # the zoo's numerics target: max |ours - ORT| / max |ORT|
EXPORTERS = ("torchscript", "dynamo")
IMAGE = (1, 3, 224, 224)
SEQ = 128


@dataclasses.dataclass(frozen=True)
class ZooModel:
    name: str
    source: str  # "torchvision" or "transformers"
    builder: str  # torchvision function name, or the transformers model class


VISION = [
    "resnet18",
    "resnet50",
    "mobilenet_v2",
    "mobilenet_v3_small",
    "efficientnet_b0",
    "squeezenet1_1",
    "densenet121",
    "shufflenet_v2_x1_0",
    "convnext_tiny",
    "regnet_y_400mf",
    "vit_b_16",
]
TEXT = {"bert": "BertModel", "distilbert": "DistilBertModel", "roberta": "RobertaModel", "gpt2": "GPT2Model"}
TEXT["t5_encoder"] = "T5EncoderModel"

ZOO: dict[str, ZooModel] = {n: ZooModel(n, "torchvision", n) for n in VISION}
ZOO.update({n: ZooModel(n, "transformers", cls) for n, cls in TEXT.items()})


def _hf_config(name: str):
    """The published architecture of each checkpoint, as a Config (no download)."""
    import transformers as tf

    if name == "bert":  # bert-base-uncased
        return tf.BertConfig()
    if name == "distilbert":  # distilbert-base-uncased
        return tf.DistilBertConfig()
    if name == "roberta":  # roberta-base
        return tf.RobertaConfig(
            vocab_size=50265,
            max_position_embeddings=514,
            type_vocab_size=1,
            pad_token_id=1,
            layer_norm_eps=1e-5,
        )
    if name == "gpt2":  # gpt2 (124M)
        return tf.GPT2Config()
    if name == "t5_encoder":  # t5-small
        return tf.T5Config(d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_heads=8, vocab_size=32128)
    raise KeyError(name)


def torch_model(name: str):
    """``(module in eval mode, example inputs, input names)`` with seeded random weights."""
    import torch

    torch.manual_seed(0)
    spec = ZOO[name]
    if spec.source == "torchvision":
        import torchvision

        model = getattr(torchvision.models, spec.builder)(weights=None).eval()
        _no_zero_layers(model)
        _calibrate_batch_norm(model)
        return model, (torch.randn(*IMAGE),), ["input"]

    import transformers

    inner = getattr(transformers, spec.builder)(_hf_config(name)).eval()

    class LastHidden(torch.nn.Module):
        """What a user exports: ids + mask in, the last hidden state out."""

        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask):
            return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    ids = torch.randint(0, 1000, (1, SEQ), dtype=torch.int64)
    mask = torch.ones(1, SEQ, dtype=torch.int64)
    return LastHidden(inner).eval(), (ids, mask), ["input_ids", "attention_mask"]


def _no_zero_layers(model) -> None:
    """Random weights for layers initialised to zero (vit_b_16's classifier head): an all-zero
    output would make the comparison with ONNX Runtime check nothing."""
    import torch

    with torch.no_grad():
        for module in model.modules():
            weight = getattr(module, "weight", None)
            if isinstance(weight, torch.Tensor) and weight.dim() >= 2 and not weight.any():
                torch.nn.init.normal_(weight, std=0.02)


def _calibrate_batch_norm(model, shape=IMAGE, batch: int = 8, rounds: int = 2) -> None:
    """Running statistics from ``rounds`` random batches of ``batch`` inputs of ``shape`` (its
    first dim ignored), as training would leave them.

    With untrained statistics (mean 0, variance 1) the eval-mode BatchNorms normalise nothing and
    activations shrink layer by layer (mobilenet_v2's output ~1e-9, efficientnet_b0's ~1e-14), so
    a comparison would see little of the network."""
    import torch

    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if not norms:
        return
    for norm in norms:
        norm.reset_running_stats()
        norm.momentum = None  # a plain average over the batches
    model.train()
    with torch.no_grad():
        for _ in range(rounds):
            model(torch.randn(batch, *shape[1:]))
    model.eval()


def onnx_path(cache: Path, name: str, exporter: str) -> Path:
    return cache / f"{name}.{exporter}.onnx"


EXPORT_NOTE = "tvm_fusion.zoo.export_note"  # ONNX metadata: how the file had to be exported


def export(name: str, exporter: str, cache: Path, force: bool = False) -> Path:
    """Export one model with one exporter (atomically: readers never see a half-written file).

    A Hugging Face model whose export fails with its default attention (SDPA) is exported again
    with ``attn_implementation="eager"``, as a user would work around an exporter bug: torch
    2.14's dynamo exporter cannot trace T5's SDPA path (``Cannot view a tensor with shape [1, 128,
    8, 64] ... as (1, 128, 512)`` in its decompositions). The file's metadata says so
    (``EXPORT_NOTE``), and the zoo report shows it."""
    import onnx

    path = onnx_path(cache, name, exporter)
    if path.exists() and not force:
        return path
    cache.mkdir(parents=True, exist_ok=True)
    model, args, input_names = torch_model(name)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".onnx", dir=cache)
    os.close(fd)
    try:
        note = ""
        try:
            _torch_export(model, args, input_names, exporter, tmp)
        except Exception as err:
            config = getattr(getattr(model, "model", None), "config", None)
            if getattr(config, "_attn_implementation", None) != "sdpa":
                raise
            if hasattr(model.model, "set_attn_implementation"):
                model.model.set_attn_implementation("eager")
            else:  # an older transformers
                config._attn_implementation = "eager"
            _torch_export(model, args, input_names, exporter, tmp)
            note = f"exported with eager attention: with SDPA, torch.onnx failed ({_root_cause(err)})"
        if note:
            exported = onnx.load(tmp)
            onnx.helper.set_model_props(exported, {EXPORT_NOTE: note})
            onnx.save(exported, tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _torch_export(model, args, input_names, exporter: str, path: str) -> None:
    import torch

    # as users call it: not under torch.no_grad(), where nn.MultiheadAttention takes its fused
    # fast path (aten::_native_multi_head_attention), which the TorchScript exporter cannot write
    if exporter == "torchscript":
        torch.onnx.export(
            model,
            args,
            path,
            dynamo=False,
            opset_version=17,
            input_names=input_names,
            output_names=["output"],
        )
    else:
        torch.onnx.export(
            model,
            args,
            path,
            dynamo=True,
            external_data=False,
            input_names=input_names,
            output_names=["output"],
        )


def _root_cause(err: BaseException) -> str:
    """The first line of the innermost exception (torch.onnx wraps the one that says what failed)."""
    while True:
        inner = err.__cause__ or (None if err.__suppress_context__ else err.__context__)
        if inner is None:
            break
        err = inner
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    return f"{type(err).__name__}: {lines[0] if lines else ''}"[:200]


def export_note(model) -> str:
    """The note ``export`` left in an ONNX file's metadata, or ''."""
    return next((p.value for p in model.metadata_props if p.key == EXPORT_NOTE), "")


def feeds_for(model, vocab: int = 1000) -> dict[str, np.ndarray]:
    """Inputs for a zoo model: images ~ N(0, 1); token ids in [0, min(1000, vocab)); attention
    mask all ones."""
    rng = np.random.default_rng(0)
    inits = {i.name for i in model.graph.initializer}
    feeds = {}
    for inp in model.graph.input:
        if inp.name in inits:
            continue
        shape = [d.dim_value if d.dim_value > 0 else 1 for d in inp.type.tensor_type.shape.dim]
        if "mask" in inp.name:
            feeds[inp.name] = np.ones(shape, np.int64)
        elif inp.type.tensor_type.elem_type == 7:  # int64 ids
            feeds[inp.name] = rng.integers(0, min(1000, vocab), shape).astype(np.int64)
        else:
            feeds[inp.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


# -- one model, one exporter (run in a child process: a crash or a hang costs one row) -----------
def check_one(name: str, exporter: str, cache: Path, out: Path, targets, timing: bool, runs: int) -> None:
    """Build, check and time one export; ``out`` (JSON) is rewritten after every stage."""
    import onnx
    import tvm

    from tvm_fusion import build
    from tvm_fusion.benchmark import interleaved_ms, ort_variant
    from tvm_fusion.fma_peak import fma_peak_gflops
    from tvm_fusion.profiling import kernel_times
    from tvm_fusion.targets import llvm_target

    row = {"model": name, "exporter": exporter, "date": datetime.date.today().isoformat()}

    def save(**fields):
        row.update(fields)
        out.write_text(json.dumps(row, indent=1))

    path = onnx_path(cache, name, exporter)
    if not path.exists():
        save(llvm_error=f"{path}: not exported (run `scripts/zoo.py export` with the zoo extra)")
        return
    model = onnx.load(str(path))
    note = export_note(model)
    if note:
        save(export_note=note)
    feeds = feeds_for(model)
    target = llvm_target()
    threads = int(target.attrs["num-cores"])
    ort = ort_variant(model, feeds, threads)
    reference = np.asarray(ort.output)
    del model
    if "llvm" in targets:
        try:
            start = time.perf_counter()
            result = build(str(path), target, name=f"{name}.{exporter}", tuning_logs=None)
            save(
                llvm_build_s=round(time.perf_counter() - start, 1),
                ops=result.summary.ops,
                kernels=result.summary.kernels,
                gflop=_gflop(result.model.mod),
            )
            vm = tvm.relax.VirtualMachine(result.executable, tvm.cpu())
            args = [tvm.runtime.tensor(v) for v in feeds.values()]
            save(rel_err=relative_error(vm, args, reference))
            if timing:
                ms_ort, ms_ours = interleaved_ms([ort.run, lambda: vm["main"](*args)], runs)
                top = kernel_times(vm, args, repeat=3)[:5]
                save(
                    ms_ort=ms_ort,
                    ms_ours=ms_ours,
                    threads=threads,
                    top_kernels=[[k, round(ms, 3), n] for k, ms, n in top],
                )
                try:  # the machine the row ran on; its timings are saved whatever this does
                    save(fma_peak_gflops=round(fma_peak_gflops(target), 1))
                except Exception as err:
                    save(fma_peak_error=_one_line(err))
            del vm, result
        except Exception as err:
            save(llvm_error=_one_line(err))
    if "cuda" in targets:
        try:
            start = time.perf_counter()
            result = build(str(path), CUDA_TARGET, name=f"{name}.{exporter}", tuning_logs=None)
            with tempfile.TemporaryDirectory() as tmp:
                result.export(Path(tmp) / "model.so")
            save(
                cuda_build_s=round(time.perf_counter() - start, 1),
                cuda_kernels=result.summary.kernels,
                cuda_layout_transforms=result.summary.layout_transforms,
            )
        except Exception as err:
            save(cuda_error=_one_line(err))


def _gflop(mod) -> float:
    """GFLOP of one inference of an imported Relax module (``report.model_flops``: convs as direct
    convolutions, matmuls; other ops one per output element)."""
    from tvm_fusion.report import model_flops

    return round(model_flops(mod) / 1e9, 3)


def model_gflop(model) -> float | None:
    """:func:`_gflop` of an ONNX model (for results stored before the count), None if it does not
    import."""
    from tvm_fusion.frontend import import_onnx

    try:
        return _gflop(import_onnx(model).mod)
    except Exception:  # the llvm run reports the import error itself
        return None


def relative_error(vm, args, reference: np.ndarray) -> float:
    """``max |ours - reference| / max |reference|`` of ``vm["main"](*args)``'s (first) output;
    raises when the shapes differ or the reference is all zeros or subnormal (it would check
    nothing: HF MobileViT with uncalibrated BatchNorms ends at ~1e-40, where any two fp32
    computations differ by 10-100 %)."""
    import tvm

    ours = vm["main"](*args)
    ours = (ours if isinstance(ours, tvm.runtime.Tensor) else ours[0]).numpy()
    if ours.shape != reference.shape:
        raise RuntimeError(f"output shape {list(ours.shape)}, ONNX Runtime's {list(reference.shape)}")
    scale = float(np.max(np.abs(reference)))
    if scale < np.finfo(np.float32).tiny:
        raise RuntimeError(
            f"ONNX Runtime's output is {'all zeros' if scale == 0 else f'subnormal (max |value| {scale:.1e})'}: "
            "the comparison would check nothing"
        )
    return float(np.max(np.abs(ours - reference)) / scale)


def _one_line(err: BaseException) -> str:
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    return f"{type(err).__name__}: {lines[-1] if lines else ''}"[:400]


# -- results and report ---------------------------------------------------------------------------
def results_path(cache: Path) -> Path:
    return cache.parent / "results.json"


def load_results(cache: Path) -> dict:
    path = results_path(cache)
    return json.loads(path.read_text()) if path.exists() else {}


# the fields each target's run writes: a run of one target keeps the other's from before
TARGET_FIELDS = {
    "llvm": (
        "gflop",
        "llvm_build_s",
        "llvm_error",
        "ops",
        "kernels",
        "rel_err",
        "ms_ort",
        "ms_ours",
        "threads",
        "top_kernels",
    ),
    "cuda": ("cuda_build_s", "cuda_error", "cuda_kernels", "cuda_layout_transforms"),
}


def store_result(cache: Path, row: dict, targets=tuple(TARGET_FIELDS)) -> None:
    results = load_results(cache)
    key = f"{row['model']}.{row['exporter']}"
    previous = results.get(key, {})
    for target, fields in TARGET_FIELDS.items():
        if target not in targets:
            row.update({f: previous[f] for f in fields if f in previous and f not in row})
    results[key] = row
    path = results_path(cache)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1, sort_keys=True))
    os.replace(tmp, path)


def _ok(row: dict, target: str) -> bool:
    if target == "llvm":
        return "llvm_error" not in row and row.get("rel_err") is not None and row["rel_err"] <= REL_TOL
    return "cuda_error" not in row and row.get("cuda_build_s") is not None


def write_report(results: dict, md: Path, png: Path, note: str = "") -> None:
    import onnxruntime
    import tvm

    rows = [results[k] for k in sorted(results, key=_order)]
    ratios = [r["ms_ours"] / r["ms_ort"] for r in rows if r.get("ms_ours") and r.get("ms_ort")]
    n = len(rows)
    llvm_ok = sum(_ok(r, "llvm") for r in rows)
    cuda_ok = sum(_ok(r, "cuda") for r in rows)
    expected = len(ZOO) * len(EXPORTERS)
    threads = next((r["threads"] for r in rows if r.get("threads")), None)
    peak, peak_source = machine_peak(rows, threads)
    peak_text = (
        f" FMA peak: {peak:.0f} GFLOP/s, {peak_source} by `tvm_fusion.fma_peak` (independent FMA "
        "chains on every core, no memory traffic); % peak = GFLOP/s ours over it."
        if peak
        else ""
    )
    lines = [
        "# Model zoo: real torch exports",
        "",
        "Written by `scripts/zoo.py` (`python scripts/zoo.py run`, then `report`). Each torchvision / "
        "Hugging Face model is exported with random weights by both torch exporters (TorchScript: "
        "`torch.onnx.export(..., dynamo=False, opset_version=17)`; dynamo: `dynamo=True`), batch 1, "
        "224x224 images or 128 tokens, then built by tvm_fusion for this CPU (llvm, untuned default "
        "schedules) and checked against ONNX Runtime; the same file is built and exported for CUDA "
        f"(`{json.dumps(CUDA_TARGET)}`, build + export only: no GPU here).",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, shared with other "
        f"work while measured (timings are noisy; ratios come from ORT and ours timed side by side in one "
        f"process, interleaved, {threads or 'all'} threads each). TVM {tvm.__version__}, ONNX Runtime "
        f"{onnxruntime.__version__}. Dates per row are in the results file. GFLOP/s: the model's FLOPs "
        f"counted as direct convolutions and matmuls, over our latency (Winograd convs do fewer, so conv "
        f"nets can read above the machine's FMA peak).{peak_text} Which rows were measured again "
        "when, and why: the measurement history at the end.",
        "",
        f"**Summary:** {n} of {expected} model/exporter pairs run; llvm build + numerics within "
        f"{REL_TOL:g} relative: **{llvm_ok}/{n}**; CUDA build + export: **{cuda_ok}/{n}**.",
    ]
    if ratios:
        lines.append(
            f"× ORT (ours / ORT latency): median {np.median(ratios):.2f}, max {max(ratios):.2f}, "
            f"{sum(x <= 1.0 for x in ratios)} of {len(ratios)} at or below 1.0."
        )
    lines += [
        "",
        "| model | exporter | ops → kernels | build s (llvm) | max rel err | ms ORT | ms ours | × ORT | "
        "GFLOP/s ours | % peak | build s (cuda) | cuda kernels (layout transforms) |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    failures = []
    for r in rows:
        ratio = r["ms_ours"] / r["ms_ort"] if r.get("ms_ours") and r.get("ms_ort") else None
        rate = r["gflop"] / r["ms_ours"] * 1e3 if r.get("gflop") and r.get("ms_ours") else None
        err = r.get("rel_err")
        err_text = _fmt(err, ".1e") + ("" if err is None or err <= REL_TOL else " ✗")
        cuda = (
            f"{r['cuda_kernels']} ({r['cuda_layout_transforms']})"
            if r.get("cuda_kernels") is not None
            else "—"
        )
        kernels = f"{r['ops']} → {r['kernels']}" if r.get("kernels") is not None else "—"
        lines.append(
            f"| {r['model']} | {r['exporter']} | {kernels} | {_fmt(r.get('llvm_build_s'), '.1f')} | "
            f"{err_text} | {_fmt(r.get('ms_ort'), '.2f')} | {_fmt(r.get('ms_ours'), '.2f')} | "
            f"{_fmt(ratio, '.2f')} | {_fmt(rate, '.0f')} | {_fmt(None if rate is None or not peak else 100 * rate / peak, '.0f')} | "
            f"{_fmt(r.get('cuda_build_s'), '.1f')} | {cuda} |"
        )
        for key in ("llvm_error", "cuda_error"):
            if r.get(key):
                failures.append(f"- {r['model']} ({r['exporter']}, {key.split('_')[0]}): `{r[key]}`")
    if failures:
        lines += ["", "## Failures", "", *failures]
    notes = [f"- {r['model']} ({r['exporter']}): {r['export_note']}" for r in rows if r.get("export_note")]
    if notes:
        lines += ["", "## Export notes", "", *notes]
    slow = [r for r in rows if r.get("top_kernels")]
    if slow:
        lines += [
            "",
            "## Slowest kernels per model (ours, VM instrumentation, ms per inference × launches)",
            "",
        ]
        for r in slow:
            top = ", ".join(
                f"`{k}` {ms:.2f}" + (f" ×{c}" if c > 1 else "") for k, ms, c in r["top_kernels"][:3]
            )
            lines.append(f"- {r['model']} ({r['exporter']}): {top}")
    md.write_text("\n".join(lines + history_section(md, note)) + "\n")
    md.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    _plot(rows, png)


HISTORY_HEADING = "## Measurement history (newest first)"


def history_section(md: Path, note: str) -> list[str]:
    """A report's measurement history: ``note`` as a new dated entry above the entries ``md``
    already holds; [] when there are none."""
    history = previous_history(md)
    if note:  # one line: the next rewrite keeps only the entries' lines
        history.insert(0, f"- {datetime.date.today().isoformat()}: {' '.join(note.split())}")
    return ["", HISTORY_HEADING, "", *history] if history else []


def previous_history(md: Path) -> list[str]:
    """The history bullets of the report ``md`` already holds: each run's ``--note`` (which rows
    were timed again, and why) stays when the report is rewritten, by ``run`` too."""
    if not md.exists():
        return []
    lines = md.read_text().splitlines()
    if HISTORY_HEADING not in lines:
        return []
    bullets = []
    for line in lines[lines.index(HISTORY_HEADING) + 1 :]:
        if line.startswith("## "):
            break
        if line.startswith("- "):
            bullets.append(line)
    return bullets


def machine_peak(rows: list[dict], threads: int | None) -> tuple[float | None, str]:
    """The FMA peak the rows' GFLOP/s are compared with, and where it comes from: the median of
    the peaks measured with the rows (in the timing child), or, for results stored before rows
    carried one, measured now with the rows' thread count; None when no row has a rate."""
    if not any(r.get("gflop") and r.get("ms_ours") for r in rows):
        return None, "not measured: no row has a rate"
    measured = [r["fma_peak_gflops"] for r in rows if r.get("fma_peak_gflops")]
    if measured:
        return float(np.median(measured)), f"the median of the peaks stored with the rows ({len(measured)})"
    from tvm_fusion.fma_peak import fma_peak_gflops
    from tvm_fusion.targets import llvm_target

    today = datetime.date.today().isoformat()
    return fma_peak_gflops(llvm_target(num_cores=threads)), f"measured when this report was written ({today})"


def _order(key: str):
    name, exporter = key.rsplit(".", 1)
    names = list(ZOO)
    return (names.index(name) if name in names else len(names), EXPORTERS.index(exporter))


def _fmt(value, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def _plot(rows, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in rows if r.get("ms_ours") and r.get("ms_ort")]
    if not timed:
        return
    labels = [f"{r['model']} ({r['exporter']})" for r in timed]
    ratios = [r["ms_ours"] / r["ms_ort"] for r in timed]
    fig, ax = plt.subplots(figsize=(8, 0.28 * len(timed) + 1.2))
    colors = ["C2" if x <= 1.0 else "C3" for x in ratios]
    ax.barh(range(len(timed)), ratios, color=colors)
    ax.axvline(1.0, color="k", lw=1)
    ax.set_yticks(range(len(timed)))
    ax.set_yticklabels(labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("latency × ONNX Runtime (lower is better; 1.0 = parity)")
    ax.set_title("tvm_fusion (llvm, untuned) vs ONNX Runtime, same threads")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


# -- command line ---------------------------------------------------------------------------------
def _select(text: str | None, known, what: str) -> list[str]:
    if not text:
        return list(known)
    chosen = [t.strip() for t in text.split(",") if t.strip()]
    bad = [c for c in chosen if c not in known]
    if bad:
        raise SystemExit(f"error: unknown {what} {bad}; known: {', '.join(known)}")
    return chosen


def cmd_export(args) -> int:
    failed = 0
    for name in _select(args.models, ZOO, "model"):
        for exporter in _select(args.exporters, EXPORTERS, "exporter"):
            start = time.perf_counter()
            try:
                path = export(name, exporter, args.cache, force=args.force)
                print(f"{name}.{exporter}: {path} ({time.perf_counter() - start:.0f} s)", flush=True)
            except Exception as err:  # report and go on: one model's exporter bug must not stop the zoo
                failed += 1
                line = (str(err).strip().splitlines() or [type(err).__name__])[-1]
                print(f"{name}.{exporter}: export failed: {type(err).__name__}: {line}", flush=True)
                if args.verbose:
                    traceback.print_exc()
    return 1 if failed else 0


def cmd_run(args) -> int:
    targets = _select(args.targets, ("llvm", "cuda"), "target")
    done = load_results(args.cache) if args.resume else {}
    for name in _select(args.models, ZOO, "model"):
        for exporter in _select(args.exporters, EXPORTERS, "exporter"):
            key = f"{name}.{exporter}"
            if key in done:
                print(f"{key}: done before (--resume), skipped", flush=True)
                continue
            if not onnx_path(args.cache, name, exporter).exists():
                try:
                    export(name, exporter, args.cache)
                except Exception as err:
                    store_result(
                        args.cache, {"model": name, "exporter": exporter, "llvm_error": _one_line(err)}
                    )
                    print(f"{key}: export failed: {_one_line(err)}", flush=True)
                    continue
            row = _run_child(name, exporter, args, targets)
            store_result(args.cache, row, targets)
            print(f"{key}: {json.dumps({k: v for k, v in row.items() if k != 'top_kernels'})}", flush=True)
    write_report(load_results(args.cache), args.out, args.out.with_suffix(".png"), args.note)
    print(f"wrote {args.out}", flush=True)
    return 0


def _run_child(name, exporter, args, targets) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        command = [
            sys.executable,
            __file__,
            "one",
            name,
            exporter,
            "--cache",
            str(args.cache),
            "--out",
            str(out),
        ]
        command += ["--targets", ",".join(targets), "--runs", str(args.runs)]
        command += ["--skip-timing"] if args.skip_timing else []
        try:
            proc = subprocess.run(command, timeout=args.timeout, capture_output=True, text=True)
            failure = (
                None if proc.returncode == 0 else f"crashed (exit {proc.returncode}): {_tail(proc.stderr)}"
            )
        except subprocess.TimeoutExpired:
            failure = f"timed out after {args.timeout} s"
        row = json.loads(out.read_text()) if out.exists() else {"model": name, "exporter": exporter}
    if failure:  # the stage that was running when the child died
        stage = "cuda" if "llvm" not in targets or "rel_err" in row or "llvm_error" in row else "llvm"
        row[f"{stage}_error"] = failure
    return row


def _tail(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


def cmd_one(args) -> int:
    targets = _select(args.targets, ("llvm", "cuda"), "target")
    check_one(args.model, args.exporter, args.cache, args.out, targets, not args.skip_timing, args.runs)
    return 0


def _fill_gflop(cache: Path) -> None:
    """Count the FLOPs of stored rows that predate the ``gflop`` field, from their cached export."""
    import onnx

    for key, row in load_results(cache).items():
        path = onnx_path(cache, row["model"], row["exporter"])
        if "gflop" not in row and path.exists():
            row["gflop"] = model_gflop(onnx.load(str(path)))
            store_result(cache, row)
            print(f"{key}: {row['gflop']} GFLOP", flush=True)


def cmd_report(args) -> int:
    _fill_gflop(args.cache)
    write_report(load_results(args.cache), args.out, args.out.with_suffix(".png"), args.note)
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    commands = [
        ("export", cmd_export, "export the zoo to the cache folder"),
        ("run", cmd_run, "build, check and time the zoo; writes docs/zoo.md"),
        ("report", cmd_report, "rewrite docs/zoo.md, .json and .png from the stored results"),
        ("one", cmd_one, "(internal) one model and exporter, in a child process"),
    ]
    for name, func, help_text in commands:
        s = sub.add_parser(name, help=help_text)
        s.set_defaults(func=func)
        s.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="folder of the exported .onnx files")
        if name in ("export", "run"):
            s.add_argument("--models", help=f"comma-separated subset of: {', '.join(ZOO)}")
            s.add_argument("--exporters", help="comma-separated subset of: torchscript,dynamo")
        if name in ("run", "one"):
            s.add_argument("--targets", default="llvm,cuda", help="llvm and/or cuda (default both)")
            s.add_argument("--skip-timing", action="store_true", help="build and check numerics only")
            s.add_argument("--runs", type=int, default=15, help="timed runs of each side (default 15)")
        if name in ("run", "report"):
            s.add_argument("--out", type=Path, default=REPO / "docs" / "zoo.md")
            s.add_argument(
                "--note", default="", help="what this run measured again and why: a new history entry"
            )
        s.add_argument("-v", "--verbose", action="store_true")
    sub.choices["export"].add_argument("--force", action="store_true", help="re-export existing files")
    sub.choices["run"].add_argument("--resume", action="store_true", help="skip pairs already in the results")
    sub.choices["run"].add_argument(
        "--timeout", type=int, default=1800, help="seconds per model and exporter"
    )
    one = sub.choices["one"]
    one.add_argument("model", choices=list(ZOO))
    one.add_argument("exporter", choices=EXPORTERS)
    one.add_argument("--out", type=Path, required=True)
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

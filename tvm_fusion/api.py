"""Public entry points: ``optimize`` (IRModule -> lowered IRModule), ``build``, ``export``, ``load``.

``build`` accepts what users have: an ``.onnx`` path, an ``onnx.ModelProto``, or a Relax
``IRModule``. It finds matching tuning records by itself (model hash + target) and reports how
many kernels used tuned versus default schedules.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import tvm
from tvm import relax

from . import __version__
from .errors import TargetError, TvmFusionError, last_line
from .frontend import ImportedModel, as_imported
from .loaded import LoadedModel, check_input, load  # noqa: F401  (re-exported)
from .module_file import export_library
from .pipeline import build_pipeline, pipeline_passes, pipeline_stages, run_passes, tir_pipeline
from .report import Summary, summarize
from .shape_cache import add_shape_buckets
from .targets import check_can_build, parse_target, target_json
from .tuning.records import load_records

FIND_FAILING_KERNEL_S = 60.0  # spent looking for the kernel a failed build fails on

DEFAULT_TUNING_LOGS = "tuning_logs"


def optimize(mod: tvm.IRModule, target="llvm", policy=None, **options) -> tvm.IRModule:
    """Run the tvm_fusion pipeline; the result is ready for ``tvm.compile(mod, target)``."""
    target = parse_target(target)
    return run_passes(mod, pipeline_passes(target, policy, **options), target)


@dataclasses.dataclass
class BuildResult:
    executable: relax.VMExecutable
    target: tvm.target.Target
    model: ImportedModel
    lowered: tvm.IRModule
    summary: Summary
    tuned_kernels: int = 0
    default_kernels: int = 0
    records_note: str = ""
    records_status: str = ""  # "ok", "missing", "mismatch", "corrupt"; "" when none were looked up
    build_seconds: float = 0.0
    buckets: list = dataclasses.field(default_factory=list)

    def metadata(self) -> dict:
        return {
            "format": "tvm_fusion/1",
            "model": self.model.name,
            "model_hash": self.model.model_hash,
            "inputs": [s.to_json() for s in self.model.inputs],
            "outputs": [s.to_json() for s in self.model.outputs],
            "target": target_json(self.target),
            "tvm_version": tvm.__version__,
            "tvm_fusion_version": __version__,
            "entry": "main",
            "buckets": self.buckets,
            "summary": {
                "ops": self.summary.ops,
                "kernels": self.summary.kernels,
                "fused_groups": self.summary.fused_groups,
                "layout_transforms": self.summary.layout_transforms,
                "tuned_kernels": self.tuned_kernels,
                "default_kernels": self.default_kernels,
            },
        }

    def export(self, path: str | os.PathLike) -> Path:
        """Write ``path`` (.so) and ``path + '.json'`` (metadata) atomically."""
        return export_library(self.executable, path, self.metadata())

    def describe(self) -> str:
        lines = [
            f"model {self.model.name} (hash {self.model.model_hash}) for {self.target.kind.name} "
            f"[{json.dumps(target_json(self.target), separators=(',', ':'))}]",
            "  " + self.summary.format(),
            f"  schedules: {self.tuned_kernels} kernel functions tuned, {self.default_kernels} default",
        ]
        if self.records_note:
            lines.append("  tuning records: " + self.records_note)
        lines.append(f"  built in {self.build_seconds:.1f} s")
        return "\n".join(lines)


def build(
    model,
    target="llvm",
    policy=None,
    *,
    name: str | None = None,
    tuning_logs: str | os.PathLike | None = DEFAULT_TUNING_LOGS,
    database=None,
    shape_buckets: list[dict] | None = None,
    device_key: str | None = None,
    **options,
) -> BuildResult:
    """Import (if needed), optimise and compile ``model`` for ``target``.

    Tuned records are looked up under ``tuning_logs/<model>/<target-key>/`` unless
    ``tuning_logs=None`` or an explicit Meta-Schedule ``database`` is given; ``device_key`` picks
    the records tuned on a fleet's servers under that RPC key (``<target-key>@<key>``).
    ``shape_buckets`` (e.g. ``[{"batch": 1}, {"batch": 8}]``) adds specialised entries for
    models with symbolic dims; the generic ``main`` serves every other shape.
    """
    start = time.perf_counter()
    target = parse_target(target)
    check_can_build(target)
    imported = as_imported(model, name)
    buckets = []
    if shape_buckets:
        specialised, buckets = add_shape_buckets(imported.mod, shape_buckets)
        imported = dataclasses.replace(imported, mod=specialised)
    note = status = ""
    if database is None and tuning_logs is not None and options.get("schedule", True):
        database, report = load_records(
            tuning_logs, imported.name, imported.model_hash, target, device_key=device_key
        )
        note, status = str(report), report.status
        if report.conv_algorithms and "conv_algorithms" not in options:
            options["conv_algorithms"] = report.conv_algorithms  # what tuning measured fastest
    stages = pipeline_stages(target, policy, database=database, **options)
    mod = run_passes(imported.mod, stages.rewrite + stages.fuse, target, imported.name)
    ready = _scheduled_count(mod)  # kernels that come scheduled (fused attention)
    mod = run_passes(mod, stages.tuned, target, imported.name)
    tuned = _scheduled_count(mod) - ready
    mod = run_passes(mod, stages.default, target, imported.name)
    try:
        executable = tvm.compile(
            mod, target=target, relax_pipeline=build_pipeline(target), tir_pipeline=tir_pipeline(target)
        )
    except Exception as err:
        failing = _failing_kernel(mod, target)
        alone = f" (kernel {failing[0]} fails on its own: {failing[1]})" if failing else ""
        raise TvmFusionError(
            f"compiling {imported.name} for {target.kind.name} failed: {last_line(err)}{alone}"
        ) from err
    return BuildResult(
        executable,
        target,
        imported,
        mod,
        summarize(imported.mod, mod),
        tuned_kernels=tuned,
        default_kernels=_scheduled_count(mod) - tuned,
        records_note=note,
        records_status=status,
        build_seconds=time.perf_counter() - start,
        buckets=buckets,
    )


def _failing_kernel(mod: tvm.IRModule, target, budget_s: float = FIND_FAILING_KERNEL_S):
    """``(name, error)`` of the first kernel of ``mod`` that does not compile on its own, so that
    a failed build names it; None when none does within ``budget_s`` (one LLVM build per kernel,
    on the failure path only)."""
    deadline = time.perf_counter() + budget_s
    for gv, func in mod.functions.items():
        if not isinstance(func, tvm.tirx.PrimFunc):
            continue
        if time.perf_counter() > deadline:
            return None
        try:
            single = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
            tvm.compile(single, target=target, tir_pipeline=tir_pipeline(target))
        except Exception as err:  # pylint: disable=broad-except
            return gv.name_hint, last_line(err, limit=200)
    return None


def _scheduled_count(mod: tvm.IRModule) -> int:
    return sum(
        1
        for _, f in mod.functions.items()
        if isinstance(f, tvm.tirx.PrimFunc)
        and f.attrs is not None
        and "tirx.is_scheduled" in f.attrs
        and bool(f.attrs["tirx.is_scheduled"])
    )


# -- export / load: module_file.py (the .so + .so.json) and loaded.py (running it) ------------


__all__ = ["BuildResult", "LoadedModel", "TargetError", "build", "export_library", "load", "optimize"]

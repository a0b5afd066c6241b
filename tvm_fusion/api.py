"""Public entry points: ``optimize`` (IRModule -> lowered IRModule), ``build``, ``export``, ``load``.

``build`` accepts what users have: an ``.onnx`` path, an ``onnx.ModelProto``, or a Relax
``IRModule``. It finds matching tuning records by itself (model hash + target) and reports how
many kernels used tuned versus default schedules.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import tvm
import tvm_ffi
from tvm import relax

from . import __version__, models
from .errors import InputError, TargetError, TvmFusionError, last_line
from .frontend import ImportedModel, TensorSpec, import_onnx
from .pipeline import build_pipeline, pipeline_passes
from .report import Summary, summarize
from .targets import check_can_build, device_for, parse_target, target_json

DEFAULT_TUNING_LOGS = "tuning_logs"


def as_imported(model, name: str | None = None) -> ImportedModel:
    """Normalise the accepted model forms into an :class:`ImportedModel`."""
    if isinstance(model, ImportedModel):
        return model
    if isinstance(model, tvm.IRModule):
        return ImportedModel(
            mod=model,
            name=name or "module",
            model_hash=_module_hash(model),
            inputs=_relax_inputs(model),
            outputs=[],
        )
    if isinstance(model, str) and model in models.EXAMPLES and not Path(model).exists():
        return import_onnx(models.example(model), name or model)  # a bundled example, by name
    if isinstance(model, (str, os.PathLike, onnx.ModelProto)):
        return import_onnx(model, name)
    raise TvmFusionError(
        f"cannot build from {type(model).__name__}: pass an .onnx path, an onnx.ModelProto or a Relax IRModule"
    )


def optimize(mod: tvm.IRModule, target="llvm", policy=None, **options) -> tvm.IRModule:
    """Run the tvm_fusion pipeline; the result is ready for ``tvm.compile(mod, target)``."""
    target = parse_target(target)
    with target:
        return tvm.transform.Sequential(pipeline_passes(target, policy, **options), name="tvm_fusion")(mod)


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
            f"  schedules: {self.tuned_kernels} kernel functions tuned, {self.default_kernels} default (dlight)",
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
    **options,
) -> BuildResult:
    """Import (if needed), optimise and compile ``model`` for ``target``.

    Tuned records are looked up under ``tuning_logs/<model>/<target-key>/`` unless
    ``tuning_logs=None`` or an explicit Meta-Schedule ``database`` is given.
    ``shape_buckets`` (e.g. ``[{"batch": 1}, {"batch": 8}]``) adds specialised entries for
    models with symbolic dims; the generic ``main`` serves every other shape.
    """
    start = time.perf_counter()
    target = parse_target(target)
    check_can_build(target)
    imported = as_imported(model, name)
    buckets = []
    if shape_buckets:
        from .shape_cache import add_shape_buckets

        specialised, buckets = add_shape_buckets(imported.mod, shape_buckets)
        imported = dataclasses.replace(imported, mod=specialised)
    note = status = ""
    if database is None and tuning_logs is not None and options.get("schedule", True):
        database, report = _find_records(tuning_logs, imported, target)
        note, status = str(report), report.status
    passes = pipeline_passes(target, policy, database=database, **options)
    mod = imported.mod
    tuned = 0
    with target:
        for p in passes:
            try:
                mod = p(mod)
            except TvmFusionError:
                raise
            except Exception as err:
                raise TvmFusionError(
                    f"pass {p.info.name} failed on {imported.name}: {last_line(err)}"
                ) from err
            if p.info.name == "MetaScheduleApplyDatabase":
                tuned = _scheduled_count(mod)
    scheduled = _scheduled_count(mod)
    try:
        executable = tvm.compile(mod, target=target, relax_pipeline=build_pipeline(target))
    except Exception as err:
        raise TvmFusionError(
            f"compiling {imported.name} for {target.kind.name} failed: {last_line(err)}"
        ) from err
    summary = summarize(imported.mod, mod)
    return BuildResult(
        executable,
        target,
        imported,
        mod,
        summary,
        tuned_kernels=tuned,
        default_kernels=scheduled - tuned,
        records_note=note,
        records_status=status,
        build_seconds=time.perf_counter() - start,
        buckets=buckets,
    )


def _find_records(tuning_logs, imported: ImportedModel, target):
    """``(database or None, RecordReport)``: records for exactly this model hash, target and TVM
    version; anything else is reported, not applied."""
    from . import tuning

    return tuning.load_records(tuning_logs, imported.name, imported.model_hash, target)


def _scheduled_count(mod: tvm.IRModule) -> int:
    return sum(
        1
        for _, f in mod.functions.items()
        if isinstance(f, tvm.tirx.PrimFunc)
        and f.attrs is not None
        and "tirx.is_scheduled" in f.attrs
        and bool(f.attrs["tirx.is_scheduled"])
    )


# -- export / load ----------------------------------------------------------------------------
def export_library(executable, path: str | os.PathLike, metadata: dict | None = None) -> Path:
    """Export atomically: a crash never leaves a half-written .so or metadata file behind."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=path.suffix or ".so", dir=path.parent)
    os.close(fd)
    try:
        executable.export_library(tmp)
        if metadata is not None:
            write_json_atomic(Path(str(path) + ".json"), metadata)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def write_json_atomic(path: Path, data: dict) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(data, handle, indent=2, sort_keys=True)
            handle.write("\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


class LoadedModel:
    """An exported module plus its metadata; calling it checks inputs and runs ``main``."""

    def __init__(self, path: str | os.PathLike, device=None):
        self.path = Path(path)
        if not self.path.exists():
            raise TvmFusionError(f"{self.path}: no such file")
        meta_path = Path(str(self.path) + ".json")
        self.metadata = json.loads(meta_path.read_text()) if meta_path.exists() else {}
        target = parse_target(self.metadata["target"]) if "target" in self.metadata else parse_target("llvm")
        self.device = device or device_for(target)
        try:
            self.lib = tvm.runtime.load_module(str(self.path))
        except Exception as err:
            raise TvmFusionError(f"{self.path}: cannot load module: {last_line(err)}") from None
        self.vm = relax.VirtualMachine(self.lib, self.device)
        self.inputs = [
            TensorSpec(i["name"], tuple(i["shape"]), i["dtype"]) for i in self.metadata.get("inputs", [])
        ]
        self.buckets = self.metadata.get("buckets", [])
        self.last_function: str | None = None  # which entry the last call ran (a bucket or "main")

    def _prepare(self, args, kwargs) -> list:
        if kwargs:
            if args:
                raise InputError("pass inputs either positionally or by name, not both")
            missing = [s.name for s in self.inputs if s.name not in kwargs]
            extra = sorted(set(kwargs) - {s.name for s in self.inputs})
            if missing or extra:
                raise InputError(f"inputs do not match the model: missing {missing}, unexpected {extra}")
            args = [kwargs[s.name] for s in self.inputs]
        if self.inputs and len(args) != len(self.inputs):
            raise InputError(
                f"model takes {len(self.inputs)} input(s) {[s.name for s in self.inputs]}, got {len(args)}"
            )
        for spec, value in zip(self.inputs, args):
            check_input(spec, value)
        return [
            tvm.runtime.tensor(np.ascontiguousarray(a), self.device) if isinstance(a, np.ndarray) else a
            for a in args
        ]

    def entry_for(self, arrays) -> str:
        from .shape_cache import select_function

        return select_function(self.buckets, self.inputs, arrays)

    def __call__(self, *args, **kwargs):
        prepared = self._prepare(args, kwargs)
        self.last_function = self.entry_for(prepared)
        return _to_numpy(self.vm[self.last_function](*prepared))

    def latency_ms(self, *args, number: int = 10, repeat: int = 5) -> list[float]:
        prepared = self._prepare(args, {})
        timer = self.vm.time_evaluator(self.entry_for(prepared), self.device, number=number, repeat=repeat)
        return [r * 1e3 for r in timer(*prepared).results]


def check_input(spec: TensorSpec, value) -> None:
    shape = tuple(value.shape)
    dtype = str(value.dtype)
    if dtype != spec.dtype:
        raise InputError(f"input {spec.name!r}: dtype {dtype}, the model expects {spec.dtype}")
    if len(shape) != len(spec.shape) or any(
        isinstance(e, int) and e > 0 and e != g for e, g in zip(spec.shape, shape)
    ):
        raise InputError(f"input {spec.name!r}: shape {list(shape)}, the model expects {list(spec.shape)}")


def load(path: str | os.PathLike, device=None) -> LoadedModel:
    """Load an exported ``.so`` (and its ``.json`` metadata) for running."""
    return LoadedModel(path, device)


def _to_numpy(out):
    if isinstance(out, tvm.runtime.Tensor):
        return out.numpy()
    if isinstance(out, (list, tuple)) or hasattr(out, "__len__"):
        return [_to_numpy(o) for o in out]
    return out


def _relax_inputs(mod: tvm.IRModule) -> list[TensorSpec]:
    specs = []
    for param in mod["main"].params:
        ty = param.ty
        if isinstance(ty, relax.TensorType) and isinstance(ty.shape, relax.ShapeExpr):
            dims = tuple(int(d) if isinstance(d, tvm.tirx.IntImm) else str(d) for d in ty.shape.values)
            specs.append(TensorSpec(param.name, dims, str(ty.dtype)))
    return specs


def _module_hash(mod: tvm.IRModule) -> str:
    return f"{tvm_ffi.structural_hash(mod) & 0xFFFFFFFFFFFFFFFF:016x}"


__all__ = ["BuildResult", "LoadedModel", "TargetError", "build", "export_library", "load", "optimize"]

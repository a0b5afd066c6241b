"""ONNX import with checks up front, so bad input fails with one line naming the file or node."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import warnings
from pathlib import Path

import onnx
import tvm
import tvm_ffi
from tvm import relax

from . import models
from .errors import ModelLoadError, TvmFusionError, UnsupportedOpError, last_line
from .onnx_fold_pads import fold_pads_into_convs
from .onnx_import import from_onnx, supported_ops
from .onnx_prepare import default_opset, prepare_onnx

# The Relax ONNX frontend implements converters back to opset 1 for most ops, but models older
# than opset 7 use semantics (e.g. BatchNormalization's spatial/is_test attrs) it does not model.
MIN_OPSET = 7
MAX_OPSET = onnx.defs.onnx_opset_version()


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple  # ints, or strings for symbolic dims
    dtype: str

    def to_json(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}


@dataclasses.dataclass
class ImportedModel:
    """A Relax module plus what the build and the exported metadata need to know about it."""

    mod: tvm.IRModule
    name: str
    model_hash: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    onnx_model: onnx.ModelProto | None = None


def model_hash(model: onnx.ModelProto | tvm.IRModule) -> str:
    """16 hex digits of content hash: tuning records are only reused for the exact same model.
    An ONNX model hashes its serialized bytes, a Relax module its structure."""
    if isinstance(model, onnx.ModelProto):
        return hashlib.sha256(model.SerializeToString(deterministic=True)).hexdigest()[:16]
    return f"{tvm_ffi.structural_hash(model) & 0xFFFFFFFFFFFFFFFF:016x}"


def as_imported(model, name: str | None = None) -> ImportedModel:
    """What ``build`` and ``tune`` accept, as an :class:`ImportedModel`: an ImportedModel, a bundled
    example's name, an ``.onnx`` path, an ``onnx.ModelProto`` or a Relax IRModule."""
    if isinstance(model, ImportedModel):
        return model
    if isinstance(model, tvm.IRModule):
        return ImportedModel(
            mod=model,
            name=name or "module",
            model_hash=model_hash(model),
            inputs=relax_inputs(model),
            outputs=[],
        )
    if isinstance(model, str) and model in models.EXAMPLES and not Path(model).exists():
        return import_onnx(models.example(model), name or model)
    if isinstance(model, (str, os.PathLike, onnx.ModelProto)):
        return import_onnx(model, name)
    raise TvmFusionError(
        f"cannot build from {type(model).__name__}: pass an .onnx path, an onnx.ModelProto or a Relax IRModule"
    )


def relax_inputs(mod: tvm.IRModule) -> list[TensorSpec]:
    """The tensor parameters of ``main`` (symbolic dims by name)."""
    specs = []
    for param in mod["main"].params:
        ty = param.ty
        if isinstance(ty, relax.TensorType) and isinstance(ty.shape, relax.ShapeExpr):
            dims = tuple(int(d) if isinstance(d, tvm.tirx.IntImm) else str(d) for d in ty.shape.values)
            specs.append(TensorSpec(param.name, dims, str(ty.dtype)))
    return specs


def read_onnx(path: str | os.PathLike) -> onnx.ModelProto:
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file")
    if path.is_dir():
        raise ModelLoadError(f"{path}: is a directory, expected an .onnx file")
    try:
        return onnx.load(str(path))
    except Exception as err:  # protobuf DecodeError and friends
        raise ModelLoadError(f"{path}: not a readable ONNX model ({type(err).__name__}: {err})") from None


def check_onnx(model: onnx.ModelProto, where: str = "model") -> None:
    """Structural, opset and operator-support checks, before the frontend's own errors can fire."""
    graph = model.graph
    if not graph.node and not graph.output:
        raise ModelLoadError(
            f"{where}: the ONNX graph has no nodes and no outputs (empty or truncated file?)"
        )
    opset = default_opset(model, missing=None)
    if opset is None:
        raise ModelLoadError(
            f"{where}: the model declares no ONNX opset (opset_import has no entry for the default "
            f"domain); set one in {MIN_OPSET}..{MAX_OPSET}, e.g. onnx.helper.make_opsetid('', {MAX_OPSET})"
        )
    if opset < MIN_OPSET or opset > MAX_OPSET:
        raise ModelLoadError(
            f"{where}: ONNX opset {opset} is outside the supported range {MIN_OPSET}..{MAX_OPSET}; "
            "convert the model with onnx.version_converter first"
        )
    if not graph.node:  # a pass-through graph is fine: every output must then be an input or a constant
        given = {v.name for v in graph.input} | {t.name for t in graph.initializer}
        unproduced = [v.name for v in graph.output if v.name not in given]
        if unproduced:
            raise ModelLoadError(
                f"{where}: the ONNX graph has no nodes, yet outputs {unproduced} are neither inputs nor "
                "initializers (truncated file?)"
            )
    for kind, values in (("input", graph.input), ("output", graph.output)):
        for value in values:
            for axis, dim in enumerate(value.type.tensor_type.shape.dim):
                if dim.HasField("dim_value") and dim.dim_value < 0:
                    raise ModelLoadError(
                        f"{where}: {kind} {value.name!r} has size {dim.dim_value} on axis {axis}; "
                        "ONNX dims must be >= 0 or symbolic (dim_param)"
                    )
    try:
        onnx.checker.check_model(model)
    except Exception as err:
        raise ModelLoadError(f"{where}: malformed ONNX model: {str(err).splitlines()[0]}") from None
    supported = _supported_ops()
    if supported is not None:
        for node in model.graph.node:
            if node.domain not in ("", "ai.onnx") or node.op_type not in supported:
                op = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"
                raise UnsupportedOpError(
                    f"{where}: operator {op} (node {node.name or '<unnamed>'!r}, output "
                    f"{list(node.output)}) is not supported by the Relax ONNX frontend"
                )


def import_onnx(source, name: str | None = None) -> ImportedModel:
    """Load (path or ModelProto), check and convert an ONNX model to a Relax IRModule.

    Static shape arithmetic is folded first (:func:`prepare_onnx`), then zero pads into the convs
    they feed (:func:`fold_pads_into_convs`); the model hash is taken on the
    model as given, so tuning records stay keyed by the user's file.
    """
    if isinstance(source, onnx.ModelProto):
        model, where = source, name or source.graph.name or "model"
    else:
        model, where = read_onnx(source), str(source)
        name = name or Path(source).stem
    check_onnx(model, where)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            mod = from_onnx(fold_pads_into_convs(prepare_onnx(model)))
        except TvmFusionError as err:
            raise type(err)(f"{where}: {err}") from None
        except Exception as err:
            raise ModelLoadError(f"{where}: the Relax ONNX frontend failed: {last_line(err)}") from None
    return ImportedModel(
        mod=mod,
        name=_safe_name(name or model.graph.name or "model"),
        model_hash=model_hash(model),
        inputs=_value_specs(model, model.graph.input, skip={i.name for i in model.graph.initializer}),
        outputs=_value_specs(model, model.graph.output),
        onnx_model=model,
    )


def _supported_ops() -> set[str] | None:
    try:  # the frontend's table is private in TVM, so degrade to "let the frontend decide" if it moves
        return supported_ops()
    except Exception:  # pragma: no cover
        return None


def _value_specs(model, values, skip=frozenset()) -> list[TensorSpec]:
    specs = []
    for value in values:
        if value.name in skip:
            continue
        ttype = value.type.tensor_type
        dims = tuple(
            d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in ttype.shape.dim
        )
        dtype = onnx.helper.tensor_dtype_to_np_dtype(ttype.elem_type).name if ttype.elem_type else "float32"
        specs.append(TensorSpec(value.name, dims, dtype))
    return specs


def _safe_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "model"

"""Shape buckets: specialised copies of ``main`` for the shapes users really send.

A model with a symbolic batch or sequence length builds one generic ``main`` whose kernels loop
over run-time extents. That works for every shape but schedules (and tuning) see no constants.
For configured buckets such as ``{"batch": 1}`` or ``{"batch": 8, "seq": 128}`` we add a copy of
``main`` with those symbols bound (``relax.transform.BindSymbolicVars``), so fusion, layout and
schedules work on static shapes. All functions live in one ``.so``; the metadata lists the
buckets, and :func:`select_function` picks the specialised entry when the inputs match a bucket and
the generic ``main`` otherwise.
"""

from __future__ import annotations

import re

import tvm
from tvm import relax

from .errors import TvmFusionError


def symbolic_dims(mod: tvm.IRModule, entry: str = "main") -> list[str]:
    """Names of the symbolic dimensions in ``entry``'s parameter shapes, in order of appearance."""
    names: list[str] = []
    for param in mod[entry].params:
        ty = param.ty
        if isinstance(ty, relax.TensorType) and isinstance(ty.shape, relax.ShapeExpr):
            for dim in ty.shape.values:
                if isinstance(dim, tvm.tirx.Var) and dim.name not in names:
                    names.append(dim.name)
    return names


def bucket_function_name(bindings: dict[str, int], entry: str = "main") -> str:
    parts = "_".join(f"{re.sub(r'[^A-Za-z0-9]', '_', k)}{v}" for k, v in sorted(bindings.items()))
    return f"{entry}__{parts}"


def add_shape_buckets(mod: tvm.IRModule, buckets: list[dict[str, int]], entry: str = "main"):
    """Return ``(mod, bucket_table)`` with one specialised copy of ``entry`` per bucket."""
    known = symbolic_dims(mod, entry)
    table = []
    for bindings in buckets:
        bindings = {str(k): int(v) for k, v in bindings.items()}
        unknown = sorted(set(bindings) - set(known))
        if unknown:
            raise TvmFusionError(
                f"shape bucket {bindings} names {unknown}, but the model's symbolic dims are {known or 'none'}"
            )
        if any(v <= 0 for v in bindings.values()):
            raise TvmFusionError(f"shape bucket {bindings}: sizes must be positive")
        name = bucket_function_name(bindings, entry)
        mod = tvm.IRModule(dict(mod.functions.items()), attrs=mod.attrs)  # never mutate the caller's module
        mod[name] = mod[entry].with_attr("global_symbol", name)
        mod = relax.transform.BindSymbolicVars(bindings, func_name=name)(mod)
        table.append({"function": name, "bindings": bindings})
    return mod, table


def parse_bucket(text: str) -> dict[str, int]:
    """``"batch=1,seq=128"`` -> ``{"batch": 1, "seq": 128}`` (for the CLI)."""
    bucket = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not value.strip().isdigit():
            raise TvmFusionError(
                f"bad shape bucket {text!r}: expected name=size[,name=size...], e.g. batch=1,seq=128"
            )
        bucket[key.strip()] = int(value)
    return bucket


def bind_dims(input_specs, arrays) -> dict[str, int]:
    """Values the run-time inputs give each symbolic dimension name."""
    values: dict[str, int] = {}
    for spec, array in zip(input_specs, arrays):
        for dim, size in zip(spec.shape, array.shape):
            if isinstance(dim, str):
                values.setdefault(dim, int(size))
    return values


def select_function(buckets: list[dict], input_specs, arrays, default: str = "main") -> str:
    """The bucket entry whose bindings all match the inputs, else the generic entry."""
    values = bind_dims(input_specs, arrays)
    for bucket in buckets:
        if all(values.get(k) == v for k, v in bucket["bindings"].items()):
            return bucket["function"]
    return default

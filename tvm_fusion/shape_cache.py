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

from .errors import InputError, TvmFusionError


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


# Sizes are bound as TIR index constants; the default schedules index in int32, so a bucket beyond
# int32 cannot compile (and no tensor with that many rows would fit in memory anyway).
MAX_DIM = 2**31 - 1


def check_bucket(bindings, known: list[str] | None = None) -> dict[str, int]:
    """A bucket as ``{dim name: size}``: at least one dim, sizes integers in 1..MAX_DIM, names
    among ``known`` (the model's symbolic dims) when given."""
    if not isinstance(bindings, dict) or not bindings:
        raise TvmFusionError(f"shape bucket {bindings!r}: expected at least one name=size binding")
    for key, value in bindings.items():
        if not isinstance(key, str) or not key:
            raise TvmFusionError(f"shape bucket {bindings}: dim names must be non-empty strings")
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_DIM:
            raise TvmFusionError(
                f"shape bucket {bindings}: size of {key!r} must be an integer in 1..{MAX_DIM}, got {value!r}"
            )
    if known is not None:
        unknown = sorted(set(bindings) - set(known))
        if unknown:
            raise TvmFusionError(
                f"shape bucket {bindings} names {unknown}, but the model's symbolic dims are {known or 'none'}"
            )
    return dict(bindings)


def add_shape_buckets(mod: tvm.IRModule, buckets: list[dict[str, int]], entry: str = "main"):
    """Return ``(mod, bucket_table)`` with one specialised copy of ``entry`` per bucket."""
    known = symbolic_dims(mod, entry)
    table = []
    for bindings in buckets:
        bindings = check_bucket(bindings, known)
        if any(row["bindings"] == bindings for row in table):
            raise TvmFusionError(f"shape bucket {bindings} is given twice")
        name = bucket_function_name(bindings, entry)
        mod = tvm.IRModule(dict(mod.functions.items()), attrs=mod.attrs)  # never mutate the caller's module
        mod[name] = mod[entry].with_attr("global_symbol", name)
        mod = relax.transform.BindSymbolicVars(bindings, func_name=name)(mod)
        table.append({"function": name, "bindings": bindings})
    return mod, table


def parse_bucket(text: str) -> dict[str, int]:
    """``"batch=1,seq=128"`` -> ``{"batch": 1, "seq": 128}`` (for the CLI)."""
    bucket: dict[str, int] = {}
    usage = f"bad shape bucket {text!r}: expected name=size[,name=size...], e.g. batch=1,seq=128"
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = (part.strip() for part in item.partition("="))
        if not key or not sep or not re.fullmatch(r"[0-9]+", value):  # not isdigit(): "²" is a digit
            raise TvmFusionError(usage)
        if key in bucket:
            raise TvmFusionError(f"bad shape bucket {text!r}: {key!r} is given twice")
        bucket[key] = int(value)
    if not bucket:
        raise TvmFusionError(usage)
    return check_bucket(bucket)


def bind_dims(input_specs, arrays) -> dict[str, int]:
    """Values the run-time inputs give each symbolic dimension name; inputs that share a name must
    agree on its size (the compiled entry would fail on a shape check otherwise)."""
    values: dict[str, int] = {}
    first: dict[str, str] = {}
    for spec, array in zip(input_specs, arrays):
        for dim, size in zip(spec.shape or (), array.shape):
            if not isinstance(dim, str) or dim == "?":
                continue
            if dim in values and values[dim] != int(size):
                raise InputError(
                    f"input {spec.name!r}: dimension {dim!r} is {int(size)}, but input {first[dim]!r} "
                    f"gave it {values[dim]}; inputs sharing a symbolic dim must agree"
                )
            values.setdefault(dim, int(size))
            first.setdefault(dim, spec.name)
    return values


def select_function(buckets: list[dict], input_specs, arrays, default: str = "main") -> str:
    """The bucket entry whose bindings all match the inputs, else the generic entry."""
    values = bind_dims(input_specs, arrays)
    for bucket in buckets:
        if all(values.get(k) == v for k, v in bucket["bindings"].items()):
            return bucket["function"]
    return default

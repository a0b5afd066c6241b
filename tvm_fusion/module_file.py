"""The exported ``.so`` and its ``.so.json`` sidecar: written atomically with the library's size and
sha256, read back with every field checked, and checked against the library before it is loaded.

A damaged library must never reach ``dlopen``: a truncated one maps pages past the end of the file and
the process dies of SIGBUS. So before loading, the ELF headers are checked against the file size
(catches truncation even without a sidecar), and the size and sha256 the sidecar recorded at export
are compared with the file (catches any change). The sidecar is also checked against what the
module itself says about ``main`` (arity, shapes, dtypes), so a hand-edited shape or dtype is
reported instead of failing deep inside the VM.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import struct
import tempfile
from pathlib import Path
from typing import Any

import tvm
from tvm import relax

from .errors import ExportError, ModuleError, TargetError
from .files import default_mode, write_json_atomic
from .frontend import TensorSpec
from .jsonio import json_type, read_json
from .shape_cache import check_bucket
from .targets import parse_target

FORMAT = "tvm_fusion/1"


def sidecar_path(path: str | os.PathLike) -> Path:
    return Path(str(path) + ".json")


# -- writing ----------------------------------------------------------------------------------
def export_library(executable, path: str | os.PathLike, metadata: dict | None = None) -> Path:
    """Export atomically: a crash never leaves a half-written .so or metadata file behind.

    The .so is written first and the sidecar (with the library's size and sha256) after it, so a
    failed export leaves no orphan sidecar, and an interrupted one leaves a sidecar whose checksum
    says it does not belong to the new library. Both files get the modes the umask asks for.
    """
    path = Path(path)
    meta_path = sidecar_path(path)
    for target in (path, meta_path):
        if target.is_dir():
            raise ExportError(f"{target}: is a directory; give the output a file name such as model.so")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=path.suffix or ".so", dir=path.parent)
        os.close(fd)
    except OSError as err:
        raise ExportError(f"cannot write {path}: {err.strerror or err}") from None
    try:
        executable.export_library(tmp)
        os.chmod(tmp, default_mode(executable=True))
        library = fingerprint(tmp)
        os.replace(tmp, path)
        if metadata is not None:
            write_json_atomic(meta_path, {**metadata, "library": library})
    except OSError as err:
        raise ExportError(f"cannot write {err.filename or path}: {err.strerror or err}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def fingerprint(path: str | os.PathLike) -> dict:
    """``{"size": bytes, "sha256": hex}`` of a file."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": digest.hexdigest()}


# -- reading the sidecar ----------------------------------------------------------------------
@dataclasses.dataclass
class Metadata:
    """A checked ``.so.json``; ``raw`` is the dict as read."""

    raw: dict
    inputs: list[TensorSpec]
    buckets: list[dict]
    target: Any  # tvm.target.Target, or None when the sidecar names none
    library: dict | None  # {"size", "sha256"}; None in sidecars written before they were recorded


def read_metadata(path: str | os.PathLike) -> Metadata:
    """Read and check the sidecar at ``path``: one :class:`ModuleError` naming the file and the key."""
    path = Path(path)
    data = read_json(path, "module metadata", ModuleError)

    def bad(key: str, expected: str, value: Any = None) -> ModuleError:
        got = f", got {value!r}"[:120] if value is not None else ""
        return ModuleError(
            f"{path}: key {key!r} must be {expected}{got} (edited by hand? re-export the model)"
        )

    if not isinstance(data, dict):
        raise ModuleError(f"{path}: module metadata must be a JSON object, got {json_type(data)}")
    if data.get("format", FORMAT) != FORMAT:
        raise bad("format", repr(FORMAT), data.get("format"))
    if "inputs" not in data:
        raise bad("inputs", "a list of {name, shape, dtype} objects")
    inputs = _tensor_specs(data["inputs"], "inputs", bad)
    _tensor_specs(data.get("outputs", []), "outputs", bad)
    target = None
    if "target" in data:
        try:
            target = parse_target(data["target"])
        except TargetError as err:
            raise ModuleError(f"{path}: key 'target': {err}") from None
    buckets = data.get("buckets", [])
    if not isinstance(buckets, list):
        raise bad("buckets", "a list", buckets)
    dims = {d for s in inputs for d in s.shape if isinstance(d, str)}
    for i, bucket in enumerate(buckets):
        if not isinstance(bucket, dict) or not isinstance(bucket.get("function"), str):
            raise bad(f"buckets[{i}]", "an object with 'function' (a name) and 'bindings'", bucket)
        try:
            check_bucket(bucket.get("bindings"), sorted(dims))
        except Exception as err:
            raise ModuleError(f"{path}: key 'buckets[{i}]': {err}") from None
    library = data.get("library")
    if library is not None and not (
        isinstance(library, dict)
        and _is_count(library.get("size"))
        and isinstance(library.get("sha256"), str)
        and re.fullmatch(r"[0-9a-f]{64}", library["sha256"])
    ):
        raise bad("library", "an object with 'size' (bytes) and 'sha256' (64 hex digits)", library)
    return Metadata(raw=data, inputs=inputs, buckets=buckets, target=target, library=library)


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _tensor_specs(items, key: str, bad) -> list[TensorSpec]:
    if not isinstance(items, list):
        raise bad(key, "a list of {name, shape, dtype} objects", items)
    specs = []
    for i, item in enumerate(items):
        where = f"{key}[{i}]"
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise bad(where, "an object with 'name', 'shape' and 'dtype'", item)
        shape = item.get("shape")
        if not isinstance(shape, list) or not all(_is_count(d) or (isinstance(d, str) and d) for d in shape):
            raise bad(f"{where}.shape", "a list of sizes >= 0 or symbolic dim names", shape)
        dtype = item.get("dtype")
        if not isinstance(dtype, str) or not _is_dtype(dtype):
            raise bad(f"{where}.dtype", "a TVM dtype such as 'float32'", dtype)
        specs.append(TensorSpec(item["name"], tuple(shape), dtype))
    return specs


def _is_dtype(text: str) -> bool:
    try:
        tvm.DataType(text)
    except Exception:
        return False
    return True


# -- checking the library ---------------------------------------------------------------------
def check_library(path: Path, expected: dict | None = None) -> None:
    """Refuse a file ``dlopen`` would choke on: not ELF, truncated, or not the file exported."""
    if not path.exists():
        raise ModuleError(f"{path}: no such file")
    if not path.is_file():
        raise ModuleError(f"{path}: not a regular file")
    size = path.stat().st_size
    if expected is not None and expected["size"] != size:
        raise ModuleError(
            f"{path}: is {size} bytes, but {sidecar_path(path).name} recorded {expected['size']} at "
            "export (truncated or replaced; re-export the model)"
        )
    _check_elf(path, size)
    if expected is not None and fingerprint(path)["sha256"] != expected["sha256"]:
        raise ModuleError(
            f"{path}: sha256 differs from the one {sidecar_path(path).name} recorded at export "
            "(the library changed or the sidecar belongs to another export; re-export the model)"
        )


# Where the ELF fields we need sit, per ELF class (1: 32-bit, 2: 64-bit): word format, offset of
# (e_phoff, e_shoff), offset of (e_phentsize, e_phnum, e_shentsize, e_shnum), and p_offset and
# p_filesz inside a program header.
_ELF_LAYOUT = {1: ("I", 28, 42, 4, 16), 2: ("Q", 32, 54, 8, 32)}


def _check_elf(path: Path, size: int) -> None:
    """Every header table and loadable segment the ELF headers declare must lie inside the file."""
    with open(path, "rb") as handle:
        head = handle.read(64)
        if head[:4] != b"\x7fELF" or len(head) < 52 or head[4] not in _ELF_LAYOUT:
            raise ModuleError(f"{path}: not a shared library (no ELF header)")
        word, tables_at, counts_at, offset_at, filesz_at = _ELF_LAYOUT[head[4]]
        order = "<" if head[5] == 1 else ">"
        phoff, shoff = struct.unpack_from(order + word * 2, head, tables_at)
        phentsize, phnum, shentsize, shnum = struct.unpack_from(order + "HHHH", head, counts_at)
        ends = [phoff + phentsize * phnum, shoff + shentsize * shnum]
        if ends[0] <= size:
            handle.seek(phoff)
            table = handle.read(phentsize * phnum)
            for start in range(0, phentsize * phnum, phentsize):
                (offset,) = struct.unpack_from(order + word, table, start + offset_at)
                (filesz,) = struct.unpack_from(order + word, table, start + filesz_at)
                ends.append(offset + filesz)
    if max(ends) > size:
        raise ModuleError(
            f"{path}: truncated: its ELF headers describe {max(ends)} bytes, the file has {size}"
        )


# -- what the module itself says --------------------------------------------------------------
# The Relax VM checks each parameter against its annotation and keeps the text for its error
# message in the executable's constant pool, e.g.
#   ErrorContext(fn=main, loc=param[0], param=x, annotation=R.Tensor((batch, 32), dtype="float32"))
_PARAM_CONTEXT = re.compile(
    r"ErrorContext\(fn=(?P<fn>[^,]+), loc=param\[(?P<index>\d+)\], param=[^\n]*?, "
    r'annotation=R\.Tensor\(\((?P<dims>[^()]*)\), dtype="(?P<dtype>[^"]+)"\)\)'
)


def module_inputs(lib, vm: relax.VirtualMachine, entry: str = "main") -> list[TensorSpec]:
    """``entry``'s parameters as the module declares them. Names and arity always; shape and dtype
    are ``None`` where the executable does not spell them out (non-tensor or unannotated)."""
    arity = vm.module["get_function_arity"](entry)
    names = [vm.module["get_function_param_name"](entry, i) for i in range(arity)]
    try:
        stats = relax.VMExecutable(lib).stats()
    except Exception:  # pragma: no cover - the stats text is what we parse; be lenient if it moves
        stats = ""
    found: dict[int, tuple] = {}
    for m in _PARAM_CONTEXT.finditer(stats):
        if m["fn"] == entry:
            dims = tuple(
                int(d) if d.lstrip("-").isdigit() else d
                for d in (p.strip() for p in m["dims"].split(","))
                if d
            )
            found[int(m["index"])] = (dims, m["dtype"])
    return [TensorSpec(name, *found.get(i, (None, None))) for i, name in enumerate(names)]


def check_against_module(meta: Metadata, declared: list[TensorSpec], vm, where: Path) -> None:
    """The sidecar must describe the module: input count, static sizes, dtypes, bucket entries."""
    if len(meta.inputs) != len(declared):
        raise ModuleError(
            f"{where}: lists {len(meta.inputs)} input(s), but the module's main takes {len(declared)} "
            "(edited by hand, or the sidecar of another export?)"
        )
    for mine, theirs in zip(meta.inputs, declared):
        if theirs.dtype is not None and mine.dtype != theirs.dtype:
            raise ModuleError(
                f"{where}: input {mine.name!r} has dtype {mine.dtype}, but the module's main takes "
                f"{theirs.dtype} (edited by hand? re-export the model)"
            )
        if theirs.shape is not None and (
            len(mine.shape) != len(theirs.shape)
            or any(
                isinstance(a, int) != isinstance(b, int) or (isinstance(a, int) and a != b)
                for a, b in zip(mine.shape, theirs.shape)
            )
        ):
            raise ModuleError(
                f"{where}: input {mine.name!r} has shape {list(mine.shape)}, but the module's main takes "
                f"{list(theirs.shape)} (edited by hand? re-export the model)"
            )
    for bucket in meta.buckets:
        try:
            vm.module["get_function_arity"](bucket["function"])
        except Exception:
            raise ModuleError(
                f"{where}: shape bucket entry {bucket['function']!r} is not in the module"
            ) from None

"""Target parsing: short names (``llvm``, ``cuda``), JSON dicts, and stable keys for tuning logs.

This TVM rejects flag strings such as ``"cuda -arch=sm_80"``; targets are JSON dicts. We accept
the short names users type and expand them to dicts for the machine at hand.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any

import tvm

from .errors import TargetError, last_line

DEFAULT_CUDA_ARCH = "sm_80"


def host_cpu() -> str:
    """The LLVM name of this machine's CPU (``-mcpu=native`` is rejected by this TVM's LLVM)."""
    try:
        return str(tvm.target.codegen.llvm_get_system_cpu())
    except Exception:  # pragma: no cover - LLVM always present in the wheel
        return "generic"


def llvm_target(mcpu: str | None = None, num_cores: int | None = None) -> tvm.target.Target:
    return tvm.target.Target(
        {"kind": "llvm", "mcpu": mcpu or host_cpu(), "num-cores": num_cores or os.cpu_count() or 1}
    )


# What dlight reads from a CUDA target and assumes (with a warning per kernel, dozens per model)
# when it is missing: the per-block shared memory every arch grants without an opt-in.
CUDA_DEFAULTS = {"max_shared_memory_per_block": 49152}


def cuda_target(arch: str = DEFAULT_CUDA_ARCH) -> tvm.target.Target:
    if not re.fullmatch(r"sm_\d+[a-z]?", arch):
        raise TargetError(f"bad CUDA arch {arch!r}: expected a name like 'sm_80' or 'sm_90a'")
    return tvm.target.Target({"kind": "cuda", "arch": arch, **CUDA_DEFAULTS}, host=llvm_target())


def parse_target(spec: Any, cuda_arch: str | None = None) -> tvm.target.Target:
    """Turn ``"llvm"``, ``"cuda"``, a JSON string, a dict or a Target into a ``tvm.target.Target``."""
    if isinstance(spec, tvm.target.Target):
        return spec
    if isinstance(spec, str):
        text = spec.strip()
        if text.startswith("{"):
            try:
                spec = json.loads(text)
            except json.JSONDecodeError as err:
                raise TargetError(f"target {spec!r} is not valid JSON: {err}") from None
        elif text in ("llvm", "cpu"):
            return llvm_target()
        elif text in ("cuda", "gpu"):
            return cuda_target(cuda_arch or DEFAULT_CUDA_ARCH)
        else:
            raise TargetError(
                f"unknown target {spec!r}: use 'llvm', 'cuda' or a JSON dict such as "
                '\'{"kind": "cuda", "arch": "sm_80"}\' (flag strings like "cuda -arch=sm_80" '
                "are not accepted by TVM 0.27)"
            )
    if isinstance(spec, dict):
        spec = dict(spec)
        if spec.get("kind") == "cuda":
            if cuda_arch:
                spec["arch"] = cuda_arch
            for key, value in CUDA_DEFAULTS.items():
                spec.setdefault(key, value)
        if spec.get("kind") == "llvm":
            spec.setdefault("mcpu", host_cpu())
            spec.setdefault("num-cores", os.cpu_count() or 1)
        try:
            target = tvm.target.Target(spec)
        except Exception as err:
            raise TargetError(f"TVM rejected target {spec}: {last_line(err)}") from None
        if target.kind.name == "cuda" and target.host is None:
            target = tvm.target.Target(target, host=llvm_target())
        return target
    raise TargetError(f"cannot make a target from {spec!r} ({type(spec).__name__})")


def is_gpu(target: tvm.target.Target) -> bool:
    return "gpu" in target.keys


def target_key(target: tvm.target.Target) -> str:
    """A short, filesystem-safe key naming the target a tuning log is valid for."""
    kind = target.kind.name
    if kind == "llvm":
        detail = str(target.attrs.get("mcpu", "generic"))
        cores = target.attrs.get("num-cores")
        detail += f"-{int(cores)}c" if cores else ""
    elif kind == "cuda":
        detail = str(target.attrs.get("arch", "unknown"))
    else:
        detail = "default"
    return re.sub(r"[^A-Za-z0-9_.-]", "_", f"{kind}-{detail}")


def target_json(target: tvm.target.Target) -> dict:
    """The target as a plain dict (for manifests and .so metadata)."""
    return json.loads(str(target))


def check_can_build(target: tvm.target.Target) -> None:
    """Fail early, with a clear message, when this TVM build or machine cannot compile for target."""
    kind = target.kind.name
    if kind == "cuda":
        if tvm.support.libinfo().get("USE_CUDA", "OFF") in ("OFF", "0", ""):
            raise TargetError("CUDA target requested but this TVM build has no CUDA support (USE_CUDA=OFF)")
        if shutil.which("nvcc") is None and not os.environ.get("CUDA_HOME"):
            raise TargetError(
                "CUDA target requested but nvcc is not on PATH (set CUDA_HOME or install the CUDA "
                "toolkit); TVM compiles CUDA kernels with nvcc"
            )
    if kind == "c":  # tvm.compile emits C the host compiler rejects for vectorized schedules
        raise TargetError(
            "target kind 'c' is not supported by tvm_fusion: TVM's C backend cannot compile the vectorized "
            "CPU schedules (use llvm)"
        )
    if kind not in ("llvm", "cuda"):
        raise TargetError(f"target kind {kind!r} is not supported by tvm_fusion (use llvm or cuda)")


def device_for(target: tvm.target.Target, index: int = 0):
    """The runtime device for target; raises TargetError when it is absent on this machine."""
    kind = "cpu" if target.kind.name in ("llvm", "c") else target.kind.name
    dev = tvm.device(kind, index)
    if not dev.exist:
        raise TargetError(
            f"no {target.kind.name} device {index} on this machine: cannot run {target.kind.name} code here"
        )
    return dev

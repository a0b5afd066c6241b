"""What tuning needs from this Python environment, checked up front, and one slow import made fast.

* Meta-Schedule's worker pools pickle with ``cloudpickle``, and some apache-tvm-ffi versions
  segfault serialising TVM 0.27 IR (so records could be neither written nor read): both are
  checked before any work starts, with one clear line instead of a crash deep in C++.
* Importing ``tvm.s_tir.tensor_intrin`` (done by every ``TuneContext``) takes over a minute in this
  wheel because the TVMScript parser calls ``inspect.stack()`` hundreds of times; we import it once
  with an ``inspect.stack`` that reads source context only where TVMScript looks.
"""

from __future__ import annotations

import importlib.util
import inspect
import subprocess
import sys
import threading

import tvm
import tvm_ffi
from tvm.s_tir import meta_schedule as ms  # noqa: F401  (re-exported for the tuning modules)

from ..errors import TvmFusionError

# tvm-ffi versions known to serialize TVM 0.27 objects correctly / to segfault in ToJSONGraph.
_FFI_GOOD = {"0.1.14.post0"}
_FFI_BAD = {"0.1.15.post2"}

_ffi_checked = False
_intrinsics_loaded = False
_intrinsics_lock = threading.Lock()


def check_environment(*, need_workers: bool = True) -> None:
    """Fail with one clear line (not a segfault deep in C++) when tuning cannot work here."""
    global _ffi_checked
    if need_workers and importlib.util.find_spec("cloudpickle") is None:
        raise TvmFusionError(
            "tuning needs the 'cloudpickle' package (TVM's builder/runner worker pool uses it): "
            "pip install cloudpickle"
        )
    if _ffi_checked:
        return
    version = getattr(tvm_ffi, "__version__", "?")
    broken = version in _FFI_BAD
    if not broken and version not in _FFI_GOOD:
        # Unknown version: probe in a child process, since the failure mode is a segfault.
        probe = "import tvm; tvm.ir.save_json(tvm.tirx.IntImm('int32', 1))"
        proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=300)
        broken = proc.returncode != 0
    if broken:
        raise TvmFusionError(
            f"apache-tvm-ffi {version} cannot serialize TVM {tvm.__version__} IR (segfault in "
            "ToJSONGraph), so tuning records can be neither written nor read: "
            "pip install 'apache-tvm-ffi==0.1.14.post0'"
        )
    _ffi_checked = True


def _fast_stack(context: int = 1) -> list[inspect.FrameInfo]:
    """``inspect.stack`` with source context only for the 3 innermost frames (all TVMScript uses)."""
    frame = sys._getframe(1)
    out = []
    while frame is not None:
        if len(out) < 3:
            info = inspect.getframeinfo(frame, context)
            out.append(inspect.FrameInfo(frame, *info, positions=info.positions))
        else:
            code = frame.f_code
            out.append(
                inspect.FrameInfo(
                    frame, code.co_filename, frame.f_lineno, code.co_name, None, None, positions=None
                )
            )
        frame = frame.f_back
    return out


def load_tensor_intrinsics() -> None:
    """Import ``tvm.s_tir.tensor_intrin`` in seconds instead of minutes (see module docstring)."""
    global _intrinsics_loaded
    with _intrinsics_lock:
        if _intrinsics_loaded or "tvm.s_tir.tensor_intrin" in sys.modules:
            _intrinsics_loaded = True
            return
        original = inspect.stack
        inspect.stack = _fast_stack
        try:
            importlib.import_module("tvm.s_tir.tensor_intrin")
        finally:
            inspect.stack = original
        _intrinsics_loaded = True

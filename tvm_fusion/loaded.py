"""Running an exported module: ``load(path)`` checks the library and its sidecar, and the model it
returns can be called from any number of threads.

One ``relax.VirtualMachine`` is not thread-safe (concurrent calls on one VM segfault, TVM 0.27), so
calls take turns on the model's one VM behind a lock; input checks run outside it.
The alternative, a VM per calling thread, was measured side by side (scripts/thread_throughput.py):
it served no more calls per second, and with more callers than cores it served fewer, because TVM
gives each calling thread its own pool of TVM_NUM_THREADS workers and concurrent calls oversubscribe
the cores. See README, Reliability.
"""

from __future__ import annotations

import math
import os
import threading
import zipfile
from pathlib import Path

import numpy as np
import tvm
from tvm import relax

from .errors import InputError, ModuleError, last_line
from .frontend import TensorSpec
from .module_file import check_against_module, check_library, module_inputs, read_metadata, sidecar_path
from .shape_cache import select_function
from .targets import device_for, parse_target


class LoadedModel:
    """An exported module plus its metadata; calling it checks inputs and runs ``main``.

    Thread-safe: calls from any number of threads take turns on the one VM (see the module doc).
    Without a ``.so.json`` next to the library, input names, shapes and dtypes come from the
    module's own ``main`` signature and the device is the CPU.
    """

    def __init__(self, path: str | os.PathLike, device=None):
        self.path = Path(path)
        meta_path = sidecar_path(self.path)
        if not self.path.exists():
            raise ModuleError(f"{self.path}: no such file")
        meta = read_metadata(meta_path) if meta_path.exists() else None
        check_library(self.path, meta.library if meta else None)
        self.metadata = meta.raw if meta else {}
        self.from_sidecar = meta is not None
        target = meta.target if meta and meta.target is not None else parse_target("llvm")
        self.device = device or device_for(target)
        try:
            self.lib = tvm.runtime.load_module(str(self.path))
        except Exception as err:
            raise ModuleError(f"{self.path}: cannot load module: {last_line(err)}") from None
        self._lock = threading.Lock()  # one call at a time on the one VM
        self._local = threading.local()  # what each thread's last call ran
        try:
            self.vm = vm = relax.VirtualMachine(self.lib, self.device)
        except AttributeError:
            raise ModuleError(
                f"{self.path}: not a TVM Relax VM module (it has no vm_load_executable); "
                "export it with tvm_fusion or tvm.compile(...).export_library"
            ) from None
        except Exception as err:
            raise ModuleError(f"{self.path}: cannot start the Relax VM: {last_line(err)}") from None
        try:
            declared = module_inputs(self.lib, vm)
        except Exception as err:
            raise ModuleError(
                f"{self.path}: the module has no Relax entry 'main' ({last_line(err)})"
            ) from None
        if meta is not None:
            check_against_module(meta, declared, vm, meta_path)
            self.inputs = meta.inputs
            self.buckets = meta.buckets
        else:
            self.inputs = declared
            self.buckets = []

    @property
    def last_function(self) -> str | None:
        """Which entry this thread's last call ran (a bucket entry or ``"main"``)."""
        return getattr(self._local, "last_function", None)

    def _prepare(self, args, kwargs) -> list:
        if kwargs:
            if args:
                raise InputError("pass inputs either positionally or by name, not both")
            missing = [s.name for s in self.inputs if s.name not in kwargs]
            extra = sorted(set(kwargs) - {s.name for s in self.inputs})
            if missing or extra:
                raise InputError(f"inputs do not match the model: missing {missing}, unexpected {extra}")
            args = [kwargs[s.name] for s in self.inputs]
        if len(args) != len(self.inputs):
            raise InputError(
                f"model takes {len(self.inputs)} input(s) {[s.name for s in self.inputs]}, got {len(args)}"
            )
        # np.asarray, not np.ascontiguousarray: the latter turns a 0-d (scalar) input into 1-d
        args = [a if isinstance(a, tvm.runtime.Tensor) else np.asarray(a, order="C") for a in args]
        for spec, value in zip(self.inputs, args):
            check_input(spec, value)
        return [tvm.runtime.tensor(a, self.device) if isinstance(a, np.ndarray) else a for a in args]

    def entry_for(self, arrays) -> str:
        return select_function(self.buckets, self.inputs, arrays)

    def __call__(self, *args, **kwargs):
        prepared = self._prepare(args, kwargs)
        entry = self._local.last_function = self.entry_for(prepared)
        with self._lock:
            return _to_numpy(self.vm[entry](*prepared))

    def latency_ms(self, *args, number: int = 10, repeat: int = 5) -> list[float]:
        for key, value in (("number", number), ("repeat", repeat)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"{key} must be an integer >= 1, got {value!r}")
        prepared = self._prepare(args, {})
        timer = self.vm.time_evaluator(self.entry_for(prepared), self.device, number=number, repeat=repeat)
        with self._lock:
            results = timer(*prepared).results
        return [r * 1e3 for r in results]

    def random_inputs(self, seed: int = 0) -> dict[str, np.ndarray]:
        """Standard-normal inputs of the declared shapes (symbolic dims 1), if memory allows."""
        missing = [s.name for s in self.inputs if s.shape is None or s.dtype is None]
        if missing:
            raise ModuleError(
                f"{sidecar_path(self.path)} is missing and the module does not declare the shape of "
                f"input(s) {missing}: pass real inputs (run --inputs x.npz)"
            )
        shapes = {s.name: [d if isinstance(d, int) else 1 for d in s.shape] for s in self.inputs}
        need = sum(math.prod(shapes[s.name]) * np.dtype(s.dtype).itemsize for s in self.inputs)
        have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        if need > have:
            sizes = ", ".join(f"{s.name} {shapes[s.name]} {s.dtype}" for s in self.inputs)
            raise InputError(
                f"random inputs for {self.path.name} ({sizes}) need {_bytes(need)}, more than this "
                f"machine's {_bytes(have)} of memory"
            )
        rng = np.random.default_rng(seed)
        return {
            s.name: rng.standard_normal(shapes[s.name], dtype=np.float32).astype(s.dtype, copy=False)
            for s in self.inputs
        }


def read_inputs(path: str | os.PathLike, specs: list[TensorSpec]) -> dict[str, np.ndarray]:
    """Inputs from an ``.npz`` (one array per input name) or, for a one-input model, an ``.npy``."""
    path = Path(path)
    names = [s.name for s in specs]
    if not path.is_file():
        raise InputError(f"{path}: no such file" if not path.exists() else f"{path}: not a file")
    try:
        data = np.load(path, allow_pickle=False)
        if isinstance(data, np.ndarray):
            if len(specs) != 1:
                raise InputError(f"{path}: one array (.npy), but the model takes inputs {names}: use an .npz")
            return {names[0]: data}
        if not isinstance(data, np.lib.npyio.NpzFile):
            raise InputError(f"{path}: not an .npz file of arrays")
        with data:
            arrays = {key: data[key] for key in data.files}
    except InputError:
        raise
    except ValueError as err:
        if "pickle" in str(err) or "Object arrays" in str(err):
            raise InputError(
                f"{path}: not an .npz of numeric arrays (it holds pickled Python objects, which are not "
                "loaded); save inputs with numpy.savez(path, name=array)"
            ) from None
        raise InputError(f"{path}: not a readable .npz file ({err})") from None
    except (OSError, EOFError, zipfile.BadZipFile) as err:
        raise InputError(f"{path}: not a readable .npz file ({err})") from None
    if sorted(arrays) != sorted(names):
        raise InputError(f"{path}: holds arrays {sorted(arrays)}, but the model's inputs are {names}")
    return arrays


def check_input(spec: TensorSpec, value) -> None:
    shape = tuple(value.shape)
    dtype = str(value.dtype)
    if spec.dtype is not None and dtype != spec.dtype:
        raise InputError(f"input {spec.name!r}: dtype {dtype}, the model expects {spec.dtype}")
    if spec.shape is not None and (
        len(shape) != len(spec.shape)
        or any(isinstance(e, int) and e >= 0 and e != g for e, g in zip(spec.shape, shape))
    ):
        raise InputError(f"input {spec.name!r}: shape {list(shape)}, the model expects {list(spec.shape)}")


def load(path: str | os.PathLike, device=None) -> LoadedModel:
    """Load an exported ``.so`` (and its ``.json`` metadata) for running."""
    return LoadedModel(path, device)


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def _to_numpy(out):
    if isinstance(out, tvm.runtime.Tensor):
        return out.numpy()
    if isinstance(out, (list, tuple)) or hasattr(out, "__len__"):
        return [_to_numpy(o) for o in out]
    return out

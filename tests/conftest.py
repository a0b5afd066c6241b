"""Shared test helpers: compile-and-run, ONNX Runtime references, targets."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

from tvm_fusion import models
from tvm_fusion.targets import llvm_target

HAS_GPU = tvm.cuda(0).exist
requires_gpu = pytest.mark.skipif(
    not HAS_GPU, reason="no CUDA device on this machine: CUDA code is built and exported, not run"
)


@pytest.fixture(scope="session")
def cpu_target():
    return llvm_target()


def run_relax(mod: tvm.IRModule, feeds, target=None) -> np.ndarray:
    """Compile ``mod`` with plain tvm.compile on the CPU and run ``main``."""
    return run_executable(tvm.compile(mod, target=target or llvm_target()), feeds)


def run_executable(executable, feeds) -> np.ndarray:
    """Run a compiled module's ``main`` on the CPU; feeds as a dict (in input order) or a list."""
    vm = relax.VirtualMachine(executable, tvm.cpu())
    args = [tvm.runtime.tensor(v) for v in (feeds.values() if isinstance(feeds, dict) else feeds)]
    out = vm["main"](*args)
    return out.numpy() if hasattr(out, "numpy") else [o.numpy() for o in out]


def ort_run(model, feeds) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


def max_abs_err(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))))


@pytest.fixture
def example():
    """``example(name, **kw)`` -> (onnx model, feeds)."""

    def make(name, **kwargs):
        model = models.EXAMPLES[name](**kwargs)
        return model, models.random_inputs(model)

    return make

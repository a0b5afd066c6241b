"""Shared test helpers: compile-and-run, ONNX Runtime references, targets."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm import relax

from tvm_fusion import models
from tvm_fusion.targets import llvm_target

HAS_GPU = tvm.cuda(0).exist
# builds for AVX-512 targets run only on such a host; elsewhere they are compiled and inspected
HOST_HAS_AVX512 = "avx512f" in Path("/proc/cpuinfo").read_text()
requires_gpu = pytest.mark.skipif(
    not HAS_GPU, reason="no CUDA device on this machine: CUDA code is built and exported, not run"
)


@pytest.fixture(scope="session")
def cpu_target():
    return llvm_target()


def relax_main(inputs: dict, body) -> tvm.IRModule:
    """A module whose ``main`` takes float32 tensors named and shaped by ``inputs`` and returns
    ``body(bb, *params)``, built in one dataflow block (``body`` may ``bb.emit`` on the way)."""
    bb = relax.BlockBuilder()
    params = [relax.Var(name, relax.TensorType(shape, "float32")) for name, shape in inputs.items()]
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(body(bb, *params))
        bb.emit_func_output(out)
    return bb.get()


def run_outputs(mod_or_executable, feeds, target=None) -> list[np.ndarray]:
    """Every output of ``main`` run on the CPU. ``mod_or_executable``: a Relax module (compiled
    here with plain ``tvm.compile`` for ``target``, default this CPU) or a compiled executable;
    ``feeds``: a dict (in input order) or a list of arrays."""
    executable = mod_or_executable
    if isinstance(executable, tvm.IRModule):
        executable = tvm.compile(executable, target=target or llvm_target())
    vm = relax.VirtualMachine(executable, tvm.cpu())
    args = [tvm.runtime.tensor(v) for v in (feeds.values() if isinstance(feeds, dict) else feeds)]
    out = vm["main"](*args)
    return [out.numpy()] if isinstance(out, tvm.runtime.Tensor) else [o.numpy() for o in out]


def run_relax(mod: tvm.IRModule, feeds, target=None):
    """Compile ``mod`` with plain tvm.compile and run ``main``: one array, or a list for several outputs."""
    return _single(run_outputs(mod, feeds, target))


def run_executable(executable, feeds):
    """Run a compiled module's ``main`` on the CPU: one array, or a list for several outputs."""
    return _single(run_outputs(executable, feeds))


def _single(outputs: list):
    return outputs[0] if len(outputs) == 1 else outputs


def ort_outputs(model, feeds) -> list[np.ndarray]:
    """Every output of ``model`` in ONNX Runtime (the reference)."""
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def ort_run(model, feeds) -> np.ndarray:
    return ort_outputs(model, feeds)[0]


def random_feeds(model, seed=1) -> dict:
    """A standard-normal float32 array for every input of an ONNX model with static shapes."""
    rng = np.random.default_rng(seed)
    return {
        i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32)
        for i in model.graph.input
    }


def rel_err(got, ref) -> float:
    """max |got - ref| / max |ref|: the relative error the tests and docs/zoo.md bound."""
    return float(np.abs(got - ref).max() / np.abs(ref).max())


def max_abs_err(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))))


@pytest.fixture
def example():
    """``example(name, **kw)`` -> (onnx model, feeds)."""

    def make(name, **kwargs):
        model = models.EXAMPLES[name](**kwargs)
        return model, models.random_inputs(model)

    return make

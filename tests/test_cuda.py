"""CUDA: build and export everywhere (nvcc is present); run only where a GPU exists."""

import pytest
import tvm
from conftest import max_abs_err, ort_run, requires_gpu
from tvm import relax

from tvm_fusion import build, models

CUDA = {"kind": "cuda", "arch": "sm_80"}


@pytest.fixture(scope="module", params=["resnet_block_net", "transformer_block"])
def cuda_build(request, tmp_path_factory):
    model = models.example(request.param)
    result = build(model, CUDA, name=request.param, tuning_logs=None)
    path = result.export(tmp_path_factory.mktemp("cuda") / f"{request.param}.cuda.so")
    return model, result, path


def test_cuda_builds_and_exports(cuda_build):
    _, result, path = cuda_build
    assert path.stat().st_size > 10_000
    assert result.target.kind.name == "cuda"
    assert result.summary.kernels > 0
    # every PrimFunc needs a GPU schedule (thread bindings) to compile at all: all came from defaults
    prim_funcs = [f for _, f in result.lowered.functions.items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert result.tuned_kernels == 0 and result.default_kernels == len(prim_funcs)
    # The device code is inside: a cuda module with one kernel entry per fused group.
    # (Loading the .so needs the CUDA driver, which machines without a GPU lack.)
    cuda = _find_module(result.executable.mod, "cuda")
    source = cuda.inspect_source()
    assert ".entry" in source or "__global__" in source
    assert source.count("fused_") >= result.summary.fused_groups > 0
    assert b"fused_" in path.read_bytes()


def _find_module(mod, kind):
    if mod.kind == kind:
        return mod
    for sub in mod.imports:
        found = _find_module(sub, kind)
        if found is not None:
            return found
    return None


@requires_gpu
def test_cuda_numerics(cuda_build):
    model, _, path = cuda_build
    feeds = models.random_inputs(model)
    dev = tvm.cuda(0)
    vm = relax.VirtualMachine(tvm.runtime.load_module(str(path)), dev)
    got = vm["main"](*[tvm.runtime.tensor(v, dev) for v in feeds.values()]).numpy()
    assert max_abs_err(got, ort_run(model, feeds)) < 1e-3

"""Each kernel's time inside the model next to its time alone: which kernels lose to memory.

    python scripts/kernel_context.py model.onnx [--top 10]

For the slowest kernels of the untuned CPU build: the instrumented time per launch inside the model,
the same PrimFunc compiled and timed alone (inputs and weights hot in cache), and alone with every
argument but the first evicted before each call (weights from DRAM, as in the model). A kernel much
slower in the model than alone loses to memory traffic (weights streamed without overlap, inputs a
producer on another core just wrote), not to its schedule.
"""

from __future__ import annotations

import argparse

import numpy as np
import onnx
import tvm

import tvm_fusion
from tvm_fusion import models
from tvm_fusion.profiling import kernel_times
from tvm_fusion.targets import llvm_target


def kernel_context(path: str, top: int = 10) -> list[tuple[str, int, float, float, float]]:
    """``[(kernel, launches, ms in the model, ms alone, ms alone with cold weights)]`` per launch."""
    target = llvm_target()
    model = onnx.load(path)
    result = tvm_fusion.build(model, target, tuning_logs=None)
    vm = tvm.relax.VirtualMachine(result.executable, tvm.cpu())
    args = [tvm.runtime.tensor(v) for v in models.random_inputs(model, seed=0).values()]
    functions = {gv.name_hint: f for gv, f in result.lowered.functions_items()}
    rows = []
    for name, ms, launches in kernel_times(vm, args, repeat=10):
        if len(rows) >= top:
            break
        func = functions.get(name)
        if not isinstance(func, tvm.tirx.PrimFunc):
            continue
        lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=target)
        rng = np.random.default_rng(0)
        params = [
            tvm.runtime.tensor(rng.random([int(d) for d in p.shape]).astype(p.dtype)) for p in func.params
        ]
        hot = lib.mod.time_evaluator("main", tvm.cpu(), number=20, repeat=5)(*params).results
        cold = lib.mod.time_evaluator(
            "main", tvm.cpu(), number=1, repeat=30, f_preproc="cache_flush_cpu_non_first_arg"
        )(*params).results
        rows.append((name, launches, ms / launches, min(hot) * 1e3, float(np.median(cold)) * 1e3))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="an .onnx file")
    parser.add_argument("--top", type=int, default=10, help="slowest kernels to time alone (default 10)")
    args = parser.parse_args()
    print(f"{'kernel':48s} {'launches':>8s} {'in model':>9s} {'alone':>7s} {'cold wts':>8s}  (ms per launch)")
    for name, launches, in_model, alone, cold in kernel_context(args.model, args.top):
        print(f"{name[:48]:48s} {launches:8d} {in_model:9.3f} {alone:7.3f} {cold:8.3f}")


if __name__ == "__main__":
    main()

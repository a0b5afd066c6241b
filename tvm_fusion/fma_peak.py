"""The machine's FMA peak, measured with a kernel TVM compiles for the target.

Why: a roofline that takes numpy's GEMM rate as the compute limit (``Roofline.measure`` did) puts
our kernels above 100 % of it, and a limit derived from a data sheet (clock x FMA units x lanes)
is an assumption (turbo clocks, how a VM's cores are shared). This kernel keeps ``ACCUMULATORS``
independent vector FMA chains in registers on every core, with no memory traffic, so its rate is
the most FLOP/s that TVM's code can reach on this machine.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm.script import tirx as T

from .schedules._util import num_cores, vector_lanes
from .targets import llvm_target, parse_target

# enough independent chains to hide the FMA latency on every unit (4 cycles x 2 pipes, plus
# margin) while staying in the 16 vector registers of AVX2
ACCUMULATORS = 12
STEPS = 800_000  # FMA steps per chain and call: ~2.6 ms on the 2-core znver4 VM (the launch: <1 %)


def _kernel(tasks: int, lanes: int, steps: int):
    width = ACCUMULATORS * lanes

    @T.prim_func
    def fma_chains(x: T.Buffer((lanes,), "float32"), out: T.Buffer((tasks, width), "float32")):
        T.func_attr({"tirx.noalias": True})
        for task in T.parallel(tasks):
            acc = T.alloc_buffer((width,), "float32", scope="local")
            for a in T.unroll(ACCUMULATORS):
                for lane in T.vectorized(lanes):
                    acc[a * lanes + lane] = x[lane] + T.float32(a)
            for _step in range(steps):
                for a in T.unroll(ACCUMULATORS):
                    for lane in T.vectorized(lanes):
                        # with x = 0.5 every chain converges to 1.0: no denormals, no infinities
                        acc[a * lanes + lane] = acc[a * lanes + lane] * x[lane] + x[lane]
            for i in T.vectorized(width):
                out[task, i] = acc[i]

    return fma_chains


def fma_peak_gflops(target=None, tries: int = 10) -> float:
    """FP32 GFLOP/s of independent FMA chains on every core of ``target``: an LLVM target (``"llvm"``
    means this host's CPU, as everywhere in tvm_fusion), else this host's: the best of ``tries``
    calls, since other tenants only make a call slower."""
    target = parse_target(target) if target is not None else llvm_target()
    if target.kind.name != "llvm":  # a GPU target's roofline: the peak of the host that measures
        target = llvm_target()
    tasks, lanes = num_cores(target), vector_lanes(target, "float32")
    lib = tvm.compile(_kernel(tasks, lanes, STEPS), target=target)
    x = tvm.runtime.tensor(np.full(lanes, 0.5, dtype=np.float32))
    out = tvm.runtime.tensor(np.zeros((tasks, ACCUMULATORS * lanes), dtype=np.float32))
    timer = lib.mod.time_evaluator("fma_chains", tvm.cpu(), number=1, repeat=tries)
    best = min(timer(x, out).results)
    flops = 2 * tasks * STEPS * ACCUMULATORS * lanes
    return flops / best / 1e9

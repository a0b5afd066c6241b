"""Per-kernel times from the Relax VM, via its instrumentation hook.

This TVM's ``relax.VirtualMachine`` has no ``profile=True`` mode; ``set_instrument`` calls a
function before and after every call instruction, which is enough to time each kernel launch.
"""

from __future__ import annotations

import collections
import time

import tvm
from tvm import relax


def kernel_times(
    vm: relax.VirtualMachine, args, entry: str = "main", repeat: int = 10, device=None
) -> list[tuple[str, float, int]]:
    """``[(kernel, mean ms per inference, launches per inference)]``, slowest first."""
    device = device or tvm.cpu()
    totals: dict[str, float] = collections.defaultdict(float)
    counts: dict[str, int] = collections.defaultdict(int)
    started: dict[str, list[float]] = collections.defaultdict(list)

    def instrument(func, name, before, ret, *call_args):
        if before:
            device.sync()  # a GPU's earlier launches finish outside this kernel's time
            started[name].append(time.perf_counter())
        else:
            device.sync()
            totals[name] += time.perf_counter() - started[name].pop()
            counts[name] += 1
        return 0

    vm[entry](*args)  # warm-up, not timed
    vm.set_instrument(instrument)
    try:
        for _ in range(repeat):
            vm[entry](*args)
    finally:
        vm.set_instrument(None)
    rows = [
        (name, totals[name] * 1e3 / repeat, counts[name] // repeat)
        for name in totals
        if not name.startswith("vm.builtin")
    ]
    return sorted(rows, key=lambda r: -r[1])

#!/usr/bin/env python3
"""Calls per second of one loaded model shared by N threads, three ways, side by side in one
process with rounds interleaved (ratios are taken per round, so load from other processes hits
every variant alike):

* ``lock``: what ``LoadedModel`` does: one VM, calls take turns behind a lock;
* ``per_thread``: a VM per calling thread, every call at once;
* ``per_thread_capped``: a VM per thread, at most cores // TVM_NUM_THREADS calls at once (TVM gives
  each calling thread its own pool of TVM_NUM_THREADS workers, so more only oversubscribes).

python scripts/thread_throughput.py [--models mlp_bn resnet_block_net] [--threads 1 2 4] [--rounds 7]
(run it again with TVM_NUM_THREADS=1 for the regime where every core could serve its own call)
"""

import argparse
import os
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from tvm import relax

from tvm_fusion import build, load, models
from tvm_fusion.loaded import _to_numpy


class PerThreadModel:
    """A VM per calling thread over the loaded library; ``cap`` calls at most run at once."""

    def __init__(self, loaded, cap: int):
        self.loaded, self.local, self.cap = loaded, threading.local(), threading.BoundedSemaphore(cap)

    def __call__(self, *args):
        prepared = self.loaded._prepare(args, {})
        entry = self.loaded.entry_for(prepared)
        vm = getattr(self.local, "vm", None)
        if vm is None:
            vm = self.local.vm = relax.VirtualMachine(self.loaded.lib, self.loaded.device)
        with self.cap:
            return _to_numpy(vm[entry](*prepared))


class Workers:
    """``threads`` long-lived threads (as in a server's pool): thread start-up, each thread's first
    VM and TVM's per-thread worker pool are paid once, in a warm-up, not in the timings."""

    def __init__(self, threads: int):
        self.start, self.done = threading.Barrier(threads + 1), threading.Barrier(threads + 1)
        self.job = None
        self.threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(threads)]
        for t in self.threads:
            t.start()

    def _loop(self):
        while True:
            self.start.wait()
            if self.job is None:
                return
            fn, x, calls = self.job
            for _ in range(calls):
                fn(x)
            self.done.wait()

    def calls_per_second(self, fn, x, calls: int) -> float:
        self.job = (fn, x, calls)
        begin = time.perf_counter()
        self.start.wait()
        self.done.wait()
        return len(self.threads) * calls / (time.perf_counter() - begin)

    def close(self):
        self.job = None
        self.start.wait()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp_bn", "resnet_block_net"])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seconds", type=float, default=0.5, help="rough length of one measurement")
    args = parser.parse_args(argv)
    print(f"cores {os.cpu_count()}, TVM_NUM_THREADS {os.environ.get('TVM_NUM_THREADS')}")
    print(
        "| model | threads | lock (calls/s) | per thread | per thread, capped "
        "| per thread / lock | capped / lock |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            model = models.example(name)
            path = build(model, "llvm", name=name, tuning_logs=None).export(Path(tmp) / f"{name}.so")
            (x,) = models.random_inputs(model).values()
            cores, per_call = os.cpu_count() or 1, int(os.environ.get("TVM_NUM_THREADS") or 1)
            variants = {
                "lock": load(path),
                "per_thread": PerThreadModel(load(path), cap=1 << 20),
                "per_thread_capped": PerThreadModel(load(path), cap=max(1, cores // per_call)),
            }
            start = time.perf_counter()
            variants["lock"](x)
            calls = max(5, int(args.seconds / max(time.perf_counter() - start, 1e-5)) // 4)
            for threads in args.threads:
                workers = Workers(threads)
                samples = {key: [] for key in variants}
                order = list(variants.items())
                for _key, fn in order:  # warm-up: each thread's VM and TVM thread pool
                    workers.calls_per_second(fn, x, 3)
                for r in range(args.rounds):
                    for key, fn in order[r % 3 :] + order[: r % 3]:
                        samples[key].append(workers.calls_per_second(fn, x, calls))
                workers.close()
                base = np.array(samples["lock"])
                cells = [f"{np.median(samples[k]):.0f}" for k in variants]
                for key in ("per_thread", "per_thread_capped"):
                    ratios = np.array(samples[key]) / base  # paired by round
                    cells.append(f"{np.median(ratios):.2f} ({ratios.min():.2f}-{ratios.max():.2f})")
                print(f"| {name} | {threads} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python3
"""Calls per second of one loaded model shared by N threads: a VM per thread (what LoadedModel does)
against one VM behind a lock, side by side in one process, rounds interleaved (the ratio is taken
per round, so load from other processes hits both alike).

python scripts/thread_throughput.py [--models mlp_bn resnet_block_net] [--threads 1 2 4] [--rounds 5]
"""

import argparse
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from tvm_fusion import build, load, models
from tvm_fusion.loaded import _to_numpy


class LockedModel:
    """The alternative: the loading thread's one VM, calls serialised by a lock."""

    def __init__(self, loaded):
        self.loaded, self.lock, self.vm = loaded, threading.Lock(), loaded.vm

    def __call__(self, *args):
        prepared = self.loaded._prepare(args, {})
        entry = self.loaded.entry_for(prepared)
        with self.lock:
            out = self.vm[entry](*prepared)
        return _to_numpy(out)


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
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=0.5, help="rough length of one measurement")
    args = parser.parse_args(argv)
    print(
        "| model | threads | VM per thread (calls/s) | one VM + lock (calls/s) | ratio, median of rounds (range) |"
    )
    print("| --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            model = models.example(name)
            path = build(model, "llvm", name=name, tuning_logs=None).export(Path(tmp) / f"{name}.so")
            (x,) = models.random_inputs(model).values()
            per_thread = load(path)
            locked = LockedModel(load(path))
            start = time.perf_counter()
            per_thread(x)
            calls = max(5, int(args.seconds / max(time.perf_counter() - start, 1e-5)) // 4)
            for threads in args.threads:
                workers = Workers(threads)
                samples = {"per_thread": [], "lock": []}
                order = [("per_thread", per_thread), ("lock", locked)]
                for _key, fn in order:  # warm-up: each thread's VM and TVM thread pool
                    workers.calls_per_second(fn, x, 3)
                for r in range(args.rounds):
                    for key, fn in order if r % 2 == 0 else order[::-1]:
                        samples[key].append(workers.calls_per_second(fn, x, calls))
                workers.close()
                a, b = np.median(samples["per_thread"]), np.median(samples["lock"])
                ratios = np.array(samples["per_thread"]) / np.array(samples["lock"])  # paired by round
                print(
                    f"| {name} | {threads} | {a:.0f} | {b:.0f} | {np.median(ratios):.2f}x "
                    f"({ratios.min():.2f}-{ratios.max():.2f}) |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

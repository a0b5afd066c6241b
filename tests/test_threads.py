"""Importing tvm_fusion gives TVM's thread pool every core (TVM's own default halves it on x86)
and leaves its workers unpinned (TVM pins each to one core; a busy process there stalls every
kernel: docs/contention.md)."""

import json
import os
import subprocess
import sys

import pytest

_ENV_KEYS = ("TVM_NUM_THREADS", "OMP_NUM_THREADS", "TVM_BIND_THREADS")

# Runs one parallel kernel (the pool starts then) and prints the CPU sets of the threads it started.
_THREAD_AFFINITIES = """
import os, numpy as np, tvm_fusion, tvm
from tvm.script import tirx as T

@T.prim_func
def add_one(a: T.Buffer((4096,), "float32")):
    for i in T.parallel(4096):
        a[i] = a[i] + T.float32(1)

lib = tvm.compile(add_one, target="llvm")
x = tvm.runtime.tensor(np.zeros(4096, "float32"))
before = set(os.listdir("/proc/self/task"))
lib["add_one"](x)
assert float(x.numpy().min()) == 1.0
for tid in sorted(set(os.listdir("/proc/self/task")) - before):  # the pool's workers
    print(sorted(os.sched_getaffinity(int(tid))))
"""


def _child(code, env_overrides, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in _ENV_KEYS}
    env.update(env_overrides)
    script = tmp_path / "child.py"  # a file: TVMScript reads the kernel's source back
    script.write_text(code)
    return subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()


def _threads_in_child(env_overrides, tmp_path):
    return _child("import os, tvm_fusion; print(os.environ['TVM_NUM_THREADS'])", env_overrides, tmp_path)


def test_default_is_all_cores(tmp_path):
    assert _threads_in_child({}, tmp_path) == str(os.cpu_count())


def test_user_setting_wins(tmp_path):
    assert _threads_in_child({"TVM_NUM_THREADS": "1"}, tmp_path) == "1"


needs_two_cpus = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="thread pinning is only visible with 2+ CPUs"
)


@needs_two_cpus
def test_pool_workers_are_not_pinned(tmp_path):
    allowed = str(sorted(os.sched_getaffinity(0)))
    threads = _child(_THREAD_AFFINITIES, {}, tmp_path).splitlines()
    assert threads and set(threads) == {allowed}


@needs_two_cpus
def test_user_can_keep_tvm_pinning(tmp_path):
    threads = _child(_THREAD_AFFINITIES, {"TVM_BIND_THREADS": "1"}, tmp_path).splitlines()
    assert any(len(json.loads(cpus)) == 1 for cpus in threads)  # TVM pinned a worker to one core

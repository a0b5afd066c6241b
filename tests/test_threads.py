"""Importing tvm_fusion gives TVM's thread pool every core (TVM's own default halves it on x86)."""

import os
import subprocess
import sys


def _threads_in_child(env_overrides):
    env = {k: v for k, v in os.environ.items() if k not in ("TVM_NUM_THREADS", "OMP_NUM_THREADS")}
    env.update(env_overrides)
    code = "import os, tvm_fusion; print(os.environ['TVM_NUM_THREADS'])"
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()


def test_default_is_all_cores():
    assert _threads_in_child({}) == str(os.cpu_count())


def test_user_setting_wins():
    assert _threads_in_child({"TVM_NUM_THREADS": "1"}) == "1"

"""scripts/kernel_context.py: each kernel's time in the model next to its time alone (the table in
docs/performance.md's "In the model, not alone")."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import onnx

from tvm_fusion import models


def test_kernel_context_script_times_each_kernel_in_and_out_of_the_model(tmp_path):
    """scripts/kernel_context.py (the in-model vs alone table of docs/performance.md) on a small
    ResNet-style model: one row per kernel it timed, real times, names from the built module."""
    path = Path(__file__).resolve().parent.parent / "scripts" / "kernel_context.py"
    spec = importlib.util.spec_from_file_location("kernel_context_script", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    model_path = tmp_path / "net.onnx"
    onnx.save(models.resnet_block_net(), model_path)
    rows = script.kernel_context(str(model_path), top=3)
    assert len(rows) == 3
    for name, launches, in_model, alone, cold in rows:
        assert name.startswith("fused_") and launches >= 1
        assert 0 < alone and 0 < cold and 0 < in_model

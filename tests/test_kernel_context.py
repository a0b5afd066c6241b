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


def test_in_model_plans_script_forces_plans_and_keeps_numerics():
    """scripts/in_model_plans.py (docs/performance.md's in-model plan choice) on a small ResNet-style
    model: forcing plans changes the kernels it times, the per-kernel winners build, and that build
    computes what the default build does."""
    import numpy as np

    path = Path(__file__).resolve().parent.parent / "scripts" / "in_model_plans.py"
    spec = importlib.util.spec_from_file_location("in_model_plans_script", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    import tvm_ffi

    import tvm_fusion
    from tvm_fusion.targets import llvm_target

    model = models.resnet_block_net()
    lowered = {}
    for label, knobs in (("default", None), ("forced", {"plan": 1, "acc": 1})):
        with script.forced_knobs(lambda func, knobs=knobs: knobs):
            lowered[label] = tvm_fusion.build(model, llvm_target(), tuning_logs=None).lowered
    assert tvm_ffi.structural_hash(lowered["default"]) != tvm_ffi.structural_hash(lowered["forced"])
    choices, default_ms, chosen_ms, outputs = script.in_model_plans(model, plans=2, rounds=1)
    assert default_ms > 0 and chosen_ms > 0
    for name, knobs in choices.items():
        assert name.startswith("fused_") and set(knobs) == {"plan", "acc"}, (name, knobs)
    np.testing.assert_allclose(outputs["chosen"], outputs["default"], rtol=1e-4, atol=1e-5)

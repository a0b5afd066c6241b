"""The benchmark script completes in --quick mode and writes a table, a chart and raw numbers."""

import json

import pytest

from tvm_fusion import benchmark, models, targets, tuning


def test_quick_benchmark_completes(tmp_path):
    md = benchmark.run(
        "quick", tmp_path, runs=3, warmup=1, tuning_logs=tmp_path / "none", log=lambda *_: None
    )
    text = md.read_text()
    for variant in (
        "onnxruntime",
        "stock TVM (zero pipeline)",
        "tvm_fusion untuned",
        "tvm_fusion tuned",
        "unfused",
    ):
        assert variant in text
    rows = json.loads(md.with_suffix(".json").read_text())
    timed = [r for r in rows if r["median_ms"] is not None]
    assert len(timed) == 8  # 2 models x (ORT, stock, untuned, unfused); tuned has no records here
    assert all(r["max_abs_err"] < 1e-4 for r in timed)
    assert md.with_suffix(".png").stat().st_size > 5000
    assert "Distance from the machine limit" in text


@pytest.mark.slow
def test_stock_meta_schedule_tuned_row_uses_our_trial_budget(tmp_path):
    """The anchor a TVM user would otherwise pick: stock fusion + tune_relax with as many trials as
    our records hold, numerically checked like every variant, and its records reused."""
    logs, stock_logs = tmp_path / "logs", tmp_path / "stock"
    model = models.mlp_bn()
    tuning.tune_model(
        model, "llvm", name="mlp_bn", trials=2, log_root=logs, progress=False, check_default=False
    )
    target = targets.parse_target("llvm")
    rows = benchmark.benchmark_model(
        "mlp_bn",
        model,
        target,
        runs=3,
        warmup=1,
        tuning_logs=logs,
        rounds=1,
        log=lambda *_: None,
        variants=("onnxruntime", "untuned", "tuned", "stock tuned"),
        stock_tuning_logs=stock_logs,
    )
    by = {r.variant: r for r in rows}
    stock = by["stock Meta-Schedule tuned"]
    assert stock.median_ms is not None and stock.max_abs_err < 1e-4
    assert "2 trials (same budget)" in stock.note and "2 trials" in by["tvm_fusion tuned"].note
    stamp = json.loads((stock_logs / "mlp_bn" / targets.target_key(target) / "stock_tuning.json").read_text())
    assert stamp["trials"] == 2
    text = benchmark.format_markdown(rows, {}, benchmark.Roofline.for_target(target), target, 3, 1, 1)
    assert "## Tuning" in text and "tuned speed-up over stock MS tuned" in text

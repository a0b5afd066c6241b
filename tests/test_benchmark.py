"""The benchmark script completes in --quick mode and writes a table, a chart and raw numbers."""

import json

from tvm_fusion import benchmark


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

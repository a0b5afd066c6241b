"""scripts/bench_attention.py completes in --quick mode: every variant checked and timed."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))


@pytest.mark.slow
def test_quick_attention_benchmark_completes(tmp_path):
    import bench_attention

    out = tmp_path / "attention.md"
    assert bench_attention.main(["--quick", "--out", str(out)]) == 0
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    variants = {r["variant"] for r in rows}
    assert {"tvm_fusion, fused attention", "tvm_fusion, attention unfused", "ORT"} <= variants
    assert "ORT + transformers optimizer" in variants and "ORT MultiHeadAttention op" in variants
    assert all(r["rel_err"] < 1e-4 and r["median_ms"] > 0 for r in rows)
    fused = [r for r in rows if r["variant"] == "tvm_fusion, fused attention"]
    assert all(r["largest_intermediate"]["bytes"] > 0 for r in fused)
    assert "| tvm_fusion, fused attention |" in out.read_text()

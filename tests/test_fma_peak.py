"""The FMA-peak kernel (tvm_fusion/fma_peak.py): its hot loop is register FMAs only, so what it
measures is the machine's FMA throughput; Roofline.measure reports it as the peak."""

from __future__ import annotations

import re

import pytest
import tvm

from tvm_fusion import Roofline, fma_peak
from tvm_fusion.fma_peak import ACCUMULATORS, _kernel
from tvm_fusion.targets import llvm_target


def _hot_loop(asm: str) -> list[str]:
    """The instructions of the loop that holds the first FMA: from its label to the jump back."""
    lines = [ln.split("#")[0].strip() for ln in asm.splitlines()]  # without verbose-asm comments
    first = next(i for i, ln in enumerate(lines) if ln.startswith("vfmadd"))
    start = max(i for i in range(first) if re.match(r"^\.?L\w+:", lines[i]))
    label = lines[start].rstrip(":")
    end = next(i for i in range(first, len(lines)) if lines[i].startswith("j") and lines[i].endswith(label))
    return [ln for ln in lines[start + 1 : end] if ln and not ln.startswith(".")]


@pytest.mark.parametrize(("mcpu", "lanes", "register"), [("znver3", 8, "ymm"), ("skylake-avx512", 16, "zmm")])
def test_the_peak_loop_is_independent_register_fmas(mcpu, lanes, register):
    lib = tvm.compile(_kernel(2, lanes, 100), target=llvm_target(mcpu, 2))
    loop = _hot_loop(lib.mod.inspect_source("asm"))
    fmas = [ln for ln in loop if ln.startswith("vfmadd")]
    assert fmas and len(fmas) % ACCUMULATORS == 0, loop
    assert all(register in ln and "(" not in ln for ln in fmas), fmas  # no memory operand
    assert len({ln.split(",")[-1].strip() for ln in fmas}) == ACCUMULATORS  # independent chains
    others = [ln for ln in loop if not ln.startswith("vfmadd")]
    assert len(others) <= 3, others  # the trip count: an add / dec and a compare at most


def test_roofline_measure_reports_the_fma_peak(monkeypatch):
    monkeypatch.setattr(fma_peak, "fma_peak_gflops", lambda target=None, tries=10: 123.4)
    roof = Roofline.measure(size_mb=1, tries=1)
    assert roof.peak_gflops == 123.4 and roof.bandwidth_gbps > 0


def test_the_peak_runs_on_this_machine():
    assert fma_peak.fma_peak_gflops(llvm_target(num_cores=1), tries=1) > 1.0

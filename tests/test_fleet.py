"""Tuning on a fleet: a real TVM RPC tracker and servers on 127.0.0.1, started and stopped here.

The tracker/servers are ``tuning.fleet.LocalFleet``; tuning runs through the real CLI (in
subprocesses where a server is killed or a hang must be caught)."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import ort_run, run_executable

import tvm_fusion
from tvm_fusion import models, targets, tuning
from tvm_fusion.cli import main

CPU = targets.parse_target("llvm")


@pytest.fixture
def fleet(tmp_path):
    with tuning.fleet.LocalFleet("testcpu", 2, tmp_path / "fleet") as running:
        yield running


def _measurements(fleet, index: int) -> int:
    return fleet.server_log(index).count("load_module")


@pytest.mark.slow
def test_tune_on_two_servers_then_build_applies_the_records(fleet, tmp_path, capsys):
    logs = tmp_path / "logs"
    assert main(["fleet", f"127.0.0.1:{fleet.port}"]) == 0
    assert "testcpu                    2" in capsys.readouterr().out
    rpc = str(fleet.tracker)
    assert main(["tune", "mlp_bn", "--trials", "6", "--rpc", rpc, "--tuning-logs", str(logs)]) == 0
    out = capsys.readouterr().out
    assert "6 new trials (6 in all)" in out
    path = tuning.record_dir(logs, "mlp_bn", CPU, "testcpu")
    assert path.name == f"{targets.target_key(CPU)}@testcpu" and str(path) in out
    rset = tuning.read_record_set(path)
    assert len(rset.records) == 6 and rset.manifest["device_key"] == "testcpu"
    assert all(tuning.records.mean_secs(r) is not None for r in rset.records)  # every trial measured
    assert _measurements(fleet, 0) > 0 and _measurements(fleet, 1) > 0  # both servers were used

    model = models.mlp_bn()
    _, report = tuning.load_records(logs, "mlp_bn", tvm_fusion.frontend.model_hash(model), CPU)
    assert report.ok and report.path == path  # the one fleet record set is found without a key
    built = tvm_fusion.build(model, "llvm", name="mlp_bn", tuning_logs=logs, device_key="testcpu")
    winners = sum(
        1 for e in rset.manifest["tasks"].values() if tuning.beats_default(e["tuned_us"], e["default_us"])
    )
    assert built.tuned_kernels == winners
    feeds = models.random_inputs(model)
    np.testing.assert_allclose(
        run_executable(built.executable, feeds), ort_run(model, feeds), rtol=1e-4, atol=1e-4
    )


@pytest.mark.slow
def test_a_server_dying_mid_run_loses_nothing(fleet, tmp_path):
    logs = tmp_path / "logs"
    path = tuning.record_dir(logs, "mlp_bn", CPU, "testcpu")
    cmd = [sys.executable, "-m", "tvm_fusion", "tune", "mlp_bn", "--trials", "8", "--tuning-logs", str(logs)]
    proc = subprocess.Popen(
        [*cmd, "--rpc", str(fleet.tracker)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 300
    record_file = path / tuning.RECORD_FILE
    while not (record_file.exists() and len(record_file.read_text().splitlines()) >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, (
            proc.stderr.read() if proc.poll() else "timeout"
        )
        time.sleep(0.2)
    before = tuning.read_record_set(path).records
    fleet.servers[1].kill()  # mid-run: the other server takes its work
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    assert "8 new trials (8 in all)" in out
    after = tuning.read_record_set(path)
    assert len(after.records) == 8
    kept = {str(r.trace) for r in after.records}
    assert all(str(r.trace) in kept for r in before)  # nothing measured before the kill was lost


@pytest.mark.parametrize("what", ["tracker_down", "unknown_key"])
def test_no_fleet_is_one_clear_error_before_any_work(fleet, tmp_path, what):
    rpc = f"127.0.0.1:{fleet.port}:nosuchkey" if what == "unknown_key" else "127.0.0.1:1:testcpu"
    logs = tmp_path / "logs"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tvm_fusion",
            "tune",
            "mlp_bn",
            "--trials",
            "4",
            "--rpc",
            rpc,
            "--tuning-logs",
            str(logs),
        ],
        capture_output=True,
        text=True,
        timeout=120,  # a hang fails the test instead of stalling CI
    )
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    if what == "unknown_key":
        assert "has no server under key 'nosuchkey' (keys with servers: testcpu (2))" in line
    else:
        assert line.startswith("error: no RPC tracker at 127.0.0.1:1 (")
    assert not logs.exists()  # nothing written

"""Tuning records are never lost: one writer per folder, names that stay inside the records root,
clean stops on SIGTERM / double Ctrl-C, and every bad records folder reported in one line.

The data-loss and signal cases run the real ``tvm-fusion`` command in subprocesses and send real
signals; they tune the tiny ``mlp_bn`` example with a few trials.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tvm_fusion import models, targets, tuning
from tvm_fusion.cli import main
from tvm_fusion.errors import TuningRecordError

CPU = targets.parse_target("llvm")


def _tune_cmd(logs: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "tvm_fusion", "tune", "mlp_bn", "--tuning-logs", str(logs), *extra]


def _start(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _wait_for(predicate, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    deadline = time.time() + timeout
    while not predicate():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"tune exited early ({proc.returncode}):\n{out}\n{err}")
        if time.time() > deadline:
            proc.kill()
            pytest.fail("timed out waiting for tuning to make progress")
        time.sleep(0.2)


def _records_on_disk(logs: Path) -> int:
    path = tuning.record_dir(logs, "mlp_bn", CPU) / tuning.RECORD_FILE
    return len(path.read_text().splitlines()) if path.exists() else 0


# -- one writer per folder ------------------------------------------------------------------------


def test_second_tune_into_the_same_folder_refuses_and_loses_nothing(tmp_path):
    logs = tmp_path / "logs"
    first = _start(_tune_cmd(logs, "--trials", "4"))
    lock = Path(str(tuning.record_dir(logs, "mlp_bn", CPU)) + ".lock")
    _wait_for(lambda: lock.exists() and lock.read_text().strip() == f"pid {first.pid}", first)
    second = subprocess.run(_tune_cmd(logs, "--trials", "4"), capture_output=True, text=True, timeout=300)
    assert second.returncode == 2, second.stderr
    (line,) = [ln for ln in second.stderr.splitlines() if ln.startswith("error:")]
    assert f"another tuning run (pid {first.pid}) is writing these records" in line
    out, err = first.communicate(timeout=600)
    assert first.returncode == 0, err
    assert "4 new trials (4 in all)" in out
    rset = tuning.read_record_set(tuning.record_dir(logs, "mlp_bn", CPU))
    assert len(rset.records) == 4 and rset.manifest["num_records"] == 4  # nobody overwrote the first run


def test_lock_is_released_when_the_holder_dies(tmp_path):
    path = tmp_path / "m" / "llvm-x"
    holder = _start(
        [
            sys.executable,
            "-c",
            f"""
from pathlib import Path
from tvm_fusion.tuning import RecordLock
with RecordLock(Path({str(path)!r})):
    print("locked", flush=True)
    input()
""",
        ]
    )
    assert holder.stdout.readline().strip() == "locked"
    with pytest.raises(TuningRecordError, match=rf"another tuning run \(pid {holder.pid}\)"):
        with tuning.RecordLock(path):
            pass
    holder.kill()
    holder.wait()
    with tuning.RecordLock(path):  # the kernel dropped the dead process's lock
        pass


# -- names never leave the records root -----------------------------------------------------------


@pytest.mark.parametrize("name", ["..", "...", "../escape", "/abs/path", "a/b", ".hidden", "x" * 300, ""])
def test_record_folders_stay_inside_the_root(tmp_path, name):
    path = tuning.record_dir(tmp_path, name, CPU)
    assert path.resolve().parent.parent == tmp_path.resolve()
    assert not path.parent.name.startswith(".") and len(path.parent.name) <= tuning.records.MAX_NAME_LENGTH


def test_long_names_do_not_collide():
    assert tuning.safe_folder_name("x" * 300 + "a") != tuning.safe_folder_name("x" * 300 + "b")


def test_cli_name_dotdot_writes_under_the_root(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    logs = tmp_path / "logs"
    assert main(["tune", "mlp_bn", "--name", "..", "--trials", "0", "--tuning-logs", str(logs)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs"]
    assert (logs / "model" / targets.target_key(CPU) / tuning.MANIFEST_FILE).exists()


# -- clean stops -------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("how", ["sigterm", "double_ctrl_c"])
def test_signals_during_tune_stop_cleanly_and_keep_records(tmp_path, how):
    logs = tmp_path / "logs"
    proc = _start(_tune_cmd(logs, "--trials", "64"))
    _wait_for(lambda: _records_on_disk(logs) >= 2, proc)
    if how == "sigterm":
        proc.send_signal(signal.SIGTERM)
    else:
        proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == (143 if how == "sigterm" else 130), err
    assert "Traceback" not in err and "terminate" not in err
    rset = tuning.read_record_set(tuning.record_dir(logs, "mlp_bn", CPU))  # valid, nothing half-written
    assert len(rset.records) >= 2
    folder = tuning.record_dir(logs, "mlp_bn", CPU)
    assert not [p.name for p in folder.iterdir() if p.name.endswith(".tmp")]
    # and it resumes from there
    again = subprocess.run(_tune_cmd(logs, "--trials", "2"), capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "resuming from" in again.stderr


# -- bad records folders: one line, never a traceback --------------------------------------------


@pytest.fixture
def record_set(tmp_path):
    """A small valid record folder (no measuring: trials=0 writes the manifest and workloads)."""
    logs = tmp_path / "logs"
    assert main(["tune", "mlp_bn", "--trials", "0", "--tuning-logs", str(logs)]) == 0
    return logs, tuning.record_dir(logs, "mlp_bn", CPU)


def _load(logs):
    imported_hash = json.loads((tuning.record_dir(logs, "mlp_bn", CPU) / tuning.MANIFEST_FILE).read_text())[
        "model_hash"
    ]
    return tuning.load_records(logs, "mlp_bn", imported_hash, CPU)


@pytest.mark.parametrize(
    "field,value,expect",
    [
        ("tasks", [1, 2], "field 'tasks' is [1, 2], expected an object"),
        ("num_records", "abc", "field 'num_records' is \"abc\", expected an integer"),
        ("num_workloads", True, "field 'num_workloads' is true, expected an integer"),
        ("target", "llvm", "field 'target' is \"llvm\", expected an object"),
    ],
)
def test_manifest_fields_of_the_wrong_type_are_named(record_set, field, value, expect):
    logs, path = record_set
    manifest = json.loads((path / tuning.MANIFEST_FILE).read_text())
    manifest[field] = value
    (path / tuning.MANIFEST_FILE).write_text(json.dumps(manifest))
    db, report = _load(logs)
    assert db is None and report.status == "corrupt"
    assert expect in str(report) and str(path / tuning.MANIFEST_FILE) in str(report)


def test_manifest_task_entry_not_an_object(record_set):
    logs, path = record_set
    manifest = json.loads((path / tuning.MANIFEST_FILE).read_text())
    manifest["tasks"] = {"123": 5}
    (path / tuning.MANIFEST_FILE).write_text(json.dumps(manifest))
    _, report = _load(logs)
    assert report.status == "corrupt" and "task '123' is 5, expected a JSON object" in str(report)


def test_manifest_that_is_a_folder(tmp_path, capsys):
    logs = tmp_path / "logs"
    (tuning.record_dir(logs, "mlp_bn", CPU) / tuning.MANIFEST_FILE).mkdir(parents=True)
    assert main(["build", "mlp_bn", "--tuning-logs", str(logs), "-o", str(tmp_path / "m.so")]) == 0
    out = capsys.readouterr().out
    assert "manifest.json: cannot read" in out and "using default schedules" in out


def test_deleted_records_file_is_reported_as_missing(record_set):
    logs, path = record_set
    manifest = json.loads((path / tuning.MANIFEST_FILE).read_text())
    manifest["num_records"] = 3
    (path / tuning.MANIFEST_FILE).write_text(json.dumps(manifest))
    (path / tuning.RECORD_FILE).unlink()
    _, report = _load(logs)
    assert f"{path / tuning.RECORD_FILE}: missing, the manifest lists 3 records" in str(report)


def test_tuning_logs_that_is_a_file(tmp_path, capsys):
    logs = tmp_path / "logs"
    logs.write_text("not a folder")
    assert main(["tune", "mlp_bn", "--trials", "1", "--tuning-logs", str(logs)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {logs}: is a file, cannot hold tuning records"]
    assert main(["build", "mlp_bn", "--tuning-logs", str(logs), "-o", str(tmp_path / "m.so")]) == 0
    assert f"{logs}: is a file, not a tuning-records folder: ignored" in capsys.readouterr().out


def test_unwritable_tuning_logs_is_one_line(tmp_path, capsys, monkeypatch):
    """(The tests run as root, where chmod does not stop writes, so the OS error is injected.)"""
    logs = tmp_path / "logs"

    def refuse(path, _text):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(tuning.records, "write_text_atomic", refuse)
    assert main(["tune", "mlp_bn", "--trials", "1", "--tuning-logs", str(logs)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"error: {tuning.record_dir(logs, 'mlp_bn', CPU)}")
    assert "cannot write tuning records (Permission denied)" in line


def test_unreadable_records_are_reported_and_build_goes_on(record_set, monkeypatch):
    logs, path = record_set
    real_read = Path.read_text

    def read(self, *args, **kwargs):
        if self.name == tuning.MANIFEST_FILE:
            raise PermissionError(13, "Permission denied", str(self))
        return real_read(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", read)
    db, report = tuning.load_records(logs, "mlp_bn", "whatever", CPU)
    assert db is None and report.status == "corrupt"
    assert f"{path / tuning.MANIFEST_FILE}: cannot read (Permission denied)" in str(report)


def test_negative_trials_is_an_error(tmp_path, capsys):
    assert main(["tune", "mlp_bn", "--trials", "-3", "--tuning-logs", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == "error: trials must be 0 or more, got -3"
    assert list(tmp_path.iterdir()) == []


def test_tune_with_symbolic_dims_says_what_to_do(tmp_path, capsys):
    g = models.GraphBuilder("dyn")
    x = g.input("input", ("batch", 32))
    model = g.finish([g.relu(g.linear(x, 32, 16))])
    path = tmp_path / "dyn.onnx"
    path.write_bytes(model.SerializeToString())
    assert main(["tune", str(path), "--trials", "2", "--tuning-logs", str(tmp_path / "logs")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "symbolic dims (batch)" in line and "fixed shapes" in line

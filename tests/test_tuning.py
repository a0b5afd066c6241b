"""Meta-Schedule tuning: records are stored atomically, resumed, validated and applied by hash.

Fast tests use *fabricated* records (design-space schedules with made-up run times), which go
through the same save/load/apply code as measured ones without measuring anything; the tests that
really measure tune a one- or two-matmul model with a handful of trials.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import tvm
import tvm_ffi
from conftest import ort_run, run_executable

import tvm_fusion
from tvm_fusion import files, frontend, models, targets, tuning
from tvm_fusion.errors import TargetError, TuningRecordError, TvmFusionError
from tvm_fusion.pipeline import unscheduled_module
from tvm_fusion.schedules import TunableMatmul, gpu_matmul
from tvm_fusion.tuning.defaults import default_fingerprint

# -- helpers ------------------------------------------------------------------------------------


def _tiny_model(widths=(32, 32), batch: int = 8):
    """Linear+ReLU layers; distinct widths give distinct PrimFuncs (identical ones are one task)."""
    g = models.GraphBuilder(f"tiny{len(widths) - 1}", 0)
    y = g.input("x", (batch, widths[0]))
    for din, dout in zip(widths, widths[1:]):
        y = g.relu(g.linear(y, din, dout))
    return g.finish([y])


def _fused(model, target):
    """The module the real build schedules (project pipeline, schedule=False)."""
    imported = frontend.import_onnx(model)
    return imported, unscheduled_module(imported.mod, target)


def _tune_quietly(imported, mod, target, log_root, **kw):
    """``tuning.tune`` of a fused module, 2 candidates per batch, no progress bar."""
    kw.setdefault("num_trials_per_iter", 2)
    return tuning.tune(
        mod,
        target,
        model_name=imported.name,
        model_hash=imported.model_hash,
        log_root=log_root,
        progress=False,
        **kw,
    )


def _set_task_fields(path: Path, **fields):
    """Edit every task entry of a record folder's manifest (fabricated timings)."""
    mpath = path / tuning.MANIFEST_FILE
    manifest = json.loads(mpath.read_text())
    for entry in manifest["tasks"].values():
        entry.update(fields)
    mpath.write_text(json.dumps(manifest))


@pytest.fixture(scope="module")
def cpu():
    return targets.parse_target("llvm")


@pytest.fixture(scope="module")
def ms_ready():
    """Tuning needs cloudpickle and a tvm-ffi that can serialize IR; fail with the reason if not."""
    try:
        tuning.check_environment()
    except TvmFusionError as err:
        pytest.fail(str(err))
    tuning.load_tensor_intrinsics()


def _fabricate(mod, target, log_root, name, model_hash, run_us=10.0):
    """Store one record per design-space schedule of each task, as `tune` would, without measuring."""
    from tvm.s_tir import meta_schedule as ms

    rset = tuning.RecordSet(
        path=tuning.record_dir(log_root, name, target), manifest=tuning.new_manifest(name, model_hash, target)
    )
    for i, task in enumerate(tuning.extract_tasks(mod, target)):
        ctx = ms.TuneContext(
            mod=task.dispatched[0],
            target=tuning.tuning_target(target),
            space_generator="post-order-apply",
            search_strategy="evolutionary",
            task_name=task.task_name,
            num_threads=1,
            rand_state=i,
        ).clone()
        workload = ms.database.Workload(task.dispatched[0])
        rset.workloads.append(workload)
        rset.manifest["tasks"][tuning.workload_key(task.dispatched[0])] = {
            "name": task.task_name,
            "budget": 0,
            "trials": 0,
        }
        args = ms.arg_info.ArgInfo.from_prim_func(task.dispatched[0]["main"])
        for sch in ctx.generate_design_space():
            rset.records.append(ms.database.TuningRecord(sch.trace, workload, [run_us * 1e-6], target, args))
    rset.save()
    return rset


# -- no TVM tuning machinery needed -------------------------------------------------------------


def test_split_budget():
    assert tuning.split_budget(10, 3, None) == [4, 3, 3]
    assert tuning.split_budget(10, 3, 2) == [2, 2, 2]
    assert tuning.split_budget(2, 3, None) == [1, 1, 0]
    assert tuning.split_budget(5, 0, None) == []


def test_atomic_write_keeps_old_file_on_failure(tmp_path, monkeypatch):
    path = tmp_path / "manifest.json"
    files.write_text_atomic(path, "old\n")

    def boom(_fd):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError, match="disk full"):
        files.write_text_atomic(path, "new content that never lands\n")
    assert path.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json"]  # no temp file left


def test_cuda_tuning_without_gpu_fails_fast(cpu, tmp_path):
    if tvm.cuda(0).exist:
        pytest.skip("this machine has a GPU")
    cuda = targets.parse_target("cuda")
    _, mod = _fused(_tiny_model(), cpu)
    with pytest.raises(TargetError, match=r"no cuda device.*rpc="):
        tuning.tune(mod, cuda, model_name="m", model_hash="h", trials=4, log_root=tmp_path, progress=False)
    assert not any(tmp_path.iterdir())  # failed before touching the log folder


@pytest.mark.parametrize("spec", ["localhost", "host:port:key", ":9190:key", "host:9190:"])
def test_bad_rpc_spec_is_a_target_error(spec):
    with pytest.raises(TargetError, match="host:port:key"):
        tuning.parse_rpc(spec)


def test_cuda_records_made_before_the_implied_shared_memory_attribute_still_match():
    """CUDA targets now carry max_shared_memory_per_block (what dlight assumed anyway); record
    sets whose manifest target lacks it are still for this target, one with another value is not."""
    target = targets.parse_target({"kind": "cuda", "arch": "sm_90"})
    old = {k: v for k, v in targets.target_json(target).items() if k != "max_shared_memory_per_block"}
    manifest = tuning.new_manifest("m", "h", target)
    manifest["target"] = old
    assert tuning.check_compatible(manifest, "h", target) == []
    manifest["target"] = {**old, "max_shared_memory_per_block": 99_000}
    assert "differs in max_shared_memory_per_block" in tuning.check_compatible(manifest, "h", target)[0]


def test_rpc_spec_parses():
    tracker = tuning.parse_rpc("10.0.0.2:9190:a100")
    assert (tracker.host, tracker.port, tracker.key) == ("10.0.0.2", 9190, "a100")
    cfg = tracker.config(session_timeout_s=30)
    assert (cfg.tracker_host, cfg.tracker_port, cfg.tracker_key, cfg.session_timeout_sec) == (
        "10.0.0.2",
        9190,
        "a100",
        30,
    )


def test_cuda_target_gets_meta_schedule_attributes():
    target = tuning.tuning_target(targets.parse_target("cuda"))
    assert int(target.attrs["max_threads_per_block"]) == 1024
    assert target.host is not None and target.host.kind.name == "llvm"
    assert tuning.tuning_target(targets.parse_target("llvm")).kind.name == "llvm"


def test_load_records_missing_folder(cpu, tmp_path):
    db, report = tuning.load_records(tmp_path, "nothing", "abc", cpu)
    assert db is None and report.status == "missing"
    assert "no tuning records" in str(report)


# -- fabricated records: save / load / validate / apply ---------------------------------------


@pytest.fixture(scope="module")
def fabricated(ms_ready, cpu, tmp_path_factory):
    model = _tiny_model()
    imported, mod = _fused(model, cpu)
    root = tmp_path_factory.mktemp("fab")
    _fabricate(mod, cpu, root, imported.name, imported.model_hash)
    return root, imported, mod, model


def _copy(fabricated, tmp_path):
    root, imported, mod, model = fabricated
    dst = tmp_path / "logs"
    shutil.copytree(root, dst)
    return dst, imported, tuning.record_dir(dst, imported.name, targets.parse_target("llvm"))


def test_fabricated_records_apply_and_match_untuned(fabricated, cpu):
    root, imported, mod, model = fabricated
    db, report = tuning.load_records(root, imported.name, imported.model_hash, cpu)
    assert report.ok and db is not None, str(report)
    assert report.num_workloads == 1 and report.num_records >= 1
    manifest = json.loads((report.path / "manifest.json").read_text())
    assert manifest["model_hash"] == imported.model_hash
    assert manifest["target"] == json.loads(str(cpu)) and manifest["tvm_version"] == tvm.__version__

    (kernel,) = [gv.name_hint for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert kernel.startswith("fused_matmul_add_relu")  # renamed by the layout-free marking
    tuned = tvm_fusion.build(model, cpu, database=db)
    plain = tvm_fusion.build(model, cpu, tuning_logs=None)
    assert (tuned.tuned_kernels, plain.tuned_kernels) == (1, 0)
    assert "1 kernel functions tuned" in tuned.describe()
    assert not tvm_ffi.structural_equal(tuned.lowered, plain.lowered)  # the record's schedule, not ours

    inputs = models.random_inputs(model)
    np.testing.assert_allclose(
        run_executable(tuned.executable, inputs),
        run_executable(plain.executable, inputs),
        rtol=1e-5,
        atol=1e-5,
    )


@pytest.mark.parametrize(
    "fields,applied",
    [
        ({"default_us": 50.0}, False),  # records say 1e6 us: slower than the default
        ({"default_us": 5e6}, True),  # faster than a (fabricated) very slow default
        # the side-by-side re-timing (tuned_us) decides when it covers all trials on disk ...
        ({"default_us": 5e6, "tuned_us": 6e6, "verified_trials": "ALL"}, False),
        # ... and is ignored when trials were added after it (then the records' latency counts)
        ({"default_us": 5e6, "tuned_us": 6e6, "verified_trials": -1}, True),
    ],
)
def test_records_not_faster_than_default_are_not_applied(ms_ready, cpu, tmp_path, fields, applied):
    model = _tiny_model()
    imported, mod = _fused(model, cpu)
    rset = _fabricate(mod, cpu, tmp_path, imported.name, imported.model_hash, run_us=1e6)
    fields = dict(fields)
    if fields.get("verified_trials") == "ALL":
        fields["verified_trials"] = len(rset.records)
    _set_task_fields(rset.path, **fields)

    db, report = tuning.load_records(tmp_path, imported.name, imported.model_hash, cpu)
    assert report.ok and report.num_applied == int(applied), str(report)
    built = tvm_fusion.build(model, "llvm", tuning_logs=tmp_path)
    assert built.tuned_kernels == int(applied)
    if applied:
        assert db is not None and not report.skipped
    else:
        assert db is None
        assert len(report.skipped) == 1 and re.match(r"fused_matmul_add_relu\d*: tuned", report.skipped[0])
        assert (
            "1 of 1 tuned functions not faster than the default schedule by more than 3% (timing noise): not applied"
            in str(report)
        )
        assert "not applied" in str(built.records_note)
    # without the check everything applies
    db_all, report_all = tuning.load_records(
        tmp_path, imported.name, imported.model_hash, cpu, only_faster=False
    )
    assert db_all is not None and report_all.num_applied == 1
    inputs = models.random_inputs(model)
    np.testing.assert_allclose(
        run_executable(built.executable, inputs), ort_run(model, inputs), rtol=1e-4, atol=1e-4
    )


def test_default_baseline_is_the_kernel_the_build_runs(cpu):
    """The baseline timed for each task has the build's pre-packed weight layout (compile-time
    constant), not the original one with a packing copy inside the kernel."""
    from tvm.s_tir import meta_schedule as ms

    model = _tiny_model((16, 64, 16))
    imported, mod = _fused(model, cpu)
    baselines = tuning.default_schedule_modules(tuning.extract_tasks(mod, cpu), cpu)
    assert len(baselines) == 2
    timed = {
        tuple(
            tuple(int(d) for d in a.shape)
            for a in ms.arg_info.ArgInfo.from_entry_func(m, remove_preproc=True)
        )
        for m in baselines.values()
    }
    lowered = tvm_fusion.build(model, "llvm", tuning_logs=None).lowered
    built = {
        tuple(tuple(int(d) for d in p.shape) for p in f.params)
        for _, f in lowered.functions_items()
        if isinstance(f, tvm.tirx.PrimFunc)
    }
    assert timed == built
    # the 16->64 layer's (16, 64) weight is packed into column panels, (64 / panel, 16, panel),
    # whatever the panel width this CPU's vector length gives
    packed = [sig[1] for sig in timed if sig[0] == (8, 16)]
    assert (
        len(packed) == 1 and len(packed[0]) == 3 and packed[0][1] == 16 and packed[0][0] * packed[0][2] == 64
    )


def test_records_for_another_model_are_reported_and_ignored(fabricated, cpu):
    root, imported, mod, _ = fabricated
    db, report = tuning.load_records(root, imported.name, "0123456789abcdef", cpu)
    assert db is None and report.status == "mismatch"
    assert f"made for model hash {imported.model_hash}, this model is 0123456789abcdef: ignored" in str(
        report
    )
    with pytest.raises(TuningRecordError, match="made for model hash"):
        tuning.load_records(root, imported.name, "0123456789abcdef", cpu, strict=True)


@pytest.mark.parametrize(
    "field,value,expect",
    [
        ("tvm_version", "0.20.0", "made with TVM 0.20.0"),
        ("target", {"kind": "llvm", "mcpu": "skylake-avx512", "num-cores": 2}, "made for target"),
    ],
)
def test_records_for_another_tvm_or_target_are_ignored(fabricated, cpu, tmp_path, field, value, expect):
    root, imported, path = _copy(fabricated, tmp_path)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest[field] = value
    (path / "manifest.json").write_text(json.dumps(manifest))
    db, report = tuning.load_records(root, imported.name, imported.model_hash, cpu)
    assert db is None and report.status == "mismatch"
    assert expect in str(report) and str(path) in str(report) and "ignored" in str(report)


def test_records_for_other_target_key_are_mentioned(fabricated, tmp_path):
    root, imported, _ = _copy(fabricated, tmp_path)
    other = targets.parse_target({"kind": "llvm", "mcpu": "znver3", "num-cores": 16})
    db, report = tuning.load_records(root, imported.name, imported.model_hash, other)
    assert db is None and report.status == "missing"
    assert f"records exist for other targets: {targets.target_key(targets.parse_target('llvm'))}" in str(
        report
    )


@pytest.mark.parametrize("damage", ["cut_mid_line", "drop_last_line", "garbage_manifest", "no_manifest"])
def test_corrupt_records_are_reported_and_build_uses_defaults(fabricated, cpu, tmp_path, damage):
    root, imported, path = _copy(fabricated, tmp_path)
    rec = path / tuning.RECORD_FILE
    text = rec.read_text()
    if damage == "cut_mid_line":
        rec.write_text(text[: len(text) // 2])
        bad_file = rec
    elif damage == "drop_last_line":
        rec.write_text("".join(text.splitlines(keepends=True)[:-1]))
        bad_file = rec
    elif damage == "garbage_manifest":
        (path / "manifest.json").write_text('{"model_hash": ')
        bad_file = path / "manifest.json"
    else:
        (path / "manifest.json").unlink()
        bad_file = path / "manifest.json"
    db, report = tuning.load_records(root, imported.name, imported.model_hash, cpu)
    assert db is None and report.status == "corrupt"
    assert str(bad_file) in str(report) and "default schedules" in str(report)
    with pytest.raises(TuningRecordError, match=str(bad_file).replace(".", r"\.")):
        tuning.load_records(root, imported.name, imported.model_hash, cpu, strict=True)
    model = fabricated[3]
    built = tvm_fusion.build(model, cpu, name=imported.name, tuning_logs=root)  # goes on with defaults
    assert (
        built.tuned_kernels == 0 and built.records_status == "corrupt" and str(bad_file) in built.records_note
    )
    assert run_executable(built.executable, models.random_inputs(model)).shape == (8, 32)


def test_cuda_build_with_records_needs_no_gpu(ms_ready, cpu, tmp_path):
    cuda = targets.parse_target("cuda")
    model = _tiny_model()
    imported, mod = _fused(model, cuda)
    _fabricate(mod, cuda, tmp_path, imported.name, imported.model_hash)
    db, report = tuning.load_records(tmp_path, imported.name, imported.model_hash, cuda)
    assert report.ok and report.path.name == "cuda-sm_80", str(report)
    built = tvm_fusion.build(model, cuda, database=db)
    assert built.tuned_kernels == 1 and built.default_kernels == 0
    source = "".join(m.inspect_source() for m in _all_modules(built.executable.mod) if m.kind == "cuda")
    assert "__global__" in source and "fused_matmul_add_relu" in source


def test_cuda_rule_space_record_replays_into_a_cuda_build(ms_ready, tmp_path):
    """The GPU space (dlight's Matmul config as knobs): the default point is the rule's untuned
    schedule, dlight's own is a point of the space, and a record from another point replays into
    a CUDA build that compiles and exports (no GPU needed)."""
    from tvm.s_tir import dlight as dl
    from tvm.s_tir import meta_schedule as ms

    cuda = targets.parse_target("cuda")
    search_target = tuning.tuning_target(cuda)
    model = _tiny_model((64, 128), batch=32)
    imported, mod = _fused(model, cuda)
    (task,) = tuning.extract_tasks(mod, cuda)
    func = task.dispatched[0]["main"]
    space = tuning.rule_space(func, search_target)
    assert space is not None and space.rule_type.__name__ == "TunableMatmul"
    with search_target:
        stock = dl.gpu.Matmul().apply(func, search_target, False)
        untuned = TunableMatmul().apply(func, search_target, False)
    default_point = (0,) * len(space.names)
    tvm.ir.assert_structural_equal(space.schedule(func, search_target, default_point)[0].mod, untuned.mod)
    # this 32x64 output leaves the GPU idle under every tile: choice 0 is the smallest tile, and
    # dlight's own 8x16 threads x 4x4 micro-tiles is another point of the space
    with search_target:
        own, _ = TunableMatmul()._own_config(func, search_target, dl.gpu.Matmul().get_configs(search_target))
    assert (own.micro_size_x, own.micro_size_y) != (4, 4)

    def choice(name, value):
        mine = tuple(getattr(own, field) for field in gpu_matmul._FIELDS[name])
        return list(dict.fromkeys([mine, *gpu_matmul.ALTERNATIVES[name]])).index(value)

    dlight = {"threads": (8, 16), "micro": (4, 4)}
    dlight_point = tuple(choice(n, dlight[n]) if n in dlight else 0 for n in space.names)
    assert any(dlight_point)
    tvm.ir.assert_structural_equal(space.schedule(func, search_target, dlight_point)[0].mod, stock.mod)

    point = tuple(2 if n in ("threads", "micro") else 0 for n in space.names)  # neither of the two
    sch, effective = space.schedule(func, search_target, point)
    assert effective == point and not tvm_ffi.structural_equal(sch.mod, stock.mod)
    rset = tuning.RecordSet(
        path=tuning.record_dir(tmp_path, imported.name, cuda),
        manifest=tuning.new_manifest(imported.name, imported.model_hash, cuda),
    )
    workload = ms.database.Workload(task.dispatched[0])
    rset.workloads.append(workload)
    rset.records.append(
        ms.database.TuningRecord(
            sch.trace, workload, [1e-6], search_target, ms.arg_info.ArgInfo.from_prim_func(func)
        )
    )
    rset.manifest["tasks"][tuning.workload_key(task.dispatched[0])] = {
        "name": task.task_name,
        "default_us": 5.0,
    }
    rset.save()
    built = tvm_fusion.build(model, cuda, tuning_logs=tmp_path, name=imported.name)
    assert built.tuned_kernels == 1, built.records_note
    path = built.export(tmp_path / "tuned_cuda.so")
    assert path.stat().st_size > 0
    source = "".join(m.inspect_source() for m in _all_modules(built.executable.mod) if m.kind == "cuda")
    assert "__global__" in source


def _all_modules(mod):
    yield mod
    for sub in mod.imports:
        yield from _all_modules(sub)


# -- real tuning (measures on this CPU) --------------------------------------------------------


def _files(path: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(path.iterdir())}


def test_tune_model_records_are_used_by_the_real_build(ms_ready, cpu, tmp_path):
    """tune_model fuses with the build's own passes, so tvm_fusion.build finds every record; each
    task's best schedule is timed against its default schedule and only winners are applied."""
    model = models.mlp_bn()
    imported = frontend.import_onnx(model, name="mlp_bn")
    res = tuning.tune_model(
        imported,
        cpu,
        trials=4,
        log_root=tmp_path,
        policy=None,
        options={"layout": True},
        num_trials_per_iter=2,
        population_size=32,
        progress=False,
        in_model=False,  # the side-by-side check alone (the in-model one: its own test below)
    )
    assert [t.trials for t in res.tasks] == [2, 2] and res.new_trials == 4
    text = str(res)
    assert all(t.name in text for t in res.tasks) and "side by side" in text
    manifest = json.loads((res.record_dir / tuning.MANIFEST_FILE).read_text())
    for entry in manifest["tasks"].values():
        assert entry["default_us"] > 0 and entry["tuned_us"] > 0 and entry["verified_trials"] == 2
    winners = sum(
        1 for e in manifest["tasks"].values() if e["tuned_us"] < e["default_us"] * (1 - tuning.MIN_GAIN)
    )
    assert sum(1 for t in res.tasks if t.applied) == winners

    inputs = models.random_inputs(model)
    reference = ort_run(model, inputs)
    untuned = tvm_fusion.build(model, "llvm", name="mlp_bn", tuning_logs=None)
    built = tvm_fusion.build(model, "llvm", name="mlp_bn", tuning_logs=tmp_path)
    assert built.tuned_kernels == winners  # every record matched; losers were left out
    if winners < 2:
        assert "not faster than the default schedule by more than 3% (timing noise): not applied" in str(
            built.records_note
        )

    # Pretend the default schedules were slow: now every record applies (all hashes match).
    forced = tmp_path / "forced"
    shutil.copytree(tmp_path / "mlp_bn", forced / "mlp_bn")
    _set_task_fields(forced / "mlp_bn" / res.record_dir.name, default_us=1e9)
    all_tuned = tvm_fusion.build(model, "llvm", name="mlp_bn", tuning_logs=forced)
    assert all_tuned.tuned_kernels == 2 and all_tuned.tuned_kernels >= 1
    out_plain = run_executable(untuned.executable, inputs)
    for b in (built, all_tuned):
        out = run_executable(b.executable, inputs)
        np.testing.assert_allclose(out, out_plain, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(out, reference, rtol=1e-4, atol=1e-4)

    # Same budget again: nothing is measured, nothing re-timed, the record files stay as they were.
    before = _files(res.record_dir)
    again = tuning.tune_model(
        imported, cpu, trials=4, log_root=tmp_path, options={"layout": True}, progress=False, in_model=False
    )
    assert again.new_trials == 0 and all(t.skipped for t in again.tasks)
    after = _files(res.record_dir)
    assert after[tuning.RECORD_FILE] == before[tuning.RECORD_FILE]
    assert after[tuning.WORKLOAD_FILE] == before[tuning.WORKLOAD_FILE]
    assert [t.default_us for t in again.tasks] == [t.default_us for t in res.tasks]


@pytest.mark.slow
def test_interrupted_tuning_resumes_without_redoing_trials(ms_ready, cpu, tmp_path):
    model = _tiny_model((16, 32, 16))
    imported, mod = _fused(model, cpu)
    kw = dict(
        model_name=imported.name,
        model_hash=imported.model_hash,
        log_root=tmp_path,
        progress=False,
        trials=8,
        num_trials_per_iter=2,
        population_size=32,
    )
    ntasks = len(tuning.extract_tasks(mod, cpu))
    assert ntasks >= 2

    def stop(_summary):
        raise KeyboardInterrupt

    # 1. Ctrl-C in the middle of the first task, right after its first batch is on disk.
    with pytest.raises(KeyboardInterrupt):
        tuning.tune(mod, cpu, on_batch=stop, **kw)
    path = tuning.record_dir(tmp_path, imported.name, cpu)
    assert len((path / tuning.RECORD_FILE).read_text().splitlines()) == 2
    db, report = tuning.load_records(tmp_path, imported.name, imported.model_hash, cpu)
    assert report.ok and report.num_records == 2  # what is on disk is a valid record set

    # 2. Resume; Ctrl-C after the first task completes.
    with pytest.raises(KeyboardInterrupt):
        tuning.tune(mod, cpu, on_task_done=stop, **kw)
    budgets = tuning.split_budget(8, ntasks, None)
    manifest = json.loads((path / tuning.MANIFEST_FILE).read_text())
    first = [t for t in manifest["tasks"].values() if t["trials"] > 0]
    assert len(first) == 1 and first[0]["trials"] == budgets[0] and first[0]["budget"] == budgets[0]

    # 3. Resume again: the first task is skipped, only the others measure.
    res = tuning.tune(mod, cpu, **kw)
    assert res.tasks[0].skipped and res.tasks[0].new_trials == 0
    assert [t.new_trials for t in res.tasks[1:]] == budgets[1:]
    assert res.total_trials == 8

    # 4. Once more: nothing to do.
    assert tuning.tune(mod, cpu, **kw).new_trials == 0
    db, report = tuning.load_records(tmp_path, imported.name, imported.model_hash, cpu, only_faster=False)
    assert report.num_records == 8
    inputs = models.random_inputs(model)
    tuned = tvm_fusion.build(model, cpu, database=db)
    plain = tvm_fusion.build(model, cpu, tuning_logs=None)
    assert tuned.tuned_kernels == ntasks
    np.testing.assert_allclose(
        run_executable(tuned.executable, inputs),
        run_executable(plain.executable, inputs),
        rtol=1e-5,
        atol=1e-5,
    )


def _tuned_with_made_up_in_model_times(model, cpu, name, tmp_path, monkeypatch, times, sweep):
    """``tune_model`` (8 trials, 2 tasks) with the in-model check, its kernel times made up so that
    its choice is known: ``times[task][build]`` in µs, the builds numbered in the order they are
    first timed (the default, the variants, then the winners' confirmation build); ``sweep`` is
    the check's grid. Returns the result and the builds in the order timed."""
    from tvm_fusion.tuning import in_model

    calls, builds = [], {}

    def made_up_times(vm, args, device, kernels):
        # each VM kept here, so that no later one reuses its id
        variant = builds.setdefault(id(vm), (len(builds), vm))[0] % len(times[0])
        calls.append(variant)
        keys = sorted(set(kernels.values()))
        return {keys[0]: times[0][variant], keys[1]: times[1][variant]}

    monkeypatch.setattr(in_model, "_workload_times", made_up_times)
    monkeypatch.setattr(in_model, "SWEEP_KNOBS", sweep)
    res = tuning.tune_model(
        model,
        cpu,
        name=name,
        trials=8,
        log_root=tmp_path,
        num_trials_per_iter=4,
        progress=False,
        in_model=True,
    )
    return res, calls


def test_in_model_check_applies_the_record_fastest_in_the_model(ms_ready, cpu, tmp_path, monkeypatch):
    """After the search, each task's best records are built into the model and timed there; the
    one fastest *in the model* is applied (not the fastest alone), only if it beats the default
    there, and only while the task has no newer trials. Times are made up here (the real ones
    come from the VM's instrumentation) so that the choice is known."""
    from tvm_fusion.tuning import in_model

    model = _tiny_model((16, 32, 16))
    # builds: default, records #1..#3 (the grid off: next test), then the winners together. First
    # task: record #2 wins in the model, and again in the winners' build; second task: record #2
    # wins too, but not when timed again (the fastest of four noisy times is biased low)
    times = [[100.0, 99.0, 80.0, 90.0, 80.0], [100.0, 99.0, 96.0, 120.0, 99.5]]
    res, calls = _tuned_with_made_up_in_model_times(model, cpu, "tiny2", tmp_path, monkeypatch, times, {})
    assert len(calls) == (4 + 2) * in_model.ROUNDS
    rset = tuning.read_record_set(res.record_dir)
    keys = sorted(t.workload_key for t in res.tasks)
    first, second = (next(t for t in res.tasks if t.workload_key == k) for k in keys)
    assert first.in_model["tuned_us"] == 80.0 and first.in_model["default_us"] == 100.0 and first.applied
    assert second.in_model["trace"] is None and second.in_model["tuned_us"] == 99.5 and not second.applied
    assert "in the model: tuned 80.00 us vs default 100.00 us -> tuned schedule used" in str(res)
    chosen = rset.best_records(keys[0], 3)[1]  # the second fastest alone
    applied = res.database.get_all_tuning_records()
    assert [tuning.trace_id(r) for r in applied] == [tuning.trace_id(chosen)]  # nothing of task 2
    built = tvm_fusion.build(model, cpu, name="tiny2", tuning_logs=tmp_path)
    assert built.tuned_kernels == 1
    feeds = models.random_inputs(model)
    np.testing.assert_allclose(
        run_executable(built.executable, feeds), ort_run(model, feeds), rtol=1e-4, atol=1e-4
    )
    # a build reads only what it can apply (each workload's fastest and the chosen record), and
    # counts the rest: the same trials, the same bests, the same record applied
    lean = tuning.read_record_set(res.record_dir, best_only=1)
    assert lean.trials_by_workload() == rset.trials_by_workload()
    assert lean.best_by_workload() == rset.best_by_workload()
    assert len(lean.records) <= 4 < len(rset.records)
    three = tuning.read_record_set(res.record_dir, best_only=3)  # what the in-model check reads
    for key in keys:
        assert [tuning.trace_id(r) for r in three.best_records(key, 3)] == [
            tuning.trace_id(r) for r in rset.best_records(key, 3)
        ]
    with pytest.raises(TuningRecordError, match="never saved"):
        lean.save()  # it would drop every record it did not read
    db, _ = tuning.load_records(tmp_path, "tiny2", frontend.as_imported(model).model_hash, cpu)
    assert [tuning.trace_id(r) for r in db.get_all_tuning_records()] == [tuning.trace_id(chosen)]
    # more trials later: a verdict no longer speaks for the records (back to the alone check)
    skipped, _ = tuning.slower_than_default(rset, cpu)
    assert "in the model" in skipped[keys[1]]
    manifest = json.loads((res.record_dir / tuning.MANIFEST_FILE).read_text())
    manifest["tasks"][keys[1]]["in_model"]["trials"] -= 1
    manifest["tasks"][keys[1]]["default_us"] = 1e9  # the alone check now lets its best record apply
    (res.record_dir / tuning.MANIFEST_FILE).write_text(json.dumps(manifest))
    skipped, _ = tuning.slower_than_default(tuning.read_record_set(res.record_dir), cpu)
    assert keys[1] not in skipped


def test_in_model_check_adds_the_grid_point_fastest_in_the_model(ms_ready, cpu, tmp_path, monkeypatch):
    """The in-model check also builds the model with each point of the decision grid forced on
    every kernel; a grid point that wins there for a task (and was never a record of it) is
    added to its records, timed as it ran in the model, and applied by later builds. Times are
    made up so that the choice is known; the grid is cut to one point (plan 5: the search's
    4 trials per task measure the points nearest the default)."""
    from tvm_fusion.tuning import in_model

    model = _tiny_model((16, 32, 16))
    # default, records #1..#3, the grid point, then the winners' build. First task: the grid point
    # wins in the model; second task: nothing beats the default
    times = [[100.0, 99.0, 98.0, 97.0, 70.0, 70.0], [100.0, 99.0, 98.0, 97.0, 99.5, 100.0]]
    res, calls = _tuned_with_made_up_in_model_times(
        model, cpu, "tiny3", tmp_path, monkeypatch, times, {"plan": [0, 5]}
    )
    assert len(calls) == (5 + 2) * in_model.ROUNDS  # then the default and the winners' build again
    keys = sorted(t.workload_key for t in res.tasks)
    first, second = (next(t for t in res.tasks if t.workload_key == k) for k in keys)
    assert first.in_model["tuned_us"] == 70.0 and first.applied and first.trials == 5
    assert second.in_model["trace"] is None and not second.applied and second.trials == 4
    rset = tuning.read_record_set(res.record_dir)
    assert rset.trials_by_workload() == {keys[0]: 5, keys[1]: 4}
    added = next(r for r in rset.records_of(keys[0]) if tuning.trace_id(r) == first.in_model["trace"])
    assert [float(s) for s in added.run_secs] == [pytest.approx(70e-6)]  # its time in the model
    decisions = [int(d) for inst, d in added.trace.decisions.items() if inst.kind.name == "SampleCategorical"]
    assert decisions[0] == 5  # the plan forced by the grid
    applied = res.database.get_all_tuning_records()
    assert [tuning.trace_id(r) for r in applied] == [first.in_model["trace"]]
    # the verdict still speaks for the records read lean (as a build reads them)
    lean = tuning.read_record_set(res.record_dir, best_only=1)
    assert lean.trials_by_workload() == rset.trials_by_workload()
    db, _ = tuning.load_records(tmp_path, "tiny3", frontend.as_imported(model).model_hash, cpu)
    assert [tuning.trace_id(r) for r in db.get_all_tuning_records()] == [first.in_model["trace"]]
    # checking again finds the same point already among the records: nothing is added twice
    in_model.check_in_model(frontend.as_imported(model, "tiny3"), cpu, res.record_dir)
    assert tuning.read_record_set(res.record_dir).trials_by_workload() == {keys[0]: 5, keys[1]: 4}
    built = tvm_fusion.build(model, cpu, name="tiny3", tuning_logs=tmp_path)
    assert built.tuned_kernels == 1
    feeds = models.random_inputs(model)
    np.testing.assert_allclose(
        run_executable(built.executable, feeds), ort_run(model, feeds), rtol=1e-4, atol=1e-4
    )


@pytest.mark.slow
def test_time_budget_ends_tasks_and_a_rerun_goes_on(ms_ready, cpu, tmp_path):
    """``time_budget_s`` (tvm-fusion tune --minutes) spreads a wall-time budget over the tasks; a
    task stopped by it is not marked at budget, so the next run continues it."""
    model = _tiny_model((64, 256, 64), batch=64)  # spaces of 176 and 88 points: time ends them
    imported, mod = _fused(model, cpu)
    kw = dict(
        model_name=imported.name,
        model_hash=imported.model_hash,
        log_root=tmp_path,
        progress=False,
        trials=10_000,
        num_trials_per_iter=2,
        check_default=False,
    )
    first = tuning.tune(mod, cpu, time_budget_s=20, **kw)
    assert first.elapsed_s < 20 + 120  # it stopped (a hang guard, not a speed check)
    assert all(t.trials >= 1 for t in first.tasks)  # every task got a share
    manifest = json.loads((first.record_dir / tuning.MANIFEST_FILE).read_text())
    assert all(e["budget"] < 10_000 for e in manifest["tasks"].values())  # none marked done
    assert "/" not in str(first).splitlines()[0].split("trials")[0]  # no "n/10000 trials" per task
    second = tuning.tune(mod, cpu, time_budget_s=15, **kw)
    assert second.new_trials > 0 and second.total_trials > first.total_trials
    with pytest.raises(TvmFusionError, match="time budget must be positive"):
        tuning.tune(mod, cpu, time_budget_s=0, **kw)


def test_a_failing_task_search_keeps_its_default_and_the_others_go_on(ms_ready, cpu, tmp_path, monkeypatch):
    """One task whose search raises (Meta-Schedule's own space failing on a kernel, say) must not
    end the run: it keeps its default schedule, says why, and the next task is searched."""
    from tvm_fusion.tuning import search

    model = _tiny_model((16, 32, 16))
    imported, mod = _fused(model, cpu)
    original = search.TaskSearch.run
    failed = []

    def run(self, task, summary, position, deadline=None):
        if not failed:
            failed.append(summary.name)
            raise RuntimeError("Index 6 out of bounds 6")
        return original(self, task, summary, position, deadline)

    monkeypatch.setattr(search.TaskSearch, "run", run)
    said = []
    res = _tune_quietly(imported, mod, cpu, tmp_path, trials=4, check_default=False, log=said.append)
    by_name = {t.name: t for t in res.tasks}
    assert by_name[failed[0]].search_error == "RuntimeError: Index 6 out of bounds 6"
    assert by_name[failed[0]].trials == 0
    assert all(t.trials > 0 for n, t in by_name.items() if n != failed[0])
    assert f"{failed[0]}: the search failed" in " ".join(said)
    assert "search failed: RuntimeError" in str(res)


def test_a_spent_time_budget_starts_no_more_tasks(ms_ready, cpu, tmp_path, monkeypatch):
    """Once the budget cannot pay for another task (its search and its check against the
    default), no task starts: a 1-minute budget on an H200 ran 2.5 minutes, one batch per task,
    before this. The tasks keep their defaults and the message says how to go on."""
    from tvm_fusion.tuning import driver

    monkeypatch.setattr(driver, "VERIFY_RESERVE_S", 1e6)
    model = _tiny_model((16, 32, 16))
    imported, mod = _fused(model, cpu)
    said = []
    # the check against the default (check_default) is what the budget cannot pay for
    res = _tune_quietly(imported, mod, cpu, tmp_path, trials=10_000, time_budget_s=30, log=said.append)
    assert res.new_trials == 0
    assert all(t.out_of_time for t in res.tasks)
    assert "the time budget ran out before 2 task(s) were searched" in " ".join(said)
    assert "not searched: the time budget ran out" in str(res)


def test_incompatible_records_are_moved_aside_when_tuning(fabricated, cpu, tmp_path):
    root, imported, path = _copy(fabricated, tmp_path)
    mod = fabricated[2]
    messages = []
    # trials=0: only the bookkeeping runs, so this needs no measuring
    res = tuning.tune(
        mod,
        cpu,
        model_name=imported.name,
        model_hash="feedfacefeedface",
        trials=0,
        log_root=root,
        progress=False,
        log=messages.append,
    )
    assert res.new_trials == 0
    assert any("made for model hash" in m and "moved to" in m for m in messages)
    aside = [p for p in path.parent.iterdir() if p.name.startswith(path.name + ".old-")]
    assert len(aside) == 1 and (aside[0] / tuning.RECORD_FILE).exists()
    assert json.loads((path / tuning.MANIFEST_FILE).read_text())["model_hash"] == "feedfacefeedface"


def test_rule_space_is_searched_and_its_records_replay(ms_ready, cpu, tmp_path):
    """A kernel our Contraction rule schedules is tuned over the rule's own decisions: the default
    point is measured first, each record's trace replays to exactly the schedule the rule makes
    for its point, and the build applies the records and matches ORT."""
    model = _tiny_model((64, 48), batch=16)
    imported, mod = _fused(model, cpu)
    (task,) = tuning.extract_tasks(mod, cpu)
    func = task.dispatched[0]["main"]
    space = tuning.rule_space(func, cpu)
    assert space is not None and space.names[0] == "plan" and space.size > 4
    res = tuning.tune(
        mod,
        cpu,
        model_name=imported.name,
        model_hash=imported.model_hash,
        trials=4,
        log_root=tmp_path,
        num_trials_per_iter=2,
        progress=False,
        check_default=False,
    )
    rset = tuning.read_record_set(res.record_dir)
    (entry,) = rset.manifest["tasks"].values()
    assert entry["space"] == dict(zip(space.names, space.counts))
    points = [tuple(p) for p in entry["space_measured"]]
    assert len(rset.records) == 4 and len(set(points)) == 4 and (0,) * len(space.names) in points
    replayed = [rec.as_measure_candidate().sch.mod for rec in rset.records]
    for point in points:  # every measured point is one of the records, instruction for instruction
        made = space.schedule(func, cpu, point)[0].mod
        assert any(tvm_ffi.structural_equal(made, r) for r in replayed)

    built = tvm_fusion.build(model, "llvm", database=rset.to_database())
    assert built.tuned_kernels == 1
    inputs = models.random_inputs(model)
    np.testing.assert_allclose(
        run_executable(built.executable, inputs), ort_run(model, inputs), rtol=1e-4, atol=1e-4
    )

    # resuming measures only new points
    more = tuning.tune(
        mod,
        cpu,
        model_name=imported.name,
        model_hash=imported.model_hash,
        trials=6,
        log_root=tmp_path,
        num_trials_per_iter=2,
        progress=False,
        check_default=False,
    )
    (entry,) = tuning.read_record_set(more.record_dir).manifest["tasks"].values()
    assert more.new_trials == 2 and len({tuple(p) for p in entry["space_measured"]}) == 6


def test_records_timed_against_an_older_default_are_retimed_before_use(fabricated, cpu, tmp_path):
    """A newer tvm_fusion may schedule a kernel differently by default (its GEMMs stopped being
    cache-blocked): the stored side-by-side verdict is then stale, so the build leaves the record
    out, and tuning again (no new trials) re-times it against the current default."""
    root, imported, path = _copy(fabricated, tmp_path)
    (workload,) = tuning.read_record_set(path).workloads
    current = default_fingerprint(workload.mod["main"], cpu)
    trials = len((path / tuning.RECORD_FILE).read_text().splitlines())
    verdict = dict(default_us=5e6, tuned_us=4e6, verified_trials=trials)  # the record won

    _set_task_fields(path, **verdict, default_hash=current)
    _, report = tuning.load_records(root, imported.name, imported.model_hash, cpu)
    assert report.num_applied == 1, str(report)

    _set_task_fields(path, **verdict, default_hash="0")  # timed against another default
    db, report = tuning.load_records(root, imported.name, imported.model_hash, cpu)
    assert db is None and report.num_applied == 0
    assert "timed against an older default schedule" in str(report), str(report)

    res = tuning.tune(
        fabricated[2],
        cpu,
        model_name=imported.name,
        model_hash=imported.model_hash,
        trials=0,
        log_root=root,
        progress=False,
    )
    (entry,) = json.loads((path / tuning.MANIFEST_FILE).read_text())["tasks"].values()
    assert res.new_trials == 0 and entry["default_hash"] == current
    assert 0 < entry["default_us"] < 1e4  # re-timed: a 8x32x32 GEMM takes microseconds


def test_verify_again_retimes_stored_verdicts(fabricated, cpu, tmp_path):
    """A verdict is stored once per trial count; ``verify_again`` re-times default vs best record
    (after a run on a busy machine) without measuring new trials."""
    root, imported, path = _copy(fabricated, tmp_path)
    mod = fabricated[2]
    trials = len((path / tuning.RECORD_FILE).read_text().splitlines())
    (workload,) = tuning.read_record_set(path).workloads
    current = default_fingerprint(workload.mod["main"], cpu)
    _set_task_fields(path, default_us=5e6, tuned_us=4e6, verified_trials=trials, default_hash=current)
    kw = dict(
        model_name=imported.name, model_hash=imported.model_hash, trials=0, log_root=root, progress=False
    )

    assert tuning.tune(mod, cpu, **kw).new_trials == 0
    (entry,) = json.loads((path / tuning.MANIFEST_FILE).read_text())["tasks"].values()
    assert (entry["default_us"], entry["tuned_us"]) == (5e6, 4e6)  # kept: checked for these trials

    res = tuning.tune(mod, cpu, verify_again=True, **kw)
    (entry,) = json.loads((path / tuning.MANIFEST_FILE).read_text())["tasks"].values()
    assert res.new_trials == 0 and len((path / tuning.RECORD_FILE).read_text().splitlines()) == trials
    assert 0 < entry["default_us"] < 1e4 and 0 < entry["tuned_us"] < 1e4  # a 8x32x32 GEMM: microseconds
    assert entry["verified_trials"] == trials

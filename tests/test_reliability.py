"""Issue 14: no crashes, and every bad input one ``error: ...`` line with exit status 2.

Crash cases run in a child process (a segfault or SIGBUS must not take pytest down); the thread
case runs for real, with eight threads hammering one loaded model.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import onnx
import pytest
from conftest import ort_run, run_outputs
from onnx import TensorProto, helper

from tvm_fusion import FusionPolicy, InputError, build, load, models
from tvm_fusion.cli import main
from tvm_fusion.errors import ExportError, ModuleError, PolicyError, TvmFusionError, last_line
from tvm_fusion.policy import POLICY_FIELDS, ROOFLINE_FIELDS

# -- shared artefacts (one build each per module) -------------------------------------------------


def _model(name, nodes, inputs, outputs, opset=17):
    graph = helper.make_graph(nodes, name, inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)] if opset else [])
    if not opset:
        del model.opset_import[:]
    model.ir_version = 8
    return model


def _tensor(name, shape, elem=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, elem, shape)


def _dyn_add():
    """Two inputs sharing the symbolic dim ``batch``."""
    return _model(
        "dyn_add",
        [helper.make_node("Add", ["a", "b"], ["y"])],
        [_tensor("a", ["batch", 4]), _tensor("b", ["batch", 4])],
        [_tensor("y", ["batch", 4])],
    )


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    """(onnx model, exported .so path, input array, reference output) for mlp_bn."""
    model = models.mlp_bn()
    path = build(model, "llvm", name="mlp_bn", tuning_logs=None).export(tmp_path_factory.mktemp("m") / "m.so")
    (x,) = models.random_inputs(model).values()
    return model, path, x, load(path)(x)


@pytest.fixture(scope="module")
def dyn(tmp_path_factory):
    """The dyn_add model exported with one shape bucket (batch=2)."""
    path = tmp_path_factory.mktemp("d") / "d.so"
    build(_dyn_add(), "llvm", name="dyn_add", tuning_logs=None, shape_buckets=[{"batch": 2}]).export(path)
    return path


def _copy(src, dst_dir, name="c.so", sidecar=True):
    dst = dst_dir / name
    shutil.copyfile(src, dst)
    if sidecar:
        shutil.copyfile(f"{src}.json", f"{dst}.json")
    return dst


def _cli(argv, capsys):
    """Exit status and stderr lines of the CLI run in-process (argparse errors exit via SystemExit)."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as stop:
        code = stop.code
    captured = capsys.readouterr()
    return code, captured.err.strip().splitlines()


def _assert_one_error(code, err, *needles):
    assert code == 2, err
    assert len(err) == 1 and err[0].startswith("error: "), err
    for needle in needles:
        assert str(needle) in err[0], (needle, err[0])


def _child(code: str, *args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
    )


# -- crash 3: one loaded model, many threads ------------------------------------------------------

THREADS_CHILD = """
    import sys, threading
    import numpy as np
    import tvm_fusion
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: races show at once
    model = tvm_fusion.load(sys.argv[1])
    x = np.load(sys.argv[2])
    ref = model(x)
    failures = []
    def work():
        for _ in range(1000):
            try:
                if not np.array_equal(model(x), ref):
                    failures.append("wrong result")
            except Exception as err:
                failures.append(repr(err)[:200])
    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print("failures", len(failures), failures[:3])
"""


def test_one_model_called_from_eight_threads(mlp, tmp_path):
    # without the lock this fails: segfault, double free or wrong-register errors (8 of 8 tries)
    _, path, x, _ = mlp
    np.save(tmp_path / "x.npy", x)
    proc = _child(THREADS_CHILD, path, tmp_path / "x.npy")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "failures 0 []"


# -- crash 5: truncated library -----------------------------------------------------------------


@pytest.mark.parametrize("sidecar", [True, False])
def test_truncated_library_is_an_error_not_sigbus(mlp, tmp_path, sidecar):
    _, path, _, _ = mlp
    cut = tmp_path / "t.so"
    cut.write_bytes(path.read_bytes()[:5000])
    if sidecar:
        shutil.copyfile(f"{path}.json", f"{cut}.json")
    proc = subprocess.run(
        [sys.executable, "-m", "tvm_fusion", "run", str(cut)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith(f"error: {cut}: ")
    assert ("recorded" if sidecar else "truncated") in lines[-1]


def test_sidecar_records_size_and_sha256(mlp):
    import hashlib

    _, path, _, _ = mlp
    library = json.loads(path.with_name(path.name + ".json").read_text())["library"]
    data = path.read_bytes()
    assert library == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def test_changed_library_same_size_is_refused(mlp, tmp_path):
    _, path, _, _ = mlp
    copy = _copy(path, tmp_path)
    data = bytearray(copy.read_bytes())
    data[-1] ^= 0xFF  # last byte: the ELF section table still fits, only the checksum can tell
    copy.write_bytes(bytes(data))
    with pytest.raises(ModuleError, match="sha256 differs"):
        load(copy)


# -- 6, 7, 8: scalars, file modes, a .so without its .so.json -------------------------------------


def test_scalar_input_runs(tmp_path):
    model = _model(
        "scale",
        [helper.make_node("Mul", ["a", "s"], ["y"])],
        [_tensor("a", [4]), _tensor("s", [])],
        [_tensor("y", [4])],
    )
    path = build(model, "llvm", tuning_logs=None).export(tmp_path / "s.so")
    loaded = load(path)
    a = np.arange(4, dtype=np.float32)
    np.testing.assert_array_equal(loaded(a, np.float32(3)), a * 3)
    np.testing.assert_array_equal(loaded(a=a, s=np.array(2, np.float32)), a * 2)


@pytest.mark.parametrize("umask,so_mode,json_mode", [(0o022, 0o755, 0o644), (0o077, 0o700, 0o600)])
def test_export_respects_the_umask(mlp, tmp_path, umask, so_mode, json_mode):
    model, _, _, _ = mlp
    result = build(model, "llvm", name="mlp_bn", tuning_logs=None)
    old = os.umask(umask)
    try:
        path = result.export(tmp_path / "a.so")
    finally:
        os.umask(old)
    assert os.stat(path).st_mode & 0o777 == so_mode
    assert os.stat(f"{path}.json").st_mode & 0o777 == json_mode


def test_library_without_sidecar_uses_the_module_signature(mlp, dyn, tmp_path, capsys):
    _, path, x, ref = mlp
    alone = _copy(path, tmp_path, sidecar=False)
    loaded = load(alone)
    assert not loaded.from_sidecar
    assert [(s.name, s.shape, s.dtype) for s in loaded.inputs] == [("input", (8, 32), "float32")]
    np.testing.assert_array_equal(loaded(x), ref)
    code = main(["run", str(alone)])
    assert code == 0 and "note: no " in capsys.readouterr().err
    dyn_alone = _copy(dyn, tmp_path, "d.so", sidecar=False)
    assert [s.shape for s in load(dyn_alone).inputs] == [("batch", 4), ("batch", 4)]


# -- traceback -> one error line: run ----------------------------------------------------------


def test_run_inputs_file_problems(mlp, tmp_path, capsys):
    _, path, x, _ = mlp
    (tmp_path / "text.npz").write_text("hello\n")
    np.savez(tmp_path / "obj.npz", input=np.array([{"a": 1}], dtype=object))
    np.savez(tmp_path / "names.npz", x=x)
    cases = {
        tmp_path / "missing.npz": "no such file",
        tmp_path / "text.npz": "not an .npz of numeric arrays",
        tmp_path / "obj.npz": "not an .npz of numeric arrays",
        tmp_path / "names.npz": "holds arrays ['x'], but the model's inputs are ['input']",
    }
    for inputs, needle in cases.items():
        _assert_one_error(*_cli(["run", path, "--inputs", inputs], capsys), inputs, needle)


@pytest.mark.parametrize("flag", ["--repeat", "--number"])
def test_run_counts_must_be_positive(mlp, capsys, flag):
    _, path, _, _ = mlp
    _assert_one_error(*_cli(["run", path, flag, "0"], capsys), flag, "must be an integer >= 1")
    with pytest.raises(InputError, match=flag.strip("-")):
        load(path).latency_ms(mlp[2], **{flag.strip("-"): 0})


def _sidecar_edits():
    def edit(fn):
        def apply(meta):
            fn(meta)
            return json.dumps(meta)

        return apply

    return {
        "empty": (lambda meta: "", "is empty"),
        "truncated": (lambda meta: json.dumps(meta)[:40], "not valid JSON"),
        "null": (lambda meta: "null", "must be a JSON object, got null"),
        "list": (lambda meta: "[1, 2]", "must be a JSON object, got list"),
        "duplicate key": (lambda meta: '{"inputs": [], "inputs": []}', "key 'inputs' twice"),
        "shape": (edit(lambda m: m["inputs"][0].update(shape=[8, 33])), "the module's main takes [8, 32]"),
        "dtype": (edit(lambda m: m["inputs"][0].update(dtype="float64")), "main takes float32"),
        "bad dtype": (edit(lambda m: m["inputs"][0].update(dtype="floaty")), "'inputs[0].dtype'"),
        "shape type": (edit(lambda m: m["inputs"][0].update(shape="8x32")), "'inputs[0].shape'"),
        "extra input": (edit(lambda m: m["inputs"].append(m["inputs"][0])), "main takes 1"),
        "no inputs": (edit(lambda m: m.pop("inputs")), "key 'inputs'"),
        "bucket": (edit(lambda m: m.update(buckets=[{"function": "main", "bindings": {}}])), "buckets[0]"),
        "target": (edit(lambda m: m.update(target={"kind": "tpu"})), "key 'target'"),
        "size": (edit(lambda m: m["library"].update(size=5)), "recorded 5 at export"),
        "library": (edit(lambda m: m.update(library="abc")), "key 'library'"),
    }


@pytest.mark.parametrize("case", list(_sidecar_edits()))
def test_bad_sidecar_is_one_error(mlp, tmp_path, capsys, case):
    _, path, _, _ = mlp
    copy = _copy(path, tmp_path)
    make, needle = _sidecar_edits()[case]
    meta = json.loads(path.with_name(path.name + ".json").read_text())
    copy.with_name(copy.name + ".json").write_text(make(meta))
    _assert_one_error(*_cli(["run", copy], capsys), needle)
    with pytest.raises(ModuleError):
        load(copy)


def test_bucket_entry_renamed_in_sidecar(dyn, tmp_path, capsys):
    copy = _copy(dyn, tmp_path, "d.so")
    meta_path = copy.with_name(copy.name + ".json")
    meta = json.loads(meta_path.read_text())
    meta["buckets"][0]["function"] = "main__batch7"
    meta_path.write_text(json.dumps(meta))
    _assert_one_error(*_cli(["run", copy], capsys), "'main__batch7' is not in the module")


def test_run_on_files_that_are_not_tvm_modules(mlp, tmp_path, capsys):
    from tvm.support import cc

    (tmp_path / "f.c").write_text("int answer(void) { return 42; }\n")
    cc.create_shared(str(tmp_path / "plain.so"), [str(tmp_path / "f.c")])
    _assert_one_error(*_cli(["run", tmp_path / "plain.so"], capsys), "not a TVM Relax VM module")
    shutil.copyfile(f"{mlp[1]}.json", tmp_path / "plain.so.json")  # another export's sidecar
    _assert_one_error(*_cli(["run", tmp_path / "plain.so"], capsys), "recorded")
    (tmp_path / "text.so").write_text("not a library\n")
    _assert_one_error(*_cli(["run", tmp_path / "text.so"], capsys), "no ELF header")
    _assert_one_error(*_cli(["run", tmp_path / "none.so"], capsys), "no such file")


def test_inputs_sharing_a_symbolic_dim_must_agree(dyn):
    loaded = load(dyn)
    a2, a3 = np.ones((2, 4), np.float32), np.ones((3, 4), np.float32)
    np.testing.assert_array_equal(loaded(a3, a3), a3 + a3)
    assert loaded.last_function == "main"
    np.testing.assert_array_equal(loaded(a2, a2), a2 + a2)
    assert loaded.last_function == "main__batch2"
    with pytest.raises(InputError, match="dimension 'batch' is 3, but input 'a' gave it 2"):
        loaded(a2, a3)


def test_run_on_a_model_too_large_for_memory(tmp_path, capsys):
    side = 2**20
    model = _model(
        "huge",
        [helper.make_node("Relu", ["a"], ["y"])],
        [_tensor("a", [side, side])],
        [_tensor("y", [side, side])],
    )
    path = build(model, "llvm", tuning_logs=None).export(tmp_path / "huge.so")
    _assert_one_error(*_cli(["run", path], capsys), "need 4.0 TiB", "of memory")


# -- traceback -> one error line: build, policy, target -------------------------------------------


def _write_policy(tmp_path, text):
    path = tmp_path / "policy.json"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "text,needle",
    [
        ('{"vertical": []}', "'vertical' must be an object"),
        ('{"roofline": {"bandwidth_gbps": 1, "foo": 2}}', "unknown key(s) ['foo']"),
        ("5", "must be a JSON object, got integer 5"),
        ("null", "must be a JSON object, got null"),
        ('{"max_fusion_depth": 2, "max_fusion_depth": 3}', "key 'max_fusion_depth' twice"),
        ('{"horizontal": "false"}', "'horizontal' must be true or false, got string \"false\""),
        ('{"use_cost_model": "no"}', "'use_cost_model' must be true or false"),
        ('{"max_fusion_depth": true}', "'max_fusion_depth' must be an integer >= 1, got true"),
        ('{"benefit_threshold_us": "abc"}', "'benefit_threshold_us' must be a number"),
        ('{"anchor_classes": "conv"}', "'anchor_classes' must be a list of op class names"),
        (
            '{"roofline": {"bandwidth_gbps": 0, "peak_gflops": 0, "launch_overhead_us": 0, "cache_bytes": 0}}',
            "'roofline.bandwidth_gbps' must be a number > 0",
        ),
        ("{", "not valid JSON"),
    ],
)
def test_bad_policy_file_is_one_error(tmp_path, capsys, text, needle):
    path = _write_policy(tmp_path, text)
    _assert_one_error(*_cli(["explain", "mlp_bn", "--policy", path], capsys), path, needle)


@pytest.mark.parametrize("field", sorted(POLICY_FIELDS))
def test_every_policy_field_is_type_checked(field):
    # a string is wrong for every field; JSON's true is wrong for every non-boolean one
    wrong = ["yes"] + ([] if isinstance(getattr(FusionPolicy(), field), bool) else [True])
    for value in wrong:
        with pytest.raises(PolicyError, match=f"'{field}' must be"):
            FusionPolicy.from_dict({field: value})


@pytest.mark.parametrize("field", sorted(ROOFLINE_FIELDS))
def test_every_roofline_field_is_type_checked(field):
    good = {"bandwidth_gbps": 10.0, "peak_gflops": 50.0, "launch_overhead_us": 1.0, "cache_bytes": 1 << 20}
    FusionPolicy.from_dict({"roofline": good})
    for value in ("1", True, -1):
        with pytest.raises(PolicyError, match=f"'roofline.{field}' must be"):
            FusionPolicy.from_dict({"roofline": {**good, field: value}})


def test_c_target_is_refused(tmp_path, capsys):
    code, err = _cli(["build", "mlp_bn", "--target", '{"kind": "c"}', "-o", tmp_path / "c.so"], capsys)
    _assert_one_error(code, err, "target kind 'c' is not supported")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "buckets,needle",
    [
        (["batch=99999999999999999999"], "must be an integer in 1..2147483647"),
        (["batch=2147483648"], "must be an integer in 1..2147483647"),
        (["batch=²"], "bad shape bucket 'batch=²'"),
        ([","], "bad shape bucket ','"),
        (["batch=1,batch=2"], "'batch' is given twice"),
        (["batch=1", "batch=1"], "shape bucket {'batch': 1} is given twice"),
        (["seq=4"], "names ['seq'], but the model's symbolic dims are ['batch']"),
    ],
)
def test_bad_shape_bucket_is_one_error(tmp_path, capsys, buckets, needle):
    onnx.save(_dyn_add(), tmp_path / "dyn.onnx")
    argv = ["build", tmp_path / "dyn.onnx", "--no-tuning-logs", "-o", tmp_path / "d.so"]
    for bucket in buckets:
        argv += ["--shape-bucket", bucket]
    _assert_one_error(*_cli(argv, capsys), needle)
    assert not (tmp_path / "d.so").exists()


def test_negative_dim_is_one_error(tmp_path, capsys):
    model = _model(
        "neg", [helper.make_node("Relu", ["a"], ["y"])], [_tensor("a", [-3, 4])], [_tensor("y", [-3, 4])]
    )
    onnx.save(model, tmp_path / "neg.onnx")
    _assert_one_error(*_cli(["build", tmp_path / "neg.onnx"], capsys), "input 'a' has size -3 on axis 0")


def test_model_without_opset_is_named_as_such(tmp_path, capsys):
    model = _model(
        "noop", [helper.make_node("Relu", ["a"], ["y"])], [_tensor("a", [2])], [_tensor("y", [2])], None
    )
    onnx.save(model, tmp_path / "noop.onnx")
    _assert_one_error(*_cli(["build", tmp_path / "noop.onnx"], capsys), "declares no ONNX opset")


# -- unclear or silent ----------------------------------------------------------------------------


def test_pass_through_model_builds_and_runs(tmp_path):
    model = _model("identity", [], [_tensor("a", [2, 3])], [_tensor("a", [2, 3])])
    path = build(model, "llvm", tuning_logs=None).export(tmp_path / "id.so")
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(load(path)(x), x)


def test_tvm_ir_dumps_are_cut_from_error_messages():
    # the shape of TVM's message for a shape bucket past int32 (was "(... 57 lines skipped ...)")
    text = (
        "Check failed: (small.has_value()) is false: Literal value 2147483648 exceeds range of int32\n"
        "Error in pass: ApplyDefaultSchedule\nLocation (TVMScript):\n    def f(): ...\n(... 57 lines skipped ...)\n"
    )
    assert last_line(ValueError(text)) == "Literal value 2147483648 exceeds range of int32"
    assert last_line(ValueError("backtrace\n  frame\nTarget kind 'foo' is not defined")) == (
        "Target kind 'foo' is not defined"
    )


def test_failed_export_leaves_no_files(mlp, tmp_path):
    model, _, _, _ = mlp
    result = build(model, "llvm", name="mlp_bn", tuning_logs=None)
    (tmp_path / "out.so").mkdir()
    with pytest.raises(ExportError, match="is a directory"):
        result.export(tmp_path / "out.so")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.so"]

    class FailingExecutable:
        def export_library(self, path):
            raise OSError(28, "No space left on device", path)

    result.executable = FailingExecutable()
    with pytest.raises(ExportError, match="No space left"):
        result.export(tmp_path / "x.so")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.so"]  # no x.so, no orphan x.so.json


def test_summary_with_buckets_counts_each_op_once():
    plain = build(_dyn_add(), "llvm", tuning_logs=None)
    bucketed = build(_dyn_add(), "llvm", tuning_logs=None, shape_buckets=[{"batch": 1}, {"batch": 8}])
    assert bucketed.summary.ops == plain.summary.ops == 1
    assert bucketed.summary.kernels == plain.summary.kernels
    assert bucketed.summary.entries == 3 and "2 shape-bucket entries" in bucketed.describe()


def _mean_gelu_model():
    """``ReduceMean -> Gelu`` written out with Erf, as exporters write it (FocalNet)."""
    nodes = [
        helper.make_node("ReduceMean", ["x"], ["m"], axes=[3], keepdims=1),
        helper.make_node("Div", ["m", "sqrt2"], ["d"]),
        helper.make_node("Erf", ["d"], ["e"]),
        helper.make_node("Add", ["e", "one"], ["a"]),
        helper.make_node("Mul", ["m", "a"], ["p"]),
        helper.make_node("Mul", ["p", "half"], ["y"]),
    ]
    model = _model("mean_gelu", nodes, [_tensor("x", [1, 96, 1, 56])], [_tensor("y", [1, 96, 1, 1])])
    for name, value in (("sqrt2", 2**0.5), ("one", 1.0), ("half", 0.5)):
        model.graph.initializer.append(helper.make_tensor(name, TensorProto.FLOAT, [], [value]))
    return model


def test_a_kernel_that_fails_to_compile_is_named(monkeypatch):
    """A schedule bug that reaches codegen (here the reduction rule's reverse-inlining before its
    sole-consumer check, with the ill-formed-schedule guard off) fails the build with the kernel's
    name, not only TVM's message about a buffer."""
    from tvm_fusion.schedules import _util, reduction

    monkeypatch.setattr(_util, "undefined_buffers", lambda func: set())
    monkeypatch.setattr(reduction, "_sole_consumer", lambda sch, block: True)
    with pytest.raises(
        TvmFusionError, match=r"T_divide.*\(kernel fused_mean\w* fails on its own: .*T_divide"
    ):
        build(_mean_gelu_model(), "llvm", tuning_logs=None)


def test_the_mean_gelu_pattern_builds_and_matches_onnxruntime():
    model = _mean_gelu_model()
    x = np.random.default_rng(0).standard_normal((1, 96, 1, 56)).astype("float32")
    (got,) = run_outputs(build(model, "llvm", tuning_logs=None).executable, [x])
    np.testing.assert_allclose(got, ort_run(model, {"x": x}), rtol=1e-5, atol=1e-6)

"""build / export / load, the CLI, and bad input: one clear error line, non-zero exit."""

import json
import subprocess
import sys

import numpy as np
import onnx
import pytest
import tvm
from conftest import max_abs_err, ort_run
from tvm import relax

from tvm_fusion import InputError, TargetError, build, load, models, parse_target
from tvm_fusion.cli import main
from tvm_fusion.errors import ModelLoadError, UnsupportedOpError
from tvm_fusion.frontend import import_onnx
from tvm_fusion.pipeline import describe, pipeline, pipeline_passes


@pytest.fixture(scope="module")
def mlp_so(tmp_path_factory):
    model = models.mlp_bn()
    path = tmp_path_factory.mktemp("so") / "mlp.so"
    result = build(model, "llvm", name="mlp_bn", tuning_logs=None)
    result.export(path)
    return model, path, result


def test_export_reloads_with_plain_tvm_and_matches_ort(mlp_so):
    model, path, _ = mlp_so
    feeds = models.random_inputs(model)
    vm = relax.VirtualMachine(tvm.runtime.load_module(str(path)), tvm.cpu())
    got = vm["main"](tvm.runtime.tensor(feeds["input"])).numpy()
    assert max_abs_err(got, ort_run(model, feeds)) < 1e-5


def test_metadata_sidecar_describes_the_module(mlp_so):
    _, path, result = mlp_so
    meta = json.loads(path.with_name(path.name + ".json").read_text())
    assert meta["inputs"] == [{"name": "input", "shape": [8, 32], "dtype": "float32"}]
    assert meta["target"]["kind"] == "llvm"
    assert meta["tvm_version"] == tvm.__version__
    assert meta["model_hash"] == result.model.model_hash
    assert meta["summary"]["kernels"] == result.summary.kernels


def test_loaded_model_checks_inputs(mlp_so):
    model, path, _ = mlp_so
    loaded = load(path)
    x = models.random_inputs(model)["input"]
    assert loaded(x).shape == (8, 10)
    with pytest.raises(InputError, match="shape \\[4, 32\\], the model expects \\[8, 32\\]"):
        loaded(x[:4])
    with pytest.raises(InputError, match="dtype float64"):
        loaded(x.astype(np.float64))
    with pytest.raises(InputError, match="missing \\['input'\\]"):
        loaded(wrong=x)


def test_export_is_atomic_and_leaves_no_temp_files(mlp_so, tmp_path):
    _, _, result = mlp_so
    result.export(tmp_path / "a.so")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.so", "a.so.json"]


def test_pipeline_is_a_printable_reorderable_sequential():
    passes = pipeline_passes("llvm")
    names = [p.info.name for p in passes]
    assert names[:5] == [
        "BindUnknownShapes",
        "RemoveInferenceDropout",
        "RemoveEmptyTensors",
        "FoldBatchNorm",
        "FoldConstant",
    ]
    assert names.index("ApplyFusionPolicy") < names.index("LegalizeOps") < names.index("FuseTIR")
    assert "ApplyFusionPolicy" in describe(passes)
    assert isinstance(pipeline("llvm"), tvm.transform.Sequential)
    assert "ApplyFusionPolicy" not in [p.info.name for p in pipeline_passes("llvm", fusion=False)]


def test_registered_pipeline_drives_tvm_compile():
    model = models.mlp_bn()
    feeds = models.random_inputs(model)
    mod = import_onnx(model).mod
    target = parse_target("llvm")
    ex = tvm.compile(mod, target=target, relax_pipeline=relax.get_pipeline("tvm_fusion", target=target))
    got = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(feeds["input"])).numpy()
    assert max_abs_err(got, ort_run(model, feeds)) < 1e-5


# -- CLI -------------------------------------------------------------------------------------
def test_cli_build_prints_summary(tmp_path, capsys):
    src = tmp_path / "net.onnx"
    onnx.save(models.resnet_block_net(), src)
    out = tmp_path / "net.so"
    assert main(["build", str(src), "--target", "llvm", "-o", str(out), "--no-tuning-logs"]) == 0
    text = capsys.readouterr().out
    assert (
        "ops " in text and "kernels" in text and "fused groups" in text and "layout transforms left" in text
    )
    assert out.exists() and (tmp_path / "net.so.json").exists()


def _record_cli_builds(monkeypatch) -> list:
    """The results of every ``build`` the CLI makes from now on, in order."""
    import tvm_fusion.cli as cli

    built = []
    monkeypatch.setattr(cli, "build", lambda *a, **k: built.append(build(*a, **k)) or built[-1])
    return built


def _kernels_mentioning(result, text: str) -> int:
    """How many of a build's PrimFuncs mention ``text`` in their script."""
    return sum(
        text in f.script() for _, f in result.lowered.functions_items() if isinstance(f, tvm.tirx.PrimFunc)
    )


def test_cli_build_conv_algorithm_direct_turns_winograd_off(tmp_path, monkeypatch):
    """resnet_block_net's 32->32 3x3 conv at 16x16 is a Winograd kernel by default."""
    src, built = tmp_path / "net.onnx", _record_cli_builds(monkeypatch)
    onnx.save(models.resnet_block_net(), src)
    for flag in ([], ["--conv-algorithm", "direct"]):
        out = tmp_path / f"net{len(built)}.so"
        assert main(["build", str(src), "-o", str(out), "--no-tuning-logs", *flag]) == 0
    winograd = [_kernels_mentioning(r, "winograd") for r in built]
    assert winograd[0] > 0 and winograd[1] == 0


def test_cli_build_strassen_switch(tmp_path, monkeypatch):
    """Strassen is opt-in: a 64 x 512 -> 512 linear (within its size rule) is plain by default and
    with --strassen off, Strassen with on; a 64 x 96 -> 128 one (below the rule) only with always."""
    built = _record_cli_builds(monkeypatch)
    for din, dout in ((512, 512), (96, 128)):
        g = models.GraphBuilder("lin", 0)
        src = tmp_path / f"lin{din}.onnx"
        onnx.save(g.finish([g.linear(g.input("x", (1, 64, din)), din, dout)]), src)
        for flag in ([], ["--strassen", "off"], ["--strassen", "on"], ["--strassen", "always"]):
            out = tmp_path / f"lin{len(built)}.so"
            assert main(["build", str(src), "-o", str(out), "--no-tuning-logs", *flag]) == 0
    strassen = [_kernels_mentioning(r, "tvm_fusion.strassen") for r in built]
    assert strassen == [0, 0, 1, 1, 0, 0, 0, 1]


def test_cli_explain_names_groups(capsys):
    assert main(["explain", "transformer_block"]) == 0
    text = capsys.readouterr().out
    assert "group fused_" in text and "rejected candidates" in text


def _cli_error(argv, capsys):
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    return code, err


def test_cli_missing_file(tmp_path, capsys):
    code, err = _cli_error(["build", str(tmp_path / "nope.onnx")], capsys)
    assert code == 2 and err == [f"error: {tmp_path / 'nope.onnx'}: no such file"]


def test_cli_corrupt_file(tmp_path, capsys):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x08\x07garbage that is not protobuf\xff\xff")
    code, err = _cli_error(["build", str(bad)], capsys)
    assert code == 2 and len(err) == 1 and str(bad) in err[0]


def test_cli_truncated_file(tmp_path, capsys):
    data = models.mlp_bn().SerializeToString()
    cut = tmp_path / "cut.onnx"
    cut.write_bytes(data[: len(data) // 3])
    code, err = _cli_error(["build", str(cut)], capsys)
    assert code == 2 and len(err) == 1 and str(cut) in err[0]


def _celu_model():
    g = models.GraphBuilder("celu")
    x = g.input("input", (1, 4))
    y = g.op("Celu", [g.relu(x)])
    return g.finish([y])


def test_unsupported_op_names_op_and_node(tmp_path, capsys):
    path = tmp_path / "celu.onnx"
    onnx.save(_celu_model(), path)
    code, err = _cli_error(["build", str(path)], capsys)
    assert code == 2 and len(err) == 1
    assert "operator Celu" in err[0] and "node 'celu_" in err[0]
    with pytest.raises(UnsupportedOpError):
        import_onnx(path)


def test_bad_target(capsys):
    code, err = _cli_error(["build", "mlp_bn", "--target", "tpu"], capsys)
    assert code == 2 and err[0].startswith("error: unknown target 'tpu'")
    with pytest.raises(TargetError, match="not valid JSON"):
        parse_target("{kind: cuda")
    with pytest.raises(TargetError, match='Target kind "foo" is not defined'):
        parse_target({"kind": "foo"})
    with pytest.raises(TargetError, match="bad CUDA arch"):
        parse_target("cuda", cuda_arch="80")


def test_old_opset_is_rejected(tmp_path):
    model = models.mlp_bn()
    model.opset_import[0].version = 5
    with pytest.raises(ModelLoadError, match="opset 5 is outside the supported range"):
        import_onnx(model)


def test_module_entry_point_exit_code(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "tvm_fusion", "build", str(tmp_path / "x.onnx")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: {tmp_path / 'x.onnx'}: no such file"
    assert "Traceback" not in proc.stderr


def test_cuda_without_nvcc_is_a_clear_error(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvcc anywhere on PATH
    monkeypatch.delenv("CUDA_HOME", raising=False)
    code, err = _cli_error(["build", "mlp_bn", "--target", "cuda", "-o", str(tmp_path / "x.so")], capsys)
    assert code == 2 and "nvcc is not on PATH" in err[0]
    assert list(tmp_path.iterdir()) == []  # nothing written half-way


def test_cli_tune_then_build_uses_records(tmp_path, capsys):
    logs = str(tmp_path / "logs")
    assert main(["tune", "mlp_bn", "--trials", "4", "--tuning-logs", logs]) == 0
    tuned = capsys.readouterr().out
    assert "new trials" in tuned and "mlp_bn" in tuned
    assert main(["build", "mlp_bn", "--tuning-logs", logs, "-o", str(tmp_path / "m.so")]) == 0
    built = capsys.readouterr().out
    assert "tuning records: " in built and "tuning records for" in built


def test_cli_tune_cuda_without_gpu_fails_fast(tmp_path, capsys):
    code, err = _cli_error(
        ["tune", "mlp_bn", "--target", "cuda", "--trials", "4", "--tuning-logs", str(tmp_path)], capsys
    )
    assert code == 2 and len(err) == 1 and "GPU" in err[0]
    assert list(tmp_path.iterdir()) == []

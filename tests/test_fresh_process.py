"""An exported .so + .so.json runs in a fresh Python process that never imports tvm_fusion.

Deployment needs only tvm's runtime: the child process below blocks ``import tvm_fusion``
outright (a meta-path hook), reads input names/shapes/dtypes from the metadata JSON, runs the
entry function with tvm + numpy, and the parent compares against onnxruntime.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import ort_outputs

import tvm_fusion
from tvm_fusion import models

CHILD = textwrap.dedent(
    r'''
    import importlib.abc, json, sys

    class _Block(importlib.abc.MetaPathFinder):
        """Make any import of tvm_fusion fail loudly, so the run cannot depend on it."""
        def find_spec(self, name, path=None, target=None):
            if name == "tvm_fusion" or name.startswith("tvm_fusion."):
                raise ImportError("tvm_fusion must not be imported by a deployed model")
            return None

    sys.meta_path.insert(0, _Block())
    import numpy as np
    import tvm
    from tvm import relax

    so_path, feeds_path, out_path = sys.argv[1:4]
    meta = json.load(open(so_path + ".json"))
    feeds = np.load(feeds_path)
    args = []
    for spec in meta["inputs"]:  # order, shapes and dtypes come from the metadata alone
        value = feeds[spec["name"]]
        assert list(value.shape) == list(spec["shape"]), (spec, value.shape)
        assert str(value.dtype) == spec["dtype"], (spec, value.dtype)
        args.append(tvm.runtime.tensor(value))
    assert meta["target"]["kind"] == "llvm", meta["target"]
    vm = relax.VirtualMachine(tvm.runtime.load_module(so_path), tvm.cpu())
    out = vm[meta.get("entry", "main")](*args)
    outs = [out] if isinstance(out, tvm.runtime.Tensor) else list(out)
    assert len(outs) == len(meta["outputs"]), (len(outs), meta["outputs"])
    np.savez(out_path, *[o.numpy() for o in outs])
    assert "tvm_fusion" not in sys.modules, "tvm_fusion was imported"
    assert not any(m.startswith("tvm_fusion.") for m in sys.modules), "a tvm_fusion submodule was imported"
    print("CHILD_OK")
    '''
)


def two_in_two_out():
    """Conv/BN/relu6 (the NCHW8c layout path) + second-input residual; pooled Gemm head."""
    g = models.GraphBuilder("two_in_two_out", seed=5)
    a = g.input("image", (1, 8, 8, 8))
    b = g.input("skip", (1, 8, 8, 8))
    h = g.conv_bn(a, 8, 8, k=3, act="relu6")
    h = g.relu(g.add(h, b))
    pooled = g.op("Flatten", [g.op("GlobalAveragePool", [h])], axis=1)
    logits = g.op(
        "Gemm", [pooled, g.weight("fc_w", (4, 8)), g.const("fc_b", np.zeros(4, np.float32))], transB=1
    )
    return g.finish([h, logits])


CASES = {
    "two_in_two_out": two_in_two_out,
    "transformer_block": lambda: models.transformer_block(seq=4, hidden=16, heads=2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_exported_library_runs_without_tvm_fusion(case, tmp_path):
    model = CASES[case]()
    feeds = models.random_inputs(model, seed=1)
    reference = ort_outputs(model, feeds)

    so_path = tvm_fusion.build(model, "llvm", tuning_logs=None).export(tmp_path / f"{case}.so")
    meta = json.loads((tmp_path / f"{case}.so.json").read_text())
    assert [i["name"] for i in meta["inputs"]] == list(feeds)
    assert len(meta["outputs"]) == len(reference)

    # Feeds stored by name, in reverse order: the child must order them from the metadata.
    np.savez(tmp_path / "feeds.npz", **dict(reversed(list(feeds.items()))))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP")}
    proc = subprocess.run(
        [
            sys.executable,
            "-I",
            "-c",
            CHILD,
            str(so_path),
            str(tmp_path / "feeds.npz"),
            str(tmp_path / "out.npz"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and "CHILD_OK" in proc.stdout, f"child failed:\n{proc.stdout}\n{proc.stderr}"
    with np.load(tmp_path / "out.npz") as data:
        outs = [data[f"arr_{i}"] for i in range(len(data.files))]
    assert len(outs) == len(reference)
    for got, want in zip(outs, reference):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * max(1.0, float(np.max(np.abs(want)))))


def test_child_really_blocks_tvm_fusion(tmp_path):
    """The guard itself must bite: an import of tvm_fusion in the child fails."""
    script = CHILD.split("import numpy as np")[0] + "import tvm_fusion\n"
    proc = subprocess.run(
        [sys.executable, "-I", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode != 0 and "must not be imported" in proc.stderr

"""The main job on the bundled examples: import -> pipeline -> build -> export -> reload -> check.

The reload uses plain TVM only (``tvm.runtime.load_module`` + ``relax.VirtualMachine``), the way a
deployment that does not install tvm_fusion would load the ``.so``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import tvm
from tvm import relax

from . import models
from .api import build
from .frontend import import_onnx
from .targets import parse_target

DEMO_MODELS = ("resnet_block_net", "transformer_block")


def reference_outputs(model, feeds) -> tuple[np.ndarray, str]:
    """ONNX Runtime's answer when it is installed, else stock TVM's (unoptimised) build."""
    try:
        import onnxruntime as ort

        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        return session.run(None, feeds)[0], "onnxruntime"
    except ImportError:
        mod = import_onnx(model).mod
        vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
        return vm["main"](*[tvm.runtime.tensor(v) for v in feeds.values()]).numpy(), "stock TVM"


def stock_latency_ms(model, feeds, target) -> float:
    """Stock TVM: relax.get_pipeline("zero") (FuseOps/FuseTIR, no schedules) then tvm.compile."""
    mod = import_onnx(model).mod
    with target:
        mod = relax.get_pipeline("zero")(mod)
    vm = relax.VirtualMachine(tvm.compile(mod, target=target), tvm.cpu())
    return _median_ms(vm, feeds)


def _median_ms(vm, feeds, number=5, repeat=5) -> float:
    args = [tvm.runtime.tensor(v) for v in feeds.values()]
    return float(
        np.median(vm.time_evaluator("main", tvm.cpu(), number=number, repeat=repeat)(*args).results) * 1e3
    )


def run_demo(out_dir: str = "out", target="llvm", names=DEMO_MODELS) -> int:
    target = parse_target(target)
    out = Path(out_dir)
    worst = 0.0
    for name in names:
        model = models.example(name)
        feeds = models.random_inputs(model)
        print(f"== {name}")
        result = build(model, target, name=name)
        print(result.describe())
        so_path = result.export(out / f"{name}.{target.kind.name}.so")
        print(f"  exported {so_path} (+ .json metadata)")
        if target.kind.name != "llvm":
            if not tvm.device(target.kind.name, 0).exist:
                print(f"  no {target.kind.name} device here: built and exported only, not run")
                continue
        # Reload with plain TVM, as a deployment would.
        lib = tvm.runtime.load_module(str(so_path))
        dev = tvm.cpu() if target.kind.name == "llvm" else tvm.device(target.kind.name, 0)
        vm = relax.VirtualMachine(lib, dev)
        got = vm["main"](*[tvm.runtime.tensor(v, dev) for v in feeds.values()]).numpy()
        ref, ref_name = reference_outputs(model, feeds)
        err = float(np.max(np.abs(got - ref)))
        worst = max(worst, err)
        ours = _median_ms(vm, feeds)
        stock = stock_latency_ms(model, feeds, target)
        print(f"  max abs error vs {ref_name}: {err:.3g}")
        print(
            f"  latency: tvm_fusion {ours:.3f} ms, stock TVM (zero pipeline) {stock:.3f} ms, speedup {stock / ours:.2f}x"
        )
    ok = worst <= 1e-4
    print(f"demo {'passed' if ok else 'FAILED'}: worst max abs error {worst:.3g} (tolerance 1e-4)")
    return 0 if ok else 1

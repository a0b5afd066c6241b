"""CanonicalizeActivations: exporter-spelled GELU / SiLU become one op, numerics unchanged."""

import math

import numpy as np
import pytest
import tvm
from conftest import max_abs_err, ort_run, run_executable, run_relax
from tvm import relax

from tvm_fusion import models
from tvm_fusion.frontend import import_onnx
from tvm_fusion.passes import CanonicalizeActivations
from tvm_fusion.report import op_counts


def gelu_model(variant):
    g = models.GraphBuilder(f"gelu_{variant}")
    x = g.input("input", (2, 32))
    c = lambda v: g.const("c", np.array(v, np.float32))  # noqa: E731
    if variant == "mul_half_first":  # x * 0.5 * (1 + erf(x * 1/sqrt2))
        erf = g.op("Erf", [g.op("Mul", [x, c(1 / math.sqrt(2))])])
        y = g.op("Mul", [g.op("Mul", [x, c(0.5)]), g.op("Add", [erf, c(1.0)])])
    elif variant == "torch_div":  # (x * (1 + erf(x / sqrt2))) * 0.5, as torch.onnx emits
        erf = g.op("Erf", [g.op("Div", [x, c(math.sqrt(2))])])
        y = g.op("Mul", [g.op("Mul", [x, g.op("Add", [c(1.0), erf])]), c(0.5)])
    else:  # silu
        y = g.op("Mul", [x, g.op("Sigmoid", [x])])
    return g.finish([g.relu(y)])


@pytest.mark.parametrize(
    "variant,op", [("mul_half_first", "nn.gelu"), ("torch_div", "nn.gelu"), ("silu", "nn.silu")]
)
def test_rewrites_to_single_op(variant, op):
    model = gelu_model(variant)
    mod = relax.transform.FoldConstant()(import_onnx(model).mod)
    out = CanonicalizeActivations()(mod)
    relax.analysis.well_formed(out)
    counts = op_counts(out)
    assert counts[op] == 1
    assert counts.get("erf", 0) == 0 and counts.get("sigmoid", 0) == 0 and counts.get("multiply", 0) == 0
    feeds = models.random_inputs(model)
    assert max_abs_err(run_relax(out, feeds), ort_run(model, feeds)) < 1e-5


def test_wrong_constant_is_not_gelu():
    g = models.GraphBuilder("not_gelu")
    x = g.input("input", (2, 8))
    erf = g.op("Erf", [g.op("Mul", [x, g.const("c", np.array(0.5, np.float32))])])  # 0.5, not 1/sqrt2
    y = g.op(
        "Mul",
        [
            g.op("Mul", [x, g.const("h", np.array(0.5, np.float32))]),
            g.op("Add", [erf, g.const("o", np.array(1.0, np.float32))]),
        ],
    )
    mod = relax.transform.FoldConstant()(import_onnx(g.finish([y])).mod)
    assert op_counts(CanonicalizeActivations()(mod)).get("nn.gelu", 0) == 0


def test_transformer_block_gelu_becomes_matmul_epilogue(example):
    from tvm_fusion.passes import ApplyFusionPolicy

    model, feeds = example("transformer_block")
    mod = CanonicalizeActivations()(relax.transform.FoldConstant()(import_onnx(model).mod))
    fused = ApplyFusionPolicy()(mod)
    names = [gv.name_hint for gv in fused.functions]
    assert any(n.endswith("matmul_add_gelu") for n in names), names


def test_frontend_clip_kernels_become_named_clip(example):
    """The ONNX frontend emits Clip as opaque call_tir(maximum/minimum); they become R.clip."""
    from tvm_fusion.passes import FoldBatchNorm

    model, feeds = example("mobilenet_block", size=8)
    mod = relax.transform.FoldConstant()(FoldBatchNorm()(import_onnx(model).mod))
    assert {gv.name_hint for gv in mod.functions} == {"main", "maximum", "minimum"}
    out = CanonicalizeActivations()(mod)
    assert op_counts(out)["clip"] == 2
    assert [gv.name_hint for gv in out.functions] == ["main"]
    assert max_abs_err(run_relax(out, feeds), ort_run(model, feeds)) < 1e-4


def _tanh_gelu_model(cube_exponent=3.0):
    """GPT-2's "new GELU" as the dynamo exporter writes it (Pow(x, 3), tanh)."""
    g = models.GraphBuilder("tanh_gelu")
    x = g.input("input", (2, 16))

    def c(v):
        return g.const("c", np.array(v, np.float32))

    cube = g.op("Pow", [x, c(cube_exponent)])
    inner = g.op("Mul", [g.op("Add", [x, g.op("Mul", [cube, c(0.044715)])]), c(math.sqrt(2 / math.pi))])
    y = g.op("Mul", [g.op("Mul", [x, c(0.5)]), g.op("Add", [g.op("Tanh", [inner]), c(1.0)])])
    return g.finish([y])


def test_tanh_gelu_becomes_one_op_and_powers_become_products():
    model = _tanh_gelu_model()
    mod = relax.transform.FoldConstant()(import_onnx(model).mod)
    out = CanonicalizeActivations()(mod)
    counts = op_counts(out)
    assert counts.get("nn.gelu_tanh") == 1 and counts.get("power", 0) == 0 and counts.get("tanh", 0) == 0
    feeds = models.random_inputs(model)
    assert max_abs_err(run_relax(out, feeds), ort_run(model, feeds)) < 1e-5
    # x ** 2.5 is neither: it stays a power; x ** 3 elsewhere becomes products
    other = CanonicalizeActivations()(relax.transform.FoldConstant()(import_onnx(_tanh_gelu_model(2.5)).mod))
    assert op_counts(other).get("nn.gelu_tanh", 0) == 0 and op_counts(other).get("power") == 1


def hardswish_model():
    """conv -> HardSwish -> depthwise conv -> HardSwish, as MobileNetV3 exports."""
    g = models.GraphBuilder("hardswish")
    x = g.input("input", (1, 8, 12, 12))
    y = g.op("HardSwish", [g.conv(x, 8, 16, k=1)])
    y = g.op("HardSwish", [g.conv(y, 16, 16, k=3, groups=16)])
    return g.finish([y])


def test_hardswish_needs_a_float_tensor():
    x = relax.Var("x", relax.TensorType((2, 3), "int32"))
    with pytest.raises(Exception, match="floating-point"):
        relax.BlockBuilder().normalize(relax.op.nn.hardswish(x))


def test_hardswish_becomes_one_op_and_a_conv_epilogue(cpu_target):
    from tvm_fusion import build

    model = hardswish_model()
    mod = CanonicalizeActivations()(import_onnx(model).mod)
    counts = op_counts(mod)
    assert counts["nn.hardswish"] == 2
    assert counts.get("clip", 0) == 0 and counts.get("multiply", 0) == 0 and counts.get("divide", 0) == 0
    feeds = models.random_inputs(model)
    feeds["input"] *= 4  # reach both of the clip's bounds
    expected = ort_run(model, feeds)
    assert max_abs_err(run_relax(mod, feeds), expected) < 1e-5  # plain tvm.compile lowers the op too
    result = build(model, cpu_target, name="hardswish", tuning_logs=None)
    kernels = [gv.name_hint for gv, f in result.lowered.functions.items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert len(kernels) == 2 and all("conv2d" in k and "hardswish" in k for k in kernels), kernels
    assert max_abs_err(run_executable(result.executable, feeds), expected) < 1e-5


@pytest.mark.parametrize("shift, found", [(3.0, 1), (2.0, 0)], ids=["hardswish", "x+2-is-not"])
def test_hardswish_spelled_with_onnx_ops(shift, found):
    """Mul(x, Div(Clip(Add(x, shift), 0, 6), 6)): the frontend's Clip kernels become R.clip first,
    and the HardSwish is found only when the shift is 3."""
    g = models.GraphBuilder("spelled_hardswish")
    x = g.input("input", (2, 8))
    c = lambda v: g.const("c", np.array(v, np.float32))  # noqa: E731
    gate = g.op("Div", [g.op("Clip", [g.op("Add", [x, c(shift)]), c(0.0), c(6.0)]), c(6.0)])
    model = g.finish([g.op("Mul", [x, gate])])
    before = relax.transform.FoldConstant()(import_onnx(model).mod)
    out = CanonicalizeActivations()(before)
    assert op_counts(out).get("nn.hardswish", 0) == found
    if found:  # our op prints and parses back like TVM's own
        tvm.ir.assert_structural_equal(tvm.script.from_source(out.script()), out)
    feeds = models.random_inputs(model)
    feeds["input"] *= 4
    assert max_abs_err(run_relax(out, feeds), ort_run(model, feeds)) < 1e-5
    np.testing.assert_array_equal(run_relax(out, feeds), run_relax(before, feeds))  # bit-identical

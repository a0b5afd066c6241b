"""RecognizeRMSNorm: T5's and the Llama family's exported RMSNorm becomes one ``rms_norm``, which
fuses in front of the projection that reads it."""

import numpy as np
import pytest
import tvm
from conftest import ort_outputs, ort_run, rel_err, run_outputs
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

import tvm_fusion
from tvm_fusion.frontend import import_onnx
from tvm_fusion.ir import op_calls
from tvm_fusion.passes import CanonicalizeActivations, RecognizeRMSNorm
from tvm_fusion.passes.widen_long_reductions import MIN_ELEMENTS
from tvm_fusion.pipeline import pipeline_stages
from tvm_fusion.targets import parse_target

ROWS, HIDDEN, OUT = 6, 32, 16
CUDA = {"kind": "cuda", "arch": "sm_80"}


def _model(spelling: str, extra_output: bool = False, hidden: int = HIDDEN):
    """x -> RMSNorm -> MatMul -> y, the norm spelled as torch.onnx writes it: ``reciprocal``
    (T5, both exporters: ``x * (1 / sqrt(mean(x^2) + eps)) * weight``), ``divide``
    (``x / sqrt(..)``), ``cast`` (Llama: a Cast back to float32 before the weight), ``no_weight``
    (the scaling alone), and what is not an RMSNorm: ``axis0`` (a mean over the first axis),
    ``numerator_two`` (``2 / sqrt(..)``), ``other_operand`` (the inverse scales the weight, not
    x), ``eps_vector`` (one epsilon per feature)."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(np.array(2.0, np.float32), "two"),
        numpy_helper.from_array(
            np.full(hidden, 1e-6, np.float32) if spelling == "eps_vector" else np.array(1e-6, np.float32),
            "eps",
        ),
        numpy_helper.from_array(np.array(1.0, np.float32), "one"),
        numpy_helper.from_array(rng.uniform(0.5, 1.5, hidden).astype(np.float32), "weight"),
        numpy_helper.from_array(rng.standard_normal((hidden, OUT)).astype(np.float32), "w"),
    ]
    axis = 0 if spelling == "axis0" else -1
    nodes = [
        helper.make_node("Pow", ["x", "two"], ["sq"]),
        helper.make_node("ReduceMean", ["sq"], ["mean"], axes=[axis], keepdims=1),
        helper.make_node("Add", ["mean", "eps"], ["var"]),
        helper.make_node("Sqrt", ["var"], ["root"]),
    ]
    if spelling == "divide":
        nodes.append(helper.make_node("Div", ["x", "root"], ["n"]))
    else:
        nodes += [
            helper.make_node("Div", ["two" if spelling == "numerator_two" else "one", "root"], ["inv"]),
            helper.make_node("Mul", ["weight" if spelling == "other_operand" else "x", "inv"], ["n"]),
        ]
    scaled = "n"
    if spelling == "cast":
        nodes.append(helper.make_node("Cast", ["n"], ["n32"], to=TensorProto.FLOAT))
        scaled = "n32"
    if spelling != "no_weight":
        nodes.append(helper.make_node("Mul", ["weight", scaled], ["normed"]))
        scaled = "normed"
    nodes.append(helper.make_node("MatMul", [scaled, "w"], ["y"]))
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, ROWS, OUT])]
    if extra_output:  # the root mean square is read outside the pattern too
        outputs.append(helper.make_tensor_value_info("root", TensorProto.FLOAT, [1, ROWS, 1]))
    graph = helper.make_graph(
        nodes,
        "rms",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, ROWS, hidden])],
        outputs,
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _feeds(hidden: int = HIDDEN):
    return {"x": (np.random.default_rng(1).standard_normal((1, ROWS, hidden)) * 3 + 1).astype(np.float32)}


def _recognized(model):
    mod = relax.transform.FoldConstant()(import_onnx(model).mod)
    return RecognizeRMSNorm()(CanonicalizeActivations()(mod))["main"]


@pytest.mark.parametrize("spelling", ["reciprocal", "divide", "cast", "no_weight"])
def test_rms_norm_spellings_become_one_op_that_fuses_into_the_projection(spelling):
    model = _model(spelling)
    main = _recognized(model)
    norms = op_calls(main, ("relax.nn.rms_norm",))
    assert len(norms) == 1
    assert not op_calls(main, ("relax.mean", "relax.sqrt", "relax.divide", "relax.multiply", "relax.astype"))
    weight = norms[0].args[1].value.numpy()
    if spelling == "no_weight":
        assert (weight == 1).all()
    else:
        np.testing.assert_array_equal(weight, numpy_helper.to_array(model.graph.initializer[3]))
    result = tvm_fusion.build(model, "llvm", tuning_logs=None)
    assert result.summary.kernels == 1  # the norm is the GEMM's row prologue
    assert rel_err(run_outputs(result.executable, _feeds())[0], ort_run(model, _feeds())) < 1e-5


@pytest.mark.parametrize(
    "spelling, extra_output",
    [
        ("axis0", False),
        ("numerator_two", False),
        ("other_operand", False),
        ("eps_vector", False),
        ("reciprocal", True),
    ],
)
def test_other_reductions_and_shared_intermediates_are_left_alone(spelling, extra_output):
    """Spellings that are not an RMSNorm stay as they are (the spellings above are the controls),
    and so does a norm whose intermediate is read elsewhere (here the root mean square, a second
    output): one op could not give it."""
    model = _model(spelling, extra_output)
    assert not op_calls(_recognized(model), ("relax.nn.rms_norm",))
    feeds = _feeds()
    got = run_outputs(tvm_fusion.build(model, "llvm", tuning_logs=None).executable, feeds)
    refs = ort_outputs(model, feeds)
    assert len(got) == len(refs) and all(rel_err(g, ref) < 1e-5 for g, ref in zip(got, refs))


def test_rsqrt_spelling_becomes_one_op():
    """``x * rsqrt(mean(x * x) + eps)``: how a Relax user (not the ONNX frontend) writes it."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((ROWS, HIDDEN), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            mean = bb.emit(relax.op.mean(relax.op.multiply(x, x), axis=[-1], keepdims=True))
            inverse = bb.emit(relax.op.rsqrt(relax.op.add(mean, relax.const(1e-6, "float32"))))
            out = bb.emit_output(relax.op.multiply(x, inverse))
        bb.emit_func_output(out)
    main = RecognizeRMSNorm()(bb.get())["main"]
    assert len(op_calls(main, ("relax.nn.rms_norm",))) == 1 and not op_calls(main, ("relax.rsqrt",))
    data = _feeds()["x"][0]
    got = run_outputs(tvm.IRModule({"main": main}), [data])[0]
    np.testing.assert_allclose(got, data / np.sqrt((data * data).mean(-1, keepdims=True) + 1e-6), rtol=1e-5)


def test_long_rows_stay_a_mean_that_is_summed_in_float64_on_cpu():
    """On CPU a mean over 1,024 features or more is widened to float64 (WidenLongReductions), which
    one ``rms_norm`` would not be: such norms stay arithmetic there, and become one op on CUDA."""
    model = _model("reciprocal", hidden=MIN_ELEMENTS)
    for target, norms in (("llvm", 0), (CUDA, 1)):
        target = parse_target(target)
        with target:
            mod = tvm.transform.Sequential(pipeline_stages(target).rewrite)(import_onnx(model).mod)
        assert len(op_calls(mod["main"], ("relax.nn.rms_norm",))) == norms
        widened = [c for c in op_calls(mod["main"], ("relax.astype",)) if str(c.attrs.dtype) == "float64"]
        assert bool(widened) == (target.kind.name == "llvm")
    feeds = _feeds(MIN_ELEMENTS)
    got = run_outputs(tvm_fusion.build(model, "llvm", tuning_logs=None).executable, feeds)[0]
    assert rel_err(got, ort_run(model, feeds)) < 1e-5

"""WidenLongReductions: long float32 sums accumulate in float64; short ones are left alone."""

import numpy as np
import tvm
from conftest import run_outputs
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

import tvm_fusion
from tvm_fusion.ir import op_calls
from tvm_fusion.passes import WidenLongReductions
from tvm_fusion.passes.widen_long_reductions import MIN_ELEMENTS

SHAPE = [1, 8, 114, 114]  # BiT's stem: GroupNorm(32) over 2 channels of a padded 112x112 map
GROUPS = 4


def _conv_group_norm():
    """Conv 3x3 -> GroupNorm as torch exports it (Reshape [1, G, -1], InstanceNormalization,
    Reshape back), on values with a spread like a real conv's (std ~12)."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array((rng.standard_normal((8, 8, 3, 3)) * 0.3).astype(np.float32), "w"),
        numpy_helper.from_array(np.array([1, GROUPS, -1], np.int64), "grouped"),
        numpy_helper.from_array(np.array(SHAPE, np.int64), "shape"),
        numpy_helper.from_array(np.ones(GROUPS, np.float32), "s"),
        numpy_helper.from_array(np.zeros(GROUPS, np.float32), "b"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("Reshape", ["c", "grouped"], ["r"]),
        helper.make_node("InstanceNormalization", ["r", "s", "b"], ["i"], epsilon=1e-5),
        helper.make_node("Reshape", ["i", "shape"], ["y"]),
    ]
    value = [helper.make_tensor_value_info(n, TensorProto.FLOAT, SHAPE) for n in ("x", "y")]
    graph = helper.make_graph(nodes, "gn", value[:1], value[1:], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    x = (np.random.default_rng(1).standard_normal(SHAPE) * 12 + 1).astype(np.float32)
    return model, x, inits[0]


def _float64_reference(x, weight) -> np.ndarray:
    """The conv and the normalization in float64 (the conv as 9 shifted multiply-adds)."""
    w = np.asarray(weight.float_data or np.frombuffer(weight.raw_data, np.float32)).reshape(8, 8, 3, 3)
    padded = np.pad(x.astype(np.float64), [(0, 0), (0, 0), (1, 1), (1, 1)])
    conv = sum(
        np.einsum("oc,nchw->nohw", w[:, :, i, j], padded[:, :, i : i + SHAPE[2], j : j + SHAPE[3]])
        for i in range(3)
        for j in range(3)
    )
    grouped = conv.reshape(1, GROUPS, -1)
    mean, var = grouped.mean(-1, keepdims=True), grouped.var(-1, keepdims=True)
    return ((grouped - mean) / np.sqrt(var + 1e-5)).reshape(SHAPE)


def test_a_long_group_norm_is_as_accurate_as_onnxruntime():
    """Summed in float32 lanes, this model's output was 3.2e-6 off float64 (relative), ONNX
    Runtime's 1.9e-7 (in BiT: 4.2e-6 against 4.7e-7 after the first of 53 norms, and 5x ORT's
    error at the output)."""
    model, x, weight = _conv_group_norm()
    got = run_outputs(tvm_fusion.build(model, "llvm", tuning_logs=None).executable, {"x": x})[0]
    ref = _float64_reference(x, weight)
    assert np.abs(got - ref).max() / np.abs(ref).max() <= 1e-6


def _means(*lengths):
    bb = relax.BlockBuilder()
    xs = [relax.Var(f"x{n}", relax.TensorType((2, n), "float32")) for n in lengths]
    with bb.function("main", xs):
        with bb.dataflow():
            outs = [bb.emit(relax.op.mean(x, axis=[1])) for x in xs]
            out = bb.emit_output(relax.Tuple(outs))
        bb.emit_func_output(out)
    return bb.get()


def test_only_reductions_of_many_elements_are_widened():
    mod = WidenLongReductions()(_means(MIN_ELEMENTS - 1, MIN_ELEMENTS))
    (mean_short, mean_long) = op_calls(mod["main"], ("relax.mean",))
    assert mean_short.args[0].ty.dtype == "float32"
    assert mean_long.args[0].ty.dtype == "float64"
    # the result is float32 again: nothing after it changes
    assert [str(f.dtype) for f in mod["main"].ret_ty.fields] == ["float32", "float32"]


def _root_loops(func) -> list:
    """The loops directly under a scheduled PrimFunc's root block."""
    body = func.body.block.body
    stmts = list(body.seq) if isinstance(body, tvm.tirx.SeqStmt) else [body]
    return [s for s in stmts if isinstance(s, tvm.tirx.For)]


def test_group_norm_statistics_kernels_are_one_parallel_loop_each():
    """The widened reductions keep their whole chain inside the parallel loop over groups: the
    square before the mean, the cast back and the subtract after it (at the root, each was one
    serial scalar loop over the tensor: BiT's group norms 0.6-0.7 ms instead of ~0.2)."""
    model, _, _ = _conv_group_norm()
    lowered = tvm_fusion.build(model, "llvm", tuning_logs=None).lowered
    kernels = {gv.name_hint: f for gv, f in lowered.functions.items() if isinstance(f, tvm.tirx.PrimFunc)}
    statistics = [name for name in kernels if "mean" in name]
    assert len(statistics) == 2, list(kernels)  # the mean, then the mean of squared deviations
    for name in statistics:
        loops = _root_loops(kernels[name])
        assert len(loops) == 1 and loops[0].kind == tvm.tirx.ForKind.PARALLEL, (name, kernels[name].script())

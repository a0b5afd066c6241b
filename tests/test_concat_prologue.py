"""A concat in front of a conv or a pool: fused, its pieces read in place (policy ``concat ->
conv / pool``, ``ConcatPerReader``, ``Contraction``'s loop over the pieces)."""

import numpy as np
import pytest
from conftest import ort_outputs, rel_err, relax_main, run_outputs
from onnx import TensorProto, helper, numpy_helper
from tvm import relax, tirx

from tvm_fusion import FusionPolicy, build
from tvm_fusion.ir import op_calls
from tvm_fusion.passes import ConcatPerReader, MergeUnfusedConcats
from tvm_fusion.policy import DEFAULT_VERTICAL
from tvm_fusion.schedules.plane import is_piece_select, piece_bounds
from tvm_fusion.targets import parse_target


def branches_model(pieces, readers, size=9, channels=8, seed=0):
    """x -> one conv + relu per piece (1x1, or 3x3 where the piece's entry is negative) -> concat
    -> each reader: ``("conv", out_channels, kernel)``, ``("maxpool",)`` or ``("avgpool",)``, each
    reader's result an output (GoogLeNet's inception outputs, SqueezeNet's fire modules)."""
    rng = np.random.default_rng(seed)
    inits, nodes, joined = [], [], []
    for i, piece in enumerate(pieces):
        k = 3 if piece < 0 else 1
        w = numpy_helper.from_array(
            (rng.standard_normal((abs(piece), channels, k, k)) * 0.3).astype("float32"), f"w{i}"
        )
        b = numpy_helper.from_array(rng.standard_normal(abs(piece)).astype("float32"), f"b{i}")
        inits += [w, b]
        nodes += [
            helper.make_node("Conv", ["x", f"w{i}", f"b{i}"], [f"c{i}"], pads=[k // 2] * 4),
            helper.make_node("Relu", [f"c{i}"], [f"r{i}"]),
        ]
        joined.append(f"r{i}")
    nodes.append(helper.make_node("Concat", joined, ["cat"], axis=1))
    total = sum(abs(p) for p in pieces)
    outputs = []
    for j, reader in enumerate(readers):
        if reader[0] == "conv":
            _, out, k = reader
            w = numpy_helper.from_array(
                (rng.standard_normal((out, total, k, k)) * 0.1).astype("float32"), f"v{j}"
            )
            b = numpy_helper.from_array(rng.standard_normal(out).astype("float32"), f"u{j}")
            inits += [w, b]
            nodes += [
                helper.make_node("Conv", ["cat", f"v{j}", f"u{j}"], [f"t{j}"], pads=[k // 2] * 4),
                helper.make_node("Relu", [f"t{j}"], [f"y{j}"]),
            ]
            shape = [1, out, size, size]
        else:
            op = "MaxPool" if reader[0] == "maxpool" else "AveragePool"
            nodes.append(helper.make_node(op, ["cat"], [f"y{j}"], kernel_shape=[3, 3], pads=[1] * 4))
            shape = [1, total, size, size]
        outputs.append(helper.make_tensor_value_info(f"y{j}", TensorProto.FLOAT, shape))
    graph = helper.make_graph(
        nodes,
        "branches",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, channels, size, size])],
        outputs,
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model, {"x": rng.standard_normal((1, channels, size, size)).astype("float32")}


def kernel_names(result) -> list[str]:
    return [gv.name_hint for gv, f in result.lowered.functions.items() if isinstance(f, tirx.PrimFunc)]


@pytest.mark.parametrize(
    "pieces, readers",
    [
        ([16, -16], [("conv", 8, 1)]),  # SqueezeNet's fire module into the next squeeze conv
        ([16, -16], [("maxpool",)]),  # ... into a max pool
        ([24, 40, -8], [("conv", 96, 1), ("maxpool",)]),  # unequal pieces, two readers
        ([8, -16, 24, 16], [("conv", 12, 1), ("conv", 20, 1), ("avgpool",)]),  # an inception output
    ],
    ids=["fire-conv", "fire-pool", "unequal-two-readers", "inception"],
)
def test_readers_read_the_pieces_in_place_and_match_onnx_runtime(cpu_target, pieces, readers):
    model, feeds = branches_model(pieces, readers)
    result = build(model, cpu_target, tuning_logs=None)
    names = kernel_names(result)
    assert not [n for n in names if n.startswith("concatenate")], names  # the joined tensor: never written
    fused = [n for n in names if n.startswith("fused_concat_")]
    assert len(fused) >= len(readers) - (sum(r[0] == "conv" for r in readers) > 1), (
        names
    )  # sibling convs merge
    for got, ref in zip(run_outputs(result.executable, feeds), ort_outputs(model, feeds)):
        assert rel_err(got, ref) < 1e-5


@pytest.mark.parametrize(
    "pieces, readers",
    [
        ([16, 16], [("conv", 24, 3)]),  # a 3x3 conv: its schedules would write the concat inside
        ([1, 34], [("conv", 8, 1)]),  # 35 one-channel steps: too many to loop over apart
    ],
    ids=["conv3x3", "too-many-steps"],
)
def test_a_concat_the_conv_cannot_read_in_place_is_still_written_once(cpu_target, pieces, readers):
    """No branch per load in the conv's micro-kernel: the concat is written as before (its own
    kernel, or a stage of the conv's kernel), and the result is right."""
    model, feeds = branches_model(pieces, readers)
    result = build(model, cpu_target, tuning_logs=None)
    names = kernel_names(result)
    for name in names:
        script = result.lowered[name].script()
        if "conv2d_nchw_update" in script:
            update = script.split('T.sblock("conv2d_nchw_update")')[1].split("T.sblock(")[0]
            assert "if_then_else" not in update, name
    if readers[0][2] != 1:  # only pools and 1x1 convs take a concat in front
        assert [n for n in names if n.startswith("concatenate")], names
    for got, ref in zip(run_outputs(result.executable, feeds), ort_outputs(model, feeds)):
        assert rel_err(got, ref) < 1e-5


def test_without_the_policy_edges_the_concat_is_its_own_kernel(cpu_target):
    model, feeds = branches_model([16, -16], [("conv", 8, 1), ("maxpool",)])
    policy = FusionPolicy()
    policy.vertical["concat"] = [c for c in policy.vertical["concat"] if c not in ("conv", "pool")]
    result = build(model, cpu_target, policy=policy, tuning_logs=None)
    names = kernel_names(result)
    assert [n for n in names if n.startswith("concatenate")] and not [n for n in names if "fused_concat" in n]
    for got, ref in zip(run_outputs(result.executable, feeds), ort_outputs(model, feeds)):
        assert rel_err(got, ref) < 1e-5


def test_copies_the_planner_leaves_unfused_are_written_once(cpu_target):
    """ConcatPerReader copies a shared concat before the planner decides; with a benefit threshold
    no edge meets, no copy fuses, and the pipeline's CSE merges them back: one concat call."""
    model, feeds = branches_model([24, 40, -8], [("conv", 96, 1), ("maxpool",)])
    result = build(model, cpu_target, policy=FusionPolicy(benefit_threshold_us=1e9), tuning_logs=None)
    concat = [n for n in kernel_names(result) if n.startswith("concatenate")]
    assert len(concat) == 1 and not [n for n in kernel_names(result) if "fused_concat" in n]
    calls = [ln for ln in result.lowered["main"].script().splitlines() if f"R.call_tir({concat[0]}," in ln]
    assert len(calls) == 1, calls
    for got, ref in zip(run_outputs(result.executable, feeds), ort_outputs(model, feeds)):
        assert rel_err(got, ref) < 1e-5


def _shared_concat(bb, x):
    """concat(relu(x), x) read by two convs and an add (a reader of another kind)."""
    cat = bb.emit(relax.op.concat([bb.emit(relax.op.nn.relu(x)), x], axis=1))
    w1 = relax.const(np.ones((4, 16, 1, 1), "float32"))
    w2 = relax.const(np.ones((6, 16, 1, 1), "float32"))
    a = bb.emit(relax.op.nn.conv2d(cat, w1))
    b = bb.emit(relax.op.nn.conv2d(cat, w2))
    c = bb.emit(relax.op.add(cat, cat))
    return relax.Tuple([a, b, c])


def test_concat_per_reader_gives_each_conv_its_own_copy():
    mod = relax_main({"x": (1, 8, 5, 5)}, _shared_concat)
    rewritten = ConcatPerReader()(mod)
    assert len(op_calls(mod["main"], {"relax.concat"})) == 1
    assert len(op_calls(rewritten["main"], {"relax.concat"})) == 3  # one per conv, the add keeps its own
    convs = op_calls(rewritten["main"], {"relax.nn.conv2d"})
    assert len(convs) == 2 and not convs[0].args[0].same_as(convs[1].args[0])
    feeds = {"x": np.random.default_rng(0).standard_normal((1, 8, 5, 5)).astype("float32")}
    for got, ref in zip(run_outputs(rewritten, feeds), run_outputs(mod, feeds)):
        np.testing.assert_allclose(got, ref, rtol=1e-6)


def test_concat_per_reader_follows_the_policy():
    mod = relax_main({"x": (1, 8, 5, 5)}, _shared_concat)
    policy = FusionPolicy()
    policy.vertical["concat"] = [c for c in policy.vertical["concat"] if c != "conv"]
    assert ConcatPerReader(policy)(mod).same_as(mod)
    # on CUDA the concat stays apart (TARGET_EXCLUSIONS): nothing to copy for
    assert ConcatPerReader(FusionPolicy().for_target(parse_target("cuda")))(mod).same_as(mod)
    assert "conv" in DEFAULT_VERTICAL["concat"] and "pool" in DEFAULT_VERTICAL["concat"]


def test_merge_unfused_concats_merges_only_equal_concats():
    def graph(bb, x):
        y = bb.emit(relax.op.nn.relu(x))
        a = bb.emit(relax.op.concat([y, x], axis=1))
        b = bb.emit(relax.op.concat([y, x], axis=1))  # a twin of a
        c = bb.emit(relax.op.concat([x, y], axis=1))  # other order
        d = bb.emit(relax.op.concat([y, x], axis=0))  # other axis
        e = bb.emit(relax.op.concat([b, y], axis=1))  # equal to f once b is a
        f = bb.emit(relax.op.concat([a, y], axis=1))
        return relax.Tuple([bb.emit(relax.op.add(a, b)), c, d, bb.emit(relax.op.add(e, f))])

    mod = relax_main({"x": (1, 8, 5, 5)}, graph)
    merged = MergeUnfusedConcats()(mod)
    assert relax.analysis.check_well_formed(merged)
    assert len(op_calls(merged["main"], {"relax.concat"})) == 4
    for add in op_calls(merged["main"], {"relax.add"}):
        assert add.args[0].same_as(add.args[1])
    feeds = {"x": np.random.default_rng(0).standard_normal((1, 8, 5, 5)).astype("float32")}
    for got, ref in zip(run_outputs(merged, feeds), run_outputs(mod, feeds)):
        np.testing.assert_allclose(got, ref, rtol=1e-6)
    assert MergeUnfusedConcats()(merged).same_as(merged)


def test_merge_unfused_concats_stays_within_a_binding_block():
    from tvm.script import ir as I
    from tvm.script import relax as R

    @I.ir_module
    class Module:
        @R.function
        def main(x: R.Tensor((1, 8, 5, 5), "float32")):
            with R.dataflow():
                a = R.concat((x, x), axis=1)
                b = R.concat((x, x), axis=1)
                c = R.add(a, b)
                R.output(c)
            f = R.concat((x, x), axis=1)  # in a block of its own, outside the dataflow blocks
            with R.dataflow():
                d = R.concat((x, x), axis=1)  # equal to a, but a is out of scope here
                e = R.add(d, c)
                R.output(e)
            return R.add(e, f)

    merged = MergeUnfusedConcats()(Module)
    assert relax.analysis.check_well_formed(merged)
    assert len(op_calls(merged["main"], {"relax.concat"})) == 3


def test_piece_bounds_of_a_concat_block():
    import tvm
    from tvm import te

    a, b, c = (te.placeholder((n, 4), name=f"p{n}") for n in (3, 5, 2))
    joined = tvm.topi.concatenate([a, b, c], axis=0)
    func = te.create_prim_func([a, b, c, joined])
    sch = tvm.s_tir.Schedule(func)
    block = sch.get(sch.get_sblock(joined.op.name))
    assert is_piece_select(block)
    assert piece_bounds(block, block.iter_vars[0].var) == [3, 8]
    assert piece_bounds(block, block.iter_vars[1].var) == []


@pytest.mark.parametrize("pieces, copies", [([16, -16], 2), ([24, 40, -8], 9)])
def test_the_conv_loops_over_the_pieces_apart(cpu_target, pieces, copies):
    """The reduction over the joined channels is split at the pieces' gcd and the outer loop
    unrolled: each copy reads one piece, so no branch is left in the micro-kernel."""
    import tvm

    model, _ = branches_model(pieces, [("conv", 32, 1)])
    result = build(model, cpu_target, tuning_logs=None)
    (name,) = [n for n in kernel_names(result) if n.startswith("fused_concat_conv2d")]
    sch = tvm.s_tir.Schedule(result.lowered[name])
    loops = [sch.get(loop) for loop in sch.get_loops(sch.get_sblock("conv2d_nchw_update"))]
    kinds = [(loop.kind, int(loop.extent)) for loop in loops]
    step = sum(abs(p) for p in pieces) // copies
    assert (tirx.ForKind.UNROLLED, copies) in kinds and (tirx.ForKind.SERIAL, step) in kinds, kinds

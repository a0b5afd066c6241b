"""FoldConstantCalls: constant call_tirs evaluated with one build, same values as FoldConstant."""

import numpy as np
import tvm
from tvm import relax
from tvm.script import relax as R

from tvm_fusion.passes import FoldConstantCalls
from tvm_fusion.schedules import apply_default_schedules


def _module(weights):
    """main(x) = x @ w0 @ w1 ...: after the CPU schedules, one packing call_tir per weight."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", R.Tensor((4, weights[0].shape[0]), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = x
            for w in weights:
                y = bb.emit(relax.op.matmul(y, relax.const(w)))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return bb.get()


def _constant_calls(mod) -> int:
    found = []

    def visit(e):
        if isinstance(e, relax.Call) and e.op.same_as(tvm.ir.Op.get("relax.call_tir")):
            if all(isinstance(a, tvm.ir.expr.Constant) for a in e.args[1].fields):
                found.append(e)

    relax.analysis.post_order_visit(mod["main"], visit)
    return len(found)


def test_packing_calls_fold_to_the_same_constants_as_fold_constant(cpu_target):
    rng = np.random.default_rng(0)
    weights = [rng.standard_normal((64, 64)).astype("float32") for _ in range(2)]  # same packing func twice
    weights.append(rng.standard_normal((64, 48)).astype("float32"))
    with cpu_target:
        mod = relax.get_pipeline("zero")(_module(weights))
        mod = relax.transform.AttachAttrLayoutFreeBuffers()(mod)
        from tvm.s_tir import dlight as dl

        from tvm_fusion.schedules import default_rules

        mod = dl.ApplyDefaultSchedule(*default_rules(cpu_target))(mod)
        split = relax.transform.SplitLayoutRewritePreproc()(mod)
    assert _constant_calls(split) >= 2  # a packing call per packed weight
    ours = FoldConstantCalls()(split)
    stock = relax.transform.FoldConstant()(split)
    assert _constant_calls(ours) == 0 == _constant_calls(stock)
    x = rng.standard_normal((4, 64)).astype("float32")
    outs = []
    for m in (ours, stock):
        vm = relax.VirtualMachine(tvm.compile(m, target=cpu_target), tvm.cpu())
        outs.append(vm["main"](tvm.runtime.tensor(x)).numpy())
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_allclose(outs[0], x @ weights[0] @ weights[1] @ weights[2], rtol=1e-4, atol=1e-4)
    # and the scheduling pass as a whole leaves none either
    with cpu_target:
        full = apply_default_schedules(cpu_target)(relax.get_pipeline("zero")(_module(weights)))
    assert _constant_calls(full) == 0


def test_a_weight_shared_by_several_calls_is_packed_once(cpu_target):
    # ALBERT's 12 layers share one set of weights: one packed copy each, not one per layer
    rng = np.random.default_rng(1)
    shared = rng.standard_normal((64, 64)).astype("float32")
    other = rng.standard_normal((64, 32)).astype("float32")
    with cpu_target:
        mod = apply_default_schedules(cpu_target)(relax.get_pipeline("zero")(_module([shared] * 3 + [other])))
    assert _constant_calls(mod) == 0
    packed = []

    def visit(e):
        tensor = isinstance(e, tvm.ir.expr.Constant) and isinstance(e.value, tvm.runtime.Tensor)
        if tensor and not any(e.same_as(p) for p in packed):
            packed.append(e)

    relax.analysis.post_order_visit(mod["main"], visit)
    assert sorted(p.value.numpy().size for p in packed) == [32 * 64, 64 * 64], [p.value.shape for p in packed]
    x = rng.standard_normal((4, 64)).astype("float32")
    vm = relax.VirtualMachine(tvm.compile(mod, target=cpu_target), tvm.cpu())
    got = vm["main"](tvm.runtime.tensor(x)).numpy()
    np.testing.assert_allclose(got, x @ shared @ shared @ shared @ other, rtol=1e-4, atol=1e-4)

"""SimplifyUnitPermutes: transposes of size-1 axes are free reshapes, and a layer norm in front
of one still fuses into its GEMM (ViT's seq-first attention projections at batch 1)."""

import numpy as np
import pytest
import tvm
from conftest import ort_run, run_executable
from tvm import relax
from tvm.script import relax as R

import tvm_fusion
from tvm_fusion import models
from tvm_fusion.passes import SimplifyUnitPermutes
from tvm_fusion.passes.simplify_unit_permutes import moves_only_unit_axes
from tvm_fusion.report import kernel_calls


def seq_first_projection(batch=1, seq=12, dim=32, out=48):
    """x -> LayerNorm -> [seq, batch, dim] -> MatMul + bias -> [batch, seq, out] -> + residual."""
    g = models.GraphBuilder("seq_first_projection")
    x = g.input("input", (batch, seq, dim))
    h = g.op("LayerNormalization", [x, g.weight("gamma", (dim,)), g.weight("beta", (dim,))], axis=-1)
    h = g.op("Transpose", [h], perm=[1, 0, 2])
    h = g.op("Add", [g.op("MatMul", [h, g.weight("w", (dim, out))]), g.weight("b", (out,))])
    h = g.op("Transpose", [h], perm=[1, 0, 2])
    return g.finish([g.op("Add", [h, g.weight("residual", (batch, seq, out))])])


def test_seq_first_projection_has_no_transpose_kernel_and_fuses_the_norm():
    model = seq_first_projection()
    feeds = models.random_inputs(model)
    result = tvm_fusion.build(model, "llvm", tuning_logs=None)
    kernels = kernel_calls(result.lowered)
    assert not any("permute_dims" in k for k in kernels), kernels
    assert any("layer_norm" in k and "matmul" in k for k in kernels), kernels
    got, ref = run_executable(result.executable, feeds), ort_run(model, feeds)
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()


def test_a_real_transpose_is_kept():
    """At batch 2 the transpose moves data: it stays, and the numbers still match."""
    model = seq_first_projection(batch=2)
    feeds = models.random_inputs(model)
    result = tvm_fusion.build(model, "llvm", tuning_logs=None)
    assert any("permute_dims" in k for k in kernel_calls(result.lowered))
    got, ref = run_executable(result.executable, feeds), ort_run(model, feeds)
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()


@pytest.mark.parametrize(
    "shape, axes, unit_only",
    [
        ((1, 197, 768), [1, 0, 2], True),
        ((4, 1, 8, 1), [1, 3, 0, 2], True),
        ((2, 197, 768), [1, 0, 2], False),
        ((1, 8, 16), [0, 2, 1], False),
        ((1, 8, 16), [0, -1, 1], False),  # negative axes: still the 8 <-> 16 transpose
        ((1, 8, 16), [-2, -3, -1], True),
        ((1, 1, 16), None, True),  # axes=None reverses them
        ((2, 1, 16), None, False),
        (("n", 1, 16), [1, 0, 2], True),  # the symbolic axis keeps its place
        (("n", "m", 16), [1, 0, 2], False),  # a symbolic size may be anything but 1
    ],
)
def test_moves_only_unit_axes(shape, axes, unit_only):
    dims = [tvm.tirx.Var(d, "int64") if isinstance(d, str) else d for d in shape]
    x = relax.Var("x", relax.TensorType(dims, "float32"))
    call = relax.op.permute_dims(x, axes)
    bb = relax.BlockBuilder()
    with bb.function("f", [x]):
        bb.emit_func_output(call)
    assert moves_only_unit_axes(bb.normalize(call)) is unit_only


def test_norm_with_other_users_is_not_moved():
    """The hoist needs the norm's only use to be the reshape; else the norm runs twice."""

    @R.function
    def f(x: R.Tensor((1, 8, 16), "float32"), g: R.Tensor((16,), "float32"), b: R.Tensor((16,), "float32")):
        with R.dataflow():
            n = R.nn.layer_norm(x, g, b, axes=[-1])
            p = R.permute_dims(n, [1, 0, 2])
            out = R.add(p, R.permute_dims(n, [1, 0, 2]))
            R.output(out)
        return out

    mod = SimplifyUnitPermutes()(tvm.IRModule({"main": f}))
    ops = [str(b.value.op.name) for b in mod["main"].body.blocks[0].bindings]
    assert ops.count("relax.nn.layer_norm") == 1 and "relax.permute_dims" not in ops

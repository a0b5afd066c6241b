"""The shared IR helpers: one constant reader for every pass that looks for constants."""

import numpy as np
from tvm import relax

from tvm_fusion.ir import constant_value, is_constant, scalar_value


def _bound(build):
    """The function ``build(bb, x)`` makes, and its var -> value map."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType([2, 3], "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(build(bb, x))
        bb.emit_func_output(out)
    func = bb.get()["main"]
    return func, relax.analysis.get_var2val(func)


def _var(func, name):
    return next(v for v in relax.analysis.get_var2val(func) if v.name == name)


def test_constant_value_follows_vars_through_reshapes_permutes_and_casts():
    w = (np.arange(6, dtype="float32") / 3).reshape(2, 3)

    def build(bb, x):
        c = bb.emit(relax.op.reshape(relax.const(w), [3, 2]), name_hint="r")
        c = bb.emit(relax.op.permute_dims(c, [1, 0]), name_hint="p")
        c = bb.emit(relax.op.astype(c, "float16"), name_hint="c")
        return relax.op.add(x, relax.op.astype(c, "float32"))

    func, var2val = _bound(build)
    value = constant_value(_var(func, "c"), var2val)
    assert value.dtype == np.float16
    np.testing.assert_array_equal(value, w.reshape(3, 2).T.astype("float16"))
    assert constant_value(_var(func, "c"), var2val, hidden={_var(func, "p")}) is None
    assert constant_value(_var(func, "c"), {}) is None  # a var it cannot look up
    assert constant_value(func.params[0], var2val) is None


def test_scalar_value_takes_one_element_constants_only():
    def build(bb, x):
        half = bb.emit(relax.op.reshape(relax.const(np.float32(0.5)), [1, 1]), name_hint="half")
        return relax.op.multiply(x, half)

    func, var2val = _bound(build)
    assert scalar_value(_var(func, "half"), var2val) == 0.5
    assert scalar_value(relax.const(np.ones(2, "float32"))) is None
    assert scalar_value(relax.const(np.float32(2.0))) == 2.0
    assert scalar_value(relax.op.add(relax.const(1.0), relax.const(1.0))) is None  # not folded
    assert is_constant(relax.const(1.0)) and not is_constant(_var(func, "half"))

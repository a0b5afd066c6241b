"""ONNX ``LSTM`` and ``GRU``, unrolled over their static sequence (the Relax ONNX frontend has neither).

Both torch exporters write ``nn.LSTM`` / ``nn.GRU`` as these ops, one per layer. Each direction
becomes one GEMM of the whole input sequence by the input weights (plus every bias that does not
depend on the state), then per time step a matmul of the hidden state by the recurrent weights
and the gate arithmetic, as ONNX defines it (gate order ``i, o, f, c`` for LSTM, ``z, r, h`` for
GRU). The step count must be static; the weights are usually constants, so their transposes fold
at compile time. Unsupported attributes (per-sample ``sequence_lens`` shorter than the sequence,
``input_forget``, activations other than Sigmoid / Tanh / Relu or with parameters) are refused by
name.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend as frontend

from .ir import shape_dims
from .onnx_inputs import constant_input

_ACTIVATIONS = {"sigmoid": relax.op.sigmoid, "tanh": relax.op.tanh, "relu": relax.op.nn.relu}
_DIRECTIONS = {"forward": ["forward"], "reverse": ["reverse"], "bidirectional": ["forward", "reverse"]}


class LSTM(frontend.OnnxOpConverter):
    """``LSTM`` (opset 7; 14 adds ``layout``). Outputs ``Y, Y_h, Y_c``."""

    @classmethod
    def _impl_v7(cls, bb, inputs, attr, params):
        return _recurrence(bb, inputs, attr, params, gates=4, defaults=("sigmoid", "tanh", "tanh"))


class GRU(frontend.OnnxOpConverter):
    """``GRU`` (opset 7; 14 adds ``layout``). Outputs ``Y, Y_h``."""

    @classmethod
    def _impl_v7(cls, bb, inputs, attr, params):
        return _recurrence(bb, inputs, attr, params, gates=3, defaults=("sigmoid", "tanh"))


def _recurrence(bb: relax.BlockBuilder, inputs, attr, params, gates: int, defaults: tuple):
    x, w, r, b, sequence_lens, initial_h = (inputs[i] for i in range(6))
    initial_c, peepholes = (inputs[6], inputs[7]) if gates == 4 else (None, None)
    if attr.get("input_forget", 0):
        raise ValueError("LSTM: input_forget (coupled input and forget gates) is not supported")
    if "activation_alpha" in attr or "activation_beta" in attr:
        raise ValueError("activations with alpha / beta parameters are not supported")
    batch_first = bool(attr.get("layout", 0))
    if batch_first:
        x = bb.emit(relax.op.permute_dims(x, [1, 0, 2]))
        initial_h, initial_c = (_batch_first_state(bb, s) for s in (initial_h, initial_c))
    steps = _static_dim(x, 0, "the sequence length")
    direction = _text(attr.get("direction", b"forward"))
    if direction not in _DIRECTIONS:
        raise ValueError(f"unknown direction {direction!r}")
    activations = _activations(attr, defaults, direction)
    _check_full_sequences(sequence_lens, params, steps)
    hidden = _static_dim(r, 2, "the hidden size")
    zeros = relax.op.zeros(relax.ShapeExpr([x.ty.shape.values[1], hidden]), str(x.ty.dtype))
    clip = attr.get("clip")
    outputs = []
    for d, name in enumerate(_DIRECTIONS[direction]):
        act = activations[d]
        state = _State(
            h=_direction_of(bb, initial_h, d, zeros),
            c=_direction_of(bb, initial_c, d, zeros) if gates == 4 else None,
        )
        cell = _Cell(bb, *(_direction_of(bb, v, d) for v in (w, r, b)), hidden)
        cell.linear_before_reset = bool(attr.get("linear_before_reset", 0))
        if peepholes is not None:
            p = _direction_of(bb, peepholes, d)
            cell.peepholes = [_part(bb, p, k, hidden) for k in range(3)]  # i, o, f
        projected = cell.project_inputs(x, gates)  # [steps, batch, gates * hidden]
        order = range(steps) if name == "forward" else range(steps - 1, -1, -1)
        ys = [None] * steps
        for t in order:
            xt = bb.emit(relax.op.take(projected, relax.const(t, "int64"), axis=0))
            state = cell.lstm(xt, state, act, clip) if gates == 4 else cell.gru(xt, state, act, clip)
            ys[t] = state.h
        outputs.append((bb.emit(relax.op.stack(ys, axis=0)), state))
    y = bb.emit(relax.op.stack([y for y, _ in outputs], axis=1))  # [steps, directions, batch, hidden]
    parts = ["h", "c"] if gates == 4 else ["h"]
    last = [bb.emit(relax.op.stack([getattr(s, part) for _, s in outputs], axis=0)) for part in parts]
    if batch_first:
        y = bb.emit(relax.op.permute_dims(y, [2, 0, 1, 3]))
        last = [bb.emit(relax.op.permute_dims(s, [1, 0, 2])) for s in last]
    return relax.Tuple([y, *last])


@dataclasses.dataclass
class _State:
    h: relax.Expr
    c: relax.Expr | None  # LSTM only


class _Cell:
    """One direction's weights, and its step functions."""

    def __init__(self, bb, w, r, b, hidden: int):
        self.bb, self.w, self.b, self.hidden = bb, w, b, hidden
        self.r_t = bb.emit(relax.op.permute_dims(r, [1, 0]))  # [hidden, gates * hidden]
        self.peepholes = None  # LSTM: [p_i, p_o, p_f]
        self.linear_before_reset = False
        self.r_bias_h = None  # GRU: the candidate's recurrent bias
        self.r_zr = self.r_h = None  # GRU without linear_before_reset: R's gate / candidate parts

    def project_inputs(self, x, gates: int):
        """``x · Wᵀ`` plus the biases outside the recurrence: both biases of every LSTM gate, the
        input bias of every GRU gate and the recurrent bias of its update and reset gates. A GRU
        without ``linear_before_reset`` gets its recurrent weights split here, once for all steps."""
        bb, hidden = self.bb, self.hidden
        if gates == 3 and not self.linear_before_reset:
            self.r_zr = bb.emit(relax.op.strided_slice(self.r_t, [1], [0], [2 * hidden]))
            self.r_h = bb.emit(relax.op.strided_slice(self.r_t, [1], [2 * hidden], [3 * hidden]))
        projected = relax.op.matmul(x, bb.emit(relax.op.permute_dims(self.w, [1, 0])))
        if self.b is None:
            return bb.emit(projected)
        w_bias, r_bias = (
            bb.emit(relax.op.strided_slice(self.b, [0], [k * gates * hidden], [(k + 1) * gates * hidden]))
            for k in (0, 1)
        )
        if gates == 3:  # the candidate's recurrent bias stays inside the recurrence
            self.r_bias_h = bb.emit(relax.op.strided_slice(r_bias, [0], [2 * hidden], [3 * hidden]))
            r_bias = relax.op.concat(
                [relax.op.strided_slice(r_bias, [0], [0], [2 * hidden]), relax.op.zeros_like(self.r_bias_h)],
                0,
            )
        return bb.emit(relax.op.add(projected, relax.op.add(w_bias, r_bias)))

    def lstm(self, xt, state: _State, act, clip) -> _State:
        bb, hidden = self.bb, self.hidden
        f, g, h = act
        pre = bb.emit(relax.op.add(xt, relax.op.matmul(state.h, self.r_t)))
        i, o, forget, cand = (_part(bb, pre, k, hidden) for k in range(4))
        if self.peepholes is not None:
            p_i, p_o, p_f = self.peepholes
            i = relax.op.add(i, relax.op.multiply(p_i, state.c))
            forget = relax.op.add(forget, relax.op.multiply(p_f, state.c))
        i, forget, cand = (bb.emit(a(_clip(v, clip))) for a, v in ((f, i), (f, forget), (g, cand)))
        c = bb.emit(relax.op.add(relax.op.multiply(forget, state.c), relax.op.multiply(i, cand)))
        if self.peepholes is not None:
            o = relax.op.add(o, relax.op.multiply(p_o, c))
        o = bb.emit(f(_clip(o, clip)))
        return _State(h=bb.emit(relax.op.multiply(o, h(c))), c=c)  # h(Ct) not clipped, as in ORT

    def gru(self, xt, state: _State, act, clip) -> _State:
        bb, hidden = self.bb, self.hidden
        f, g = act
        x_z, x_r, x_h = (_part(bb, xt, k, hidden) for k in range(3))
        r_bias_h = self.r_bias_h
        if self.linear_before_reset:
            recurrent = bb.emit(relax.op.matmul(state.h, self.r_t))
            h_z, h_r, h_h = (_part(bb, recurrent, k, hidden) for k in range(3))
            if r_bias_h is not None:
                h_h = relax.op.add(h_h, r_bias_h)
            z, r = (bb.emit(f(_clip(relax.op.add(a, b), clip))) for a, b in ((x_z, h_z), (x_r, h_r)))
            cand = relax.op.add(x_h, relax.op.multiply(r, h_h))
        else:
            recurrent = bb.emit(relax.op.matmul(state.h, self.r_zr))
            h_z, h_r = (_part(bb, recurrent, k, hidden) for k in range(2))
            z, r = (bb.emit(f(_clip(relax.op.add(a, b), clip))) for a, b in ((x_z, h_z), (x_r, h_r)))
            cand = relax.op.add(x_h, relax.op.matmul(relax.op.multiply(r, state.h), self.r_h))
            if r_bias_h is not None:
                cand = relax.op.add(cand, r_bias_h)
        cand = bb.emit(g(_clip(cand, clip)))
        # (1 - z) ⊙ h~ + z ⊙ h
        h = relax.op.add(cand, relax.op.multiply(z, relax.op.subtract(state.h, cand)))
        return _State(h=bb.emit(h), c=None)


def _activations(attr, defaults: tuple, direction: str) -> list[list]:
    """The activation functions of each direction (ONNX lists them one direction after the other)."""
    count = len(_DIRECTIONS[direction])
    names = [_text(a).lower() for a in attr.get("activations", defaults * count)]
    if len(names) != len(defaults) * count:
        raise ValueError(
            f"{len(names)} activations given; a {direction} node takes {len(defaults)} per direction"
        )
    unknown = sorted(set(names) - set(_ACTIVATIONS))
    if unknown:
        raise ValueError(f"activation {unknown[0]!r} is not supported (only Sigmoid, Tanh, Relu)")
    k = len(defaults)
    return [[_ACTIVATIONS[n] for n in names[d * k : (d + 1) * k]] for d in range(count)]


def _part(bb, value, k: int, hidden: int):
    """Gate ``k`` of a ``[..., gates * hidden]`` value."""
    axis = len(value.ty.shape) - 1
    return bb.emit(relax.op.strided_slice(value, [axis], [k * hidden], [(k + 1) * hidden]))


def _clip(value, clip):
    return value if clip is None else relax.op.clip(value, -float(clip), float(clip))


def _direction_of(bb, value, d: int, absent=None):
    """``value[d]`` of a per-direction input; ``absent`` (emitted) when the input is."""
    if value is None:
        return None if absent is None else bb.emit(absent)
    return bb.emit(relax.op.take(value, relax.const(d, "int64"), axis=0))


def _batch_first_state(bb, state):
    return None if state is None else bb.emit(relax.op.permute_dims(state, [1, 0, 2]))


def _check_full_sequences(sequence_lens, params, steps: int) -> None:
    lens = constant_input(sequence_lens, params, "sequence_lens")
    if lens is not None and np.any(lens != steps):
        raise ValueError(
            f"sequence_lens shorter than the sequence ({steps} steps) is not supported: pad and mask instead"
        )


def _static_dim(value, axis: int, what: str) -> int:
    dims = shape_dims(value)
    if dims is None or dims[axis] is None:
        raise ValueError(f"{what} must be static")
    return dims[axis]


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)

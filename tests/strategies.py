"""Hypothesis strategies: random small ONNX DAGs over tvm_fusion's supported op set.

``random_models()`` draws a *program*: a list of ``tvm_fusion.models.GraphBuilder`` calls. The
structure (ops, which tensor feeds which op, shapes, attributes) is drawn with hypothesis
primitives, so failures shrink towards short chains over the first tensor; weights come from
the builder's seeded RNG (the seed is drawn too and shrinks towards 0).

A drawn :class:`GraphSpec` prints as a standalone Python script that rebuilds the exact model
(same calls, same order, same seed), so a hypothesis failure report *is* a reproducer.

Op set: Conv (1x1/3x3, stride 1/2, bias or not, groups 1 / 2 / depthwise), sibling convs and
matmuls sharing one input (with per-branch bias and a shared activation: the horizontal-fusion
case), MatMul (+bias Add) and Gemm(transB) with constant weights, BatchNormalization (4-D and
2-D), Relu / Sigmoid / Tanh / Clip(0, 6) / erf-GELU / x*sigmoid(x) SiLU, LayerNormalization,
Softmax, residual Adds, multi-consumer tensors, Reshape / Transpose (HW swap, image -> tokens,
token transposes), GlobalAveragePool+Flatten, Flatten, MaxPool. Shapes are tiny (spatial <= 8,
channels <= 16, features <= 32) so one example compiles in about a second.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
import onnx
from hypothesis import strategies as st

from tvm_fusion.models import GraphBuilder

CHANNELS = [2, 4, 6, 8, 12, 16]  # 6 and 12: the NCHW8c block does not divide them
FEATURES = [4, 6, 8, 16, 32]
SPATIAL = [4, 5, 7, 8]  # odd sizes: stride-2 convs/pools with ceil/floor edges
ACTIVATIONS = ["relu", "sigmoid", "tanh", "relu6", "gelu", "silu"]

IMG, SEQ, VEC = "img", "seq", "vec"  # (1, C, H, W) / (B, S, F) / (B, F)


@dataclasses.dataclass
class _Tensor:
    name: str
    kind: str
    shape: tuple
    depth: int  # ops on the longest path from an input


class GraphSpec:
    """A drawn model: the builder program plus facts the properties need.

    (A plain class, not a dataclass: hypothesis pretty-prints dataclasses field by field, and we
    want its failure report to be the runnable script of ``__repr__``.)
    """

    def __init__(
        self, code: str, seed: int, inputs: tuple, outputs: tuple, ops: tuple, depth: int, n_bn: int
    ):
        self.code = code  # GraphBuilder calls; ``g`` is the builder, ``np`` numpy
        self.seed = seed
        self.inputs = inputs  # (name, shape) of the model inputs
        self.outputs = outputs  # Python names (in ``code``) of the output tensors
        self.ops = ops  # layer names, in order (for stats / targeting)
        self.depth = depth  # longest input -> output path, in ONNX nodes
        self.n_bn = n_bn

    @functools.cached_property
    def model(self) -> onnx.ModelProto:
        g = GraphBuilder("random_graph", seed=self.seed)
        env = {"g": g, "np": np, "math": math}
        exec(compile(self.code, "<graph spec>", "exec"), env)  # noqa: S102 (our own generated code)
        return g.finish([env[name] for name in self.outputs])

    def feeds(self, seed: int = 0) -> dict:
        rng = np.random.default_rng(seed)
        return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in self.inputs}

    def script(self) -> str:
        """A standalone script that rebuilds the model (``model``) and its inputs (``feeds``)."""
        return "\n".join(
            [
                "import math",
                "import numpy as np",
                "from tvm_fusion.models import GraphBuilder",
                "",
                f"g = GraphBuilder('random_graph', seed={self.seed})",
                self.code.rstrip(),
                f"model = g.finish([{', '.join(self.outputs)}])",
                "rng = np.random.default_rng(0)",
                "feeds = {"
                + ", ".join(
                    f"{n!r}: rng.standard_normal({tuple(s)!r}).astype(np.float32)" for n, s in self.inputs
                )
                + "}",
                "",
            ]
        )

    def __repr__(self) -> str:  # what hypothesis prints for a falsifying example
        return f"GraphSpec(ops={list(self.ops)}, depth={self.depth}) built by:\n" + self.script()


class _Program:
    """Accumulates builder calls and tracks tensors, consumers and depth while drawing."""

    def __init__(self):
        self.lines: list[str] = []
        self.pool: list[_Tensor] = []
        self.used: set[str] = set()
        self.inputs: list[tuple] = []
        self.ops: list[str] = []
        self.n_bn = 0
        self._n = 0

    def new(self, kind, shape, depth) -> _Tensor:
        t = _Tensor(f"t{self._n}", kind, tuple(int(s) for s in shape), depth)
        self._n += 1
        self.pool.append(t)
        return t

    def emit(self, line: str) -> None:
        self.lines.append(line)

    def use(self, *tensors: _Tensor) -> None:
        self.used.update(t.name for t in tensors)


def _act_expr(act: str, x: str) -> str:
    """Python expression applying ``act`` to tensor name ``x`` (exporter spellings)."""
    if act == "relu":
        return f"g.relu({x})"
    if act == "relu6":
        return f"g.relu6({x})"
    if act == "gelu":
        return f"g.gelu({x})"  # erf form: x*0.5*(1+erf(x/sqrt2))
    if act == "silu":
        return f"g.op('Mul', [{x}, g.op('Sigmoid', [{x}])])"
    return f"g.op({act.capitalize()!r}, [{x}])"  # Sigmoid / Tanh


_ACT_NODES = {"relu": 1, "relu6": 1, "sigmoid": 1, "tanh": 1, "gelu": 5, "silu": 2}


def _conv_out(h: int, k: int, s: int) -> int:
    return (h + 2 * (k // 2) - k) // s + 1


def _bias(n: int) -> str:
    return f"(g.rng.standard_normal({n}) * 0.1).astype(np.float32)"


# -- layer drawers: each takes (draw, program, source tensor) and emits one layer ----------------
def _conv(draw, p: _Program, x: _Tensor):
    _, cin, h, w = x.shape
    k = draw(st.sampled_from([1, 3]))
    stride = draw(st.sampled_from([1, 2])) if min(h, w) >= 3 else 1
    mode = draw(st.sampled_from(["dense", "depthwise", "grouped"]))
    if mode == "depthwise":
        groups, cout = cin, cin
    else:
        cout = draw(st.sampled_from(CHANNELS))
        groups = 2 if (mode == "grouped" and cin % 2 == 0 and cout % 2 == 0) else 1
    bias = draw(st.booleans())
    y = p.new(IMG, (1, cout, _conv_out(h, k, stride), _conv_out(w, k, stride)), x.depth + 1 + bias)
    p.emit(
        f"{y.name} = g.conv({x.name}, {cin}, {cout}, k={k}, stride={stride}, groups={groups}, bias={bias})"
    )
    p.ops.append(f"conv{k}x{k}/s{stride}/g{groups}{'+b' if bias else ''}")


def _branch_act(draw):
    return draw(st.sampled_from([None, *ACTIVATIONS]))


def _conv_siblings(draw, p: _Program, x: _Tensor):
    """2-3 convs (same kernel/stride, groups=1) reading one tensor: HorizontalFuse's conv case."""
    _, cin, h, w = x.shape
    n = draw(st.integers(2, 3))
    k = draw(st.sampled_from([1, 3]))
    stride = draw(st.sampled_from([1, 2])) if min(h, w) >= 3 else 1
    act = _branch_act(draw)
    all_bias = draw(st.booleans())  # all members biased (the bias-carry case) or drawn per branch
    for _ in range(n):
        cout = draw(st.sampled_from(CHANNELS))
        bias = True if all_bias else draw(st.booleans())
        y = p.new(
            IMG,
            (1, cout, _conv_out(h, k, stride), _conv_out(w, k, stride)),
            x.depth + 1 + bias + (_ACT_NODES[act] if act else 0),
        )
        p.emit(f"{y.name} = g.conv({x.name}, {cin}, {cout}, k={k}, stride={stride}, bias={bias})")
        if act:
            p.emit(f"{y.name} = {_act_expr(act, y.name)}")
    p.ops.append(f"conv{k}x{k}x{n}-siblings/s{stride}{'+b' if all_bias else ''}{'+' + act if act else ''}")


def _linear_line(y: str, x: str, din: int, dout: int, form: str, bias: bool) -> str:
    if form == "gemm":  # ONNX Gemm(transB=1), the torch nn.Linear export on 2-D inputs
        ins = f"[{x}, g.weight('fc_w', ({dout}, {din}))" + (
            f", g.const('fc_b', {_bias(dout)})]" if bias else "]"
        )
        return f"{y} = g.op('Gemm', {ins}, transB=1)"
    return f"{y} = g.linear({x}, {din}, {dout}, bias={bias})"  # MatMul (+ Add)


def _linear(draw, p: _Program, x: _Tensor):
    din = x.shape[-1]
    dout = draw(st.sampled_from(FEATURES))
    form = draw(st.sampled_from(["matmul", "gemm"])) if x.kind == VEC else "matmul"
    bias = draw(st.booleans())
    y = p.new(x.kind, (*x.shape[:-1], dout), x.depth + 1 + (bias and form == "matmul"))
    p.emit(_linear_line(y.name, x.name, din, dout, form, bias))
    p.ops.append(f"{form}{din}x{dout}{'+b' if bias else ''}")


def _linear_siblings(draw, p: _Program, x: _Tensor):
    """2-3 MatMul/Gemm on one tensor (Q/K/V-like): HorizontalFuse's matmul case."""
    din = x.shape[-1]
    n = draw(st.integers(2, 3))
    form = draw(st.sampled_from(["matmul", "gemm"])) if x.kind == VEC else "matmul"
    act = _branch_act(draw)
    all_bias = draw(st.booleans())
    for _ in range(n):
        dout = draw(st.sampled_from(FEATURES))
        bias = True if all_bias else draw(st.booleans())
        y = p.new(
            x.kind,
            (*x.shape[:-1], dout),
            x.depth + 1 + (bias and form == "matmul") + (_ACT_NODES[act] if act else 0),
        )
        p.emit(_linear_line(y.name, x.name, din, dout, form, bias))
        if act:
            p.emit(f"{y.name} = {_act_expr(act, y.name)}")
    p.ops.append(f"{form}x{n}-siblings{'+b' if all_bias else ''}{'+' + act if act else ''}")


def _batch_norm(draw, p: _Program, x: _Tensor):
    y = p.new(x.kind, x.shape, x.depth + 1)
    p.emit(f"{y.name} = g.batch_norm({x.name}, {x.shape[1]})")
    p.ops.append("batch_norm")
    p.n_bn += 1


def _activation(draw, p: _Program, x: _Tensor):
    act = draw(st.sampled_from(ACTIVATIONS))
    y = p.new(x.kind, x.shape, x.depth + _ACT_NODES[act])
    p.emit(f"{y.name} = {_act_expr(act, x.name)}")
    p.ops.append(act)


def _residual_add(draw, p: _Program, x: _Tensor):
    partners = [t for t in p.pool if t.shape == x.shape]  # always contains x itself
    other = partners[draw(st.integers(0, len(partners) - 1).map(lambda i: len(partners) - 1 - i))]
    y = p.new(x.kind, x.shape, max(x.depth, other.depth) + 1)
    p.emit(f"{y.name} = g.add({x.name}, {other.name})")
    p.use(other)
    p.ops.append("add")


def _max_pool(draw, p: _Program, x: _Tensor):
    _, c, h, w = x.shape
    if min(h, w) >= 2 and draw(st.booleans()):
        k, s, pad = 2, 2, 0
    else:
        k, s, pad = 3, 1, 1
    y = p.new(IMG, (1, c, (h + 2 * pad - k) // s + 1, (w + 2 * pad - k) // s + 1), x.depth + 1)
    p.emit(
        f"{y.name} = g.op('MaxPool', [{x.name}], kernel_shape=[{k}, {k}], strides=[{s}, {s}], pads={[pad] * 4})"
    )
    p.ops.append(f"maxpool{k}/s{s}")


def _global_pool(draw, p: _Program, x: _Tensor):
    y = p.new(VEC, (1, x.shape[1]), x.depth + 2)
    p.emit(f"{y.name} = g.op('Flatten', [g.op('GlobalAveragePool', [{x.name}])], axis=1)")
    p.ops.append("gap+flatten")


def _flatten(draw, p: _Program, x: _Tensor):
    _, c, h, w = x.shape
    y = p.new(VEC, (1, c * h * w), x.depth + 1)
    p.emit(f"{y.name} = g.op('Flatten', [{x.name}], axis=1)")
    p.ops.append("flatten")


def _to_tokens(draw, p: _Program, x: _Tensor):
    """(1, C, H, W) -> (1, H*W, C): the ViT patch-token reshape + transpose."""
    _, c, h, w = x.shape
    y = p.new(SEQ, (1, h * w, c), x.depth + 2)
    p.emit(f"{y.name} = g.transpose(g.reshape({x.name}, [1, {c}, {h * w}]), [0, 2, 1])")
    p.ops.append("to_tokens")


def _swap_hw(draw, p: _Program, x: _Tensor):
    _, c, h, w = x.shape
    y = p.new(IMG, (1, c, w, h), x.depth + 1)
    p.emit(f"{y.name} = g.transpose({x.name}, [0, 1, 3, 2])")
    p.ops.append("transpose_hw")


def _layer_norm(draw, p: _Program, x: _Tensor):
    y = p.new(x.kind, x.shape, x.depth + 1)
    p.emit(f"{y.name} = g.layer_norm({x.name}, {x.shape[-1]})")
    p.ops.append("layer_norm")


def _softmax(draw, p: _Program, x: _Tensor):
    y = p.new(x.kind, x.shape, x.depth + 1)
    p.emit(f"{y.name} = g.op('Softmax', [{x.name}], axis=-1)")
    p.ops.append("softmax")


def _transpose_seq(draw, p: _Program, x: _Tensor):
    b, s, f = x.shape
    y = p.new(SEQ, (b, f, s), x.depth + 1)
    p.emit(f"{y.name} = g.transpose({x.name}, [0, 2, 1])")
    p.ops.append("transpose_seq")


def _reshape(draw, p: _Program, x: _Tensor):
    if x.kind == SEQ:  # (B, S, F) -> (B*S, F)
        b, s, f = x.shape
        y = p.new(VEC, (b * s, f), x.depth + 1)
        p.emit(f"{y.name} = g.reshape({x.name}, [{b * s}, {f}])")
    else:  # (B, F) -> (1, B, F)
        b, f = x.shape
        y = p.new(SEQ, (1, b, f), x.depth + 1)
        p.emit(f"{y.name} = g.reshape({x.name}, [1, {b}, {f}])")
    p.ops.append("reshape")


def _layers_for(x: _Tensor, focus: str | None) -> list:
    if x.kind == IMG:
        _, c, h, w = x.shape
        layers = [_conv, _conv, _conv_siblings, _batch_norm, _activation, _residual_add, _max_pool, _swap_hw]
        if focus != "conv":
            layers += [_global_pool, _to_tokens] + ([_flatten] if c * h * w <= 256 else [])
        return layers
    layers = [_linear, _linear, _linear_siblings, _activation, _residual_add, _layer_norm, _softmax]
    if x.kind == VEC:
        layers.append(_batch_norm)
    if x.kind == SEQ and max(x.shape[1:]) <= 32:
        layers.append(_transpose_seq)
    if (x.kind == SEQ and x.shape[0] * x.shape[1] <= 64) or (x.kind == VEC and x.shape[0] <= 32):
        layers.append(_reshape)
    return layers


def _draw_input_shape(draw, kind: str) -> tuple:
    if kind == IMG:
        return (
            1,
            draw(st.sampled_from([3, 4, 8, 6, 16])),
            draw(st.sampled_from(SPATIAL)),
            draw(st.sampled_from(SPATIAL)),
        )
    if kind == SEQ:
        return (1, draw(st.sampled_from([4, 2, 8])), draw(st.sampled_from(FEATURES)))
    return (draw(st.sampled_from([2, 1, 4])), draw(st.sampled_from(FEATURES)))


@st.composite
def random_models(draw, max_layers: int = 8, focus: str | None = None) -> GraphSpec:
    """Draw a random model. ``focus``: None (anything), ``"conv"`` (image graphs, no flatten/tokens)
    or ``"dense"`` (token / feature graphs)."""
    p = _Program()
    kinds = {"conv": [IMG], "dense": [SEQ, VEC]}.get(focus, [IMG, SEQ, VEC])
    kind = draw(st.sampled_from(kinds))
    shape = _draw_input_shape(draw, kind)
    n_inputs = draw(st.integers(1, 2))
    for i in range(n_inputs):  # a second input has the same shape: residual partner or own branch
        name = f"input{i}"
        p.inputs.append((name, shape))
        p.emit(f"{name} = g.input({name!r}, {shape!r})")
        p.pool.append(_Tensor(name, kind, shape, 0))
    n_layers = draw(st.integers(1, max_layers))
    for _ in range(n_layers):
        # Source counted back from the newest tensor, so shrinking gives straight chains.
        # Half the time the newest tensor (deep chains), else any tensor (fan-out, skips).
        back = draw(st.one_of(st.just(0), st.integers(0, len(p.pool) - 1)))
        x = p.pool[len(p.pool) - 1 - back]
        layer = draw(st.sampled_from(_layers_for(x, focus)))
        layer(draw, p, x)
        p.use(x)
    # Unused extra inputs are dropped; every unconsumed tensor is a model output.
    input_names = {n for n, _ in p.inputs}
    dropped = [n for n in input_names if n not in p.used]
    if dropped:
        p.inputs = [(n, s) for n, s in p.inputs if n not in dropped]
        p.lines = [ln for ln in p.lines if not any(ln.startswith(f"{n} = g.input(") for n in dropped)]
    outputs = [t for t in p.pool if t.name not in p.used and t.name not in input_names]
    return GraphSpec(
        code="\n".join(p.lines) + "\n",
        seed=draw(st.integers(0, 2**16 - 1)),
        inputs=tuple((n, tuple(s)) for n, s in p.inputs),
        outputs=tuple(t.name for t in outputs),
        ops=tuple(p.ops),
        depth=max(t.depth for t in outputs),
        n_bn=p.n_bn,
    )

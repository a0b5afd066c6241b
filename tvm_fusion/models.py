"""Example models built in code with ``onnx.helper`` (no model hub is reachable here).

Every builder returns an ``onnx.ModelProto`` with random but seeded weights, so the same
call gives the same model (and the same model hash, which the tuning records key on).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17


class GraphBuilder:
    """A tiny imperative ONNX graph builder: each method adds nodes and returns the output name."""

    def __init__(self, name: str, seed: int = 0):
        self.name = name
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self._count = 0

    # -- plumbing -------------------------------------------------------------------------
    def fresh(self, hint: str) -> str:
        self._count += 1
        return f"{hint}_{self._count}"

    def const(self, hint: str, array: np.ndarray) -> str:
        name = self.fresh(hint)
        self.initializers.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def weight(self, hint: str, shape, scale: float | None = None) -> str:
        fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else int(shape[0])
        scale = scale if scale is not None else 1.0 / math.sqrt(max(fan_in, 1))
        return self.const(hint, (self.rng.standard_normal(shape) * scale).astype(np.float32))

    def op(self, op_type: str, inputs: list[str], n_out: int = 1, **attrs) -> str | list[str]:
        outs = [self.fresh(op_type.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=outs[0], **attrs))
        return outs[0] if n_out == 1 else outs

    def input(self, name: str, shape, dtype=TensorProto.FLOAT) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, dtype, list(shape)))
        return name

    def finish(self, outputs: list[str]) -> onnx.ModelProto:
        outs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs]
        graph = helper.make_graph(self.nodes, self.name, self.inputs, outs, self.initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
        model.ir_version = 8
        model = onnx.shape_inference.infer_shapes(model)
        onnx.checker.check_model(model)
        return model

    # -- layers ---------------------------------------------------------------------------
    def conv(self, x, cin, cout, k=3, stride=1, groups=1, bias=True) -> str:
        w = self.weight("conv_w", (cout, cin // groups, k, k))
        ins = [x, w] + (
            [self.const("conv_b", self.rng.standard_normal(cout).astype(np.float32) * 0.1)] if bias else []
        )
        pad = k // 2
        return self.op(
            "Conv", ins, kernel_shape=[k, k], strides=[stride, stride], pads=[pad] * 4, group=groups
        )

    def batch_norm(self, x, channels) -> str:
        gamma = self.const("bn_gamma", self.rng.uniform(0.5, 1.5, channels).astype(np.float32))
        beta = self.const("bn_beta", (self.rng.standard_normal(channels) * 0.1).astype(np.float32))
        mean = self.const("bn_mean", (self.rng.standard_normal(channels) * 0.1).astype(np.float32))
        var = self.const("bn_var", self.rng.uniform(0.5, 1.5, channels).astype(np.float32))
        return self.op("BatchNormalization", [x, gamma, beta, mean, var], epsilon=1e-5)

    def relu(self, x) -> str:
        return self.op("Relu", [x])

    def relu6(self, x) -> str:
        lo = self.const("clip_lo", np.array(0.0, np.float32))
        hi = self.const("clip_hi", np.array(6.0, np.float32))
        return self.op("Clip", [x, lo, hi])

    def add(self, a, b) -> str:
        return self.op("Add", [a, b])

    def conv_bn(self, x, cin, cout, k=3, stride=1, groups=1, act: str | None = "relu") -> str:
        y = self.batch_norm(self.conv(x, cin, cout, k, stride, groups), cout)
        if act == "relu":
            y = self.relu(y)
        elif act == "relu6":
            y = self.relu6(y)
        return y

    def linear(self, x, din, dout, bias=True) -> str:
        """MatMul + Add, the form PyTorch's ONNX exporter emits for nn.Linear on 3-D inputs."""
        y = self.op("MatMul", [x, self.weight("fc_w", (din, dout))])
        if bias:
            y = self.add(y, self.const("fc_b", (self.rng.standard_normal(dout) * 0.1).astype(np.float32)))
        return y

    def layer_norm(self, x, dim) -> str:
        gamma = self.const("ln_gamma", self.rng.uniform(0.5, 1.5, dim).astype(np.float32))
        beta = self.const("ln_beta", (self.rng.standard_normal(dim) * 0.1).astype(np.float32))
        return self.op("LayerNormalization", [x, gamma, beta], axis=-1, epsilon=1e-5)

    def gelu(self, x) -> str:
        """Erf-form GELU, as exporters emit it below opset 20."""
        half = self.const("half", np.array(0.5, np.float32))
        one = self.const("one", np.array(1.0, np.float32))
        inv_sqrt2 = self.const("inv_sqrt2", np.array(1.0 / math.sqrt(2.0), np.float32))
        erf = self.op("Erf", [self.op("Mul", [x, inv_sqrt2])])
        return self.op("Mul", [self.op("Mul", [x, half]), self.op("Add", [erf, one])])

    def reshape(self, x, shape) -> str:
        return self.op("Reshape", [x, self.const("shape", np.array(shape, np.int64))])

    def transpose(self, x, perm) -> str:
        return self.op("Transpose", [x], perm=list(perm))


# -- model builders ---------------------------------------------------------------------------
def resnet_block_net(batch=1, size=32, width=16, num_classes=10, seed=0) -> onnx.ModelProto:
    """A small ResNet-style convnet: stem, two basic blocks (one downsampling), pool, classifier."""
    g = GraphBuilder("resnet_block_net", seed)
    x = g.input("input", (batch, 3, size, size))
    h = g.conv_bn(x, 3, width)
    h = _basic_block(g, h, width, width, stride=1)
    h = _basic_block(g, h, width, 2 * width, stride=2)
    h = g.op("GlobalAveragePool", [h])
    h = g.op("Flatten", [h], axis=1)
    w = g.weight("fc_w", (num_classes, 2 * width))
    b = g.const("fc_b", np.zeros(num_classes, np.float32))
    y = g.op("Gemm", [h, w, b], transB=1)
    return g.finish([y])


def _basic_block(g: GraphBuilder, x, cin, cout, stride) -> str:
    h = g.conv_bn(x, cin, cout, 3, stride)
    h = g.conv_bn(h, cout, cout, 3, 1, act=None)
    shortcut = x if (stride == 1 and cin == cout) else g.conv_bn(x, cin, cout, 1, stride, act=None)
    return g.relu(g.add(h, shortcut))


def resnet18(batch=1, size=224, num_classes=1000, seed=0) -> onnx.ModelProto:
    """ResNet-18 topology (random weights): 7x7 stem, max-pool, 4 stages x 2 basic blocks."""
    g = GraphBuilder("resnet18", seed)
    x = g.input("input", (batch, 3, size, size))
    h = g.conv_bn(x, 3, 64, k=7, stride=2)
    h = g.op("MaxPool", [h], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    cin = 64
    for stage, cout in enumerate([64, 128, 256, 512]):
        for block in range(2):
            stride = 2 if (stage > 0 and block == 0) else 1
            h = _basic_block(g, h, cin, cout, stride)
            cin = cout
    h = g.op("Flatten", [g.op("GlobalAveragePool", [h])], axis=1)
    y = g.op(
        "Gemm",
        [h, g.weight("fc_w", (num_classes, 512)), g.const("fc_b", np.zeros(num_classes, np.float32))],
        transB=1,
    )
    return g.finish([y])


def mobilenet_block(batch=1, size=56, channels=24, expand=6, seed=0) -> onnx.ModelProto:
    """A MobileNet-V2 inverted-residual block: 1x1 expand, 3x3 depthwise, 1x1 project, residual."""
    g = GraphBuilder("mobilenet_block", seed)
    x = g.input("input", (batch, channels, size, size))
    hidden = channels * expand
    h = g.conv_bn(x, channels, hidden, k=1, act="relu6")
    h = g.conv_bn(h, hidden, hidden, k=3, groups=hidden, act="relu6")
    h = g.conv_bn(h, hidden, channels, k=1, act=None)
    return g.finish([g.add(h, x)])


def se_block(batch=1, size=112, channels=32, reduced=8, seed=0) -> onnx.ModelProto:
    """A squeeze-excitation block (EfficientNet, RegNet-Y, MobileNet-V3): global average pool,
    1x1 conv down, relu, 1x1 conv up, sigmoid, and the channel scale broadcast over C x H x W."""
    g = GraphBuilder("se_block", seed)
    x = g.input("input", (batch, channels, size, size))
    s = g.relu(g.conv(g.op("GlobalAveragePool", [x]), channels, reduced, k=1))
    s = g.op("Sigmoid", [g.conv(s, reduced, channels, k=1)])
    return g.finish([g.op("Mul", [x, s])])


def transformer_block(batch=1, seq=16, hidden=64, heads=4, ffn=None, seed=0) -> onnx.ModelProto:
    """A pre-norm transformer encoder layer in the shape exporters emit (MatMul+Add linears)."""
    ffn = ffn or 4 * hidden
    head_dim = hidden // heads
    g = GraphBuilder("transformer_block", seed)
    x = g.input("input", (batch, seq, hidden))
    h = g.layer_norm(x, hidden)

    def heads_first(t):  # (B, S, H) -> (B, heads, S, head_dim)
        return g.transpose(g.reshape(t, [batch, seq, heads, head_dim]), [0, 2, 1, 3])

    q = heads_first(g.linear(h, hidden, hidden))
    k = heads_first(g.linear(h, hidden, hidden))
    v = heads_first(g.linear(h, hidden, hidden))
    scores = g.op("MatMul", [q, g.transpose(k, [0, 1, 3, 2])])
    scores = g.op("Mul", [scores, g.const("scale", np.array(1.0 / math.sqrt(head_dim), np.float32))])
    attn = g.op("Softmax", [scores], axis=-1)
    ctx = g.op("MatMul", [attn, v])
    ctx = g.reshape(g.transpose(ctx, [0, 2, 1, 3]), [batch, seq, hidden])
    x = g.add(x, g.linear(ctx, hidden, hidden))
    h = g.layer_norm(x, hidden)
    h = g.linear(g.gelu(g.linear(h, hidden, ffn)), ffn, hidden)
    return g.finish([g.add(x, h)])


def bert_layer(seq=128, seed=0) -> onnx.ModelProto:
    """A BERT-base-shaped encoder layer: hidden 768, 12 heads, FFN 3072."""
    return transformer_block(batch=1, seq=seq, hidden=768, heads=12, ffn=3072, seed=seed)


FLOAT32_MIN = float(np.finfo(np.float32).min)
ATTENTION_SPELLINGS = ("torchscript", "dynamo", "gpt2", "gpt2_dynamo", "vit")


def attention_layer(
    spelling="torchscript", batch=1, seq=128, hidden=768, heads=12, ffn=None, seed=0, softmax_axis=-1
) -> onnx.ModelProto:
    """A transformer layer whose attention is spelled as a torch exporter writes it.

    ``spelling``: ``"torchscript"`` (HF eager BERT: ``/ sqrt(d)``, additive extended mask
    ``(1 - mask) * finfo.min`` from Unsqueeze/Cast/Sub/Mul), ``"dynamo"`` (the SDPA
    decomposition: ``q`` and ``k^T`` each times ``sqrt(1/sqrt(d))``, ``k^T`` through a 3-D
    reshape, ``Where(And(C, mask), 0, finfo.min)`` added, ``Where(IsNaN(p), 0, p)``),
    ``"gpt2"`` (eager GPT-2, pre-norm: one QKV MatMul + Split, ``Where(causal, s, finfo.min)``
    then the padding mask added), ``"gpt2_dynamo"`` (SDPA with a causal ``C``), ``"vit"`` (no
    mask: fused QKV reshaped to (B, S, 3, N, d), ``q`` pre-scaled). Masked spellings take an
    int64 ``attention_mask`` (batch, seq) input after ``input``.
    """
    if spelling not in ATTENTION_SPELLINGS:
        raise ValueError(f"unknown attention spelling {spelling!r}; choose one of {ATTENTION_SPELLINGS}")
    ffn = ffn or 4 * hidden
    d = hidden // heads
    g = GraphBuilder(f"attention_{spelling}", seed)
    x = g.input("input", (batch, seq, hidden))
    masked = spelling != "vit"
    mask = g.input("attention_mask", (batch, seq), TensorProto.INT64) if masked else None
    pre_norm = spelling.startswith("gpt2") or spelling == "vit"
    h = g.layer_norm(x, hidden) if pre_norm else x

    def heads_first(t, perm=(0, 2, 1, 3)):
        return g.transpose(g.reshape(t, [batch, seq, heads, d]), perm)

    if spelling == "vit":
        qkv = g.reshape(g.linear(h, hidden, 3 * hidden), [batch, seq, 3, heads, d])
        qkv = g.transpose(qkv, [2, 0, 3, 1, 4])
        q, k, v = (g.op("Gather", [qkv, g.const("idx", np.array(i, np.int64))], axis=0) for i in range(3))
        q = g.op("Mul", [q, g.const("scale", np.array(d**-0.5, np.float32))])
        k_t = g.transpose(k, [0, 1, 3, 2])
    elif spelling.startswith("gpt2"):
        qkv = g.linear(h, hidden, 3 * hidden)
        q, k, v = g.op("Split", [qkv, g.const("split", np.array([hidden] * 3, np.int64))], n_out=3, axis=2)
        q, v = heads_first(q), heads_first(v)
        k_t = heads_first(k, (0, 2, 3, 1))
    else:
        q, v = heads_first(g.linear(h, hidden, hidden)), None
        k = g.linear(h, hidden, hidden)
        v = heads_first(g.linear(h, hidden, hidden))
        k_t = heads_first(k, (0, 2, 3, 1)) if spelling == "torchscript" else None
        if spelling == "dynamo":  # k^T through the decomposition's (B*N, S, d) detour
            k3 = g.reshape(heads_first(k), [batch * heads, seq, d])
            k_t = g.reshape(g.transpose(k3, [0, 2, 1]), [batch, heads, d, seq])
    sdpa = spelling in ("dynamo", "gpt2_dynamo")
    if sdpa:
        root = g.const("sqrt_scale", np.array(math.sqrt(1.0 / math.sqrt(d)), np.float32))
        q, k_t = g.op("Mul", [q, root]), g.op("Mul", [k_t, root])
    scores = g.op("MatMul", [q, k_t])
    if spelling in ("torchscript", "gpt2"):
        scores = g.op("Div", [scores, g.const("sqrt_d", np.array(math.sqrt(d), np.float32))])
    causal = np.tril(np.ones((seq, seq), bool)).reshape(1, 1, seq, seq)
    if spelling == "gpt2":
        scores = g.op(
            "Where", [g.const("causal", causal), scores, g.const("min", np.array(FLOAT32_MIN, np.float32))]
        )
    if spelling in ("torchscript", "gpt2"):  # HF's extended attention mask
        m = g.op("Unsqueeze", [mask, g.const("ax", np.array([1], np.int64))])
        m = g.op("Unsqueeze", [m, g.const("ax", np.array([2], np.int64))])
        m = g.op("Cast", [m], to=TensorProto.FLOAT)
        m = g.op("Sub", [g.const("one", np.array(1.0, np.float32)), m])
        scores = g.op("Add", [scores, g.op("Mul", [m, g.const("min", np.array(FLOAT32_MIN, np.float32))])])
    if sdpa:
        m = g.reshape(g.op("Cast", [mask], to=TensorProto.BOOL), [batch, 1, 1, seq])
        base = causal if spelling == "gpt2_dynamo" else np.ones((1, 1, seq, 1), bool)
        m = g.op("And", [g.const("base", base), m])
        bias = g.op(
            "Where",
            [
                m,
                g.const("zero", np.array(0.0, np.float32)),
                g.const("min", np.array(FLOAT32_MIN, np.float32)),
            ],
        )
        scores = g.op("Add", [scores, bias])
    probs = g.op("Softmax", [scores], axis=softmax_axis)
    if sdpa:
        probs = g.op("Where", [g.op("IsNaN", [probs]), g.const("zero", np.array(0.0, np.float32)), probs])
    ctx = g.reshape(g.transpose(g.op("MatMul", [probs, v]), [0, 2, 1, 3]), [batch, seq, hidden])
    x = g.add(x, g.linear(ctx, hidden, hidden))
    if not pre_norm:
        x = g.layer_norm(x, hidden)
    h = g.layer_norm(x, hidden) if pre_norm else x
    h = g.linear(g.gelu(g.linear(h, hidden, ffn)), ffn, hidden)
    out = g.add(x, h)
    return g.finish([out if pre_norm else g.layer_norm(out, hidden)])


def bert_layer_masked(seq=128, seed=0) -> onnx.ModelProto:
    """A BERT-base layer with HF's padding mask, attention as the TorchScript exporter spells it."""
    return attention_layer("torchscript", seq=seq, seed=seed)


def gpt2_block(seq=128, seed=0) -> onnx.ModelProto:
    """A GPT-2 (small) block: pre-norm, causal attention (where + padding mask), hidden 768."""
    return attention_layer("gpt2", seq=seq, seed=seed)


def mlp_bn(batch=8, din=32, hidden=64, dout=10, seed=0) -> onnx.ModelProto:
    """An MLP whose hidden layer is Gemm -> BatchNorm(features) -> Relu (BN after a dense)."""
    g = GraphBuilder("mlp_bn", seed)
    x = g.input("input", (batch, din))
    h = g.op(
        "Gemm", [x, g.weight("fc_w", (hidden, din)), g.const("fc_b", np.zeros(hidden, np.float32))], transB=1
    )
    h = g.relu(g.batch_norm(h, hidden))
    y = g.op(
        "Gemm", [h, g.weight("fc_w", (dout, hidden)), g.const("fc_b", np.zeros(dout, np.float32))], transB=1
    )
    return g.finish([y])


EXAMPLES: dict[str, Callable[[], onnx.ModelProto]] = {
    "resnet_block_net": resnet_block_net,
    "transformer_block": transformer_block,
    "mlp_bn": mlp_bn,
    "mobilenet_block": mobilenet_block,
    "se_block": se_block,
    "resnet18": resnet18,
    "bert_layer": bert_layer,
    "bert_layer_masked": bert_layer_masked,
    "gpt2_block": gpt2_block,
}


def example(name: str) -> onnx.ModelProto:
    """Build a named example model (see ``EXAMPLES``)."""
    try:
        return EXAMPLES[name]()
    except KeyError:
        raise KeyError(f"unknown example model {name!r}; choose one of {sorted(EXAMPLES)}") from None


def random_inputs(model: onnx.ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    """Random inputs matching the model's (static) input shapes: float32 normal values; for
    integer inputs an all-ones mask (names with "mask") or token ids in [0, 1000)."""
    rng = np.random.default_rng(seed)
    inits = {i.name for i in model.graph.initializer}
    feeds = {}
    for inp in model.graph.input:
        if inp.name in inits:
            continue
        shape = [d.dim_value if d.dim_value > 0 else 1 for d in inp.type.tensor_type.shape.dim]
        elem = inp.type.tensor_type.elem_type
        if elem in (TensorProto.INT64, TensorProto.INT32):
            dtype = np.int64 if elem == TensorProto.INT64 else np.int32
            ones = "mask" in inp.name.lower()
            feeds[inp.name] = np.ones(shape, dtype) if ones else rng.integers(0, 1000, shape).astype(dtype)
        else:
            feeds[inp.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds

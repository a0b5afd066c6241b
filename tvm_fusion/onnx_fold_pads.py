"""ONNX-level preparation before import: a zero ``Pad`` of the spatial axes feeding only ``Conv`` s
becomes those convs' own padding.

TensorFlow-style "same" padding (Hugging Face ``MobileNetV2Model``, ``tf_padding=True``) is exported
by the TorchScript exporter as a ``Pad`` before every strided conv (the dynamo exporter folds it).
The Relax frontend imports ``Pad`` as an opaque TE kernel (``topi.nn.pad``): one more kernel and one
more copy of the activation per conv, and on CUDA a pair of NCHW<->NHWC layout transforms around
each (HF MobileNetV2: 106 kernels and 35 transforms against 53 and 1 from the dynamo export). A zero
pad of H and W followed by a conv is that conv with more padding, which every conv lowering takes.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .onnx_prepare import default_opset

__all__ = ["fold_pads_into_convs"]


def fold_pads_into_convs(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with each foldable ``Pad`` merged into the ``Conv`` s it feeds (``model`` itself is
    not changed; returned as is when there is none)."""
    graph = model.graph
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    keep = {o.name for o in graph.output} | _read_in_subgraphs(graph)
    constants = {i.name: i for i in graph.initializer}
    opset = default_opset(model)
    folds = {}  # Pad output -> (its input, spatial pads [begin..., end...])
    for node in graph.node:
        if node.op_type != "Pad" or node.domain not in ("", "ai.onnx") or node.output[0] in keep:
            continue
        users = consumers.get(node.output[0], [])
        if not users or any(u.op_type != "Conv" for u in users):
            continue
        pads = _spatial_zero_pads(node, constants, opset)
        if pads is not None and all(
            _takes_padding(u, node.output[0], len(pads) // 2, constants) for u in users
        ):
            folds[node.output[0]] = (node.input[0], pads)
    if not folds:
        return model
    prepared = onnx.ModelProto()
    prepared.CopyFrom(model)
    kept = []
    for node in prepared.graph.node:
        if node.op_type == "Pad" and node.output[0] in folds:
            continue
        if node.op_type == "Conv" and node.input[0] in folds:
            source, extra = folds[node.input[0]]
            node.input[0] = source
            attrs = {a.name: a for a in node.attribute}
            old = list(attrs["pads"].ints) if "pads" in attrs else [0] * len(extra)
            merged = [int(a + b) for a, b in zip(old, extra)]
            kept_attrs = [a for a in node.attribute if a.name not in ("pads", "auto_pad")]
            del node.attribute[:]
            node.attribute.extend([*kept_attrs, helper.make_attribute("pads", merged)])
        kept.append(node)
    del prepared.graph.node[:]
    prepared.graph.node.extend(kept)
    kept_info = [v for v in prepared.graph.value_info if v.name not in folds]
    del prepared.graph.value_info[:]
    prepared.graph.value_info.extend(kept_info)
    return prepared


def _read_in_subgraphs(graph: onnx.GraphProto) -> set[str]:
    """Every name a node's subgraph (If / Loop / Scan bodies) reads, at any depth."""
    names: set[str] = set()
    for node in graph.node:
        for attr in node.attribute:
            for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
                names |= {i for n in sub.node for i in n.input} | _read_in_subgraphs(sub)
    return names


def _spatial_zero_pads(pad: onnx.NodeProto, constants, opset: int) -> list[int] | None:
    """The ``[begin..., end...]`` pads of the spatial axes (2 onwards) of a constant-mode zero
    ``Pad`` that leaves N and C alone, or None."""
    attrs = {a.name: helper.get_attribute_value(a) for a in pad.attribute}
    if attrs.get("mode", b"constant") not in (b"constant", "constant"):
        return None
    if opset < 11:
        pads, value = list(attrs.get("pads", [])), float(attrs.get("value", 0.0))
    else:
        inputs = list(pad.input) + [""] * (4 - len(pad.input))
        if inputs[1] not in constants or (inputs[2] and inputs[2] not in constants):
            return None
        pads = [int(p) for p in numpy_helper.to_array(constants[inputs[1]]).ravel()]
        value = numpy_helper.to_array(constants[inputs[2]]) if inputs[2] else np.zeros(1)
        if value.size != 1 or value.dtype.kind not in "fiu":
            return None
        value = float(value.ravel()[0])
        if inputs[3]:  # opset 18 axes: only the full, in-order form
            if inputs[3] not in constants:
                return None
            axes = [int(a) for a in numpy_helper.to_array(constants[inputs[3]]).ravel()]
            if axes != list(range(len(pads) // 2)):
                return None
    rank = len(pads) // 2
    if value != 0.0 or rank < 3 or len(pads) != 2 * rank or min(pads) < 0:
        return None
    begin, end = pads[:rank], pads[rank:]
    if any(begin[:2]) or any(end[:2]):
        return None
    return begin[2:] + end[2:]


def _takes_padding(node: onnx.NodeProto, name: str, spatial: int, constants) -> bool:
    """Whether ``node`` is a Conv over ``spatial`` axes reading ``name`` as its data only, with
    explicit padding."""
    if node.op_type != "Conv" or node.domain not in ("", "ai.onnx") or list(node.input).count(name) != 1:
        return False
    if node.input[0] != name:
        return False
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
        return False
    weight = constants.get(node.input[1])
    rank = len(weight.dims) - 2 if weight is not None else len(attrs.get("kernel_shape", []))
    pads = attrs.get("pads")
    return rank == spatial and (pads is None or len(pads) == 2 * spatial)

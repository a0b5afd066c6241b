"""ONNX-level preparation before import: fold the static shape arithmetic exporters write.

The TorchScript exporter spells shapes it knows at export time as run-time arithmetic: ``torch.chunk``
becomes ``Slice`` with ends from ``Shape``->``Gather``->``Add``->``Div``->``Mul``, and Hugging Face
attention-mask code becomes ``ConstantOfShape``/``Expand``/``Where``/``And`` chains over constants.
The Relax frontend imports such chains as shape computations of unknown result (``dynamic_strided_slice``
of unknown shape, ``broadcast_to`` of a shape it mis-derives), which later passes cannot handle.

``prepare_onnx`` evaluates them ahead of import, with ONNX's own machinery: ``onnx.shape_inference``
gives every intermediate's static shape (so a ``Shape`` of it is a constant), and the ONNX reference
evaluator computes each node whose inputs are all small constants. Folded values become initializers;
nodes reading weights are left alone (the Relax ``FoldConstant`` pass handles weight arithmetic), so
the model never grows by a copy of its weights. A model with nothing to fold is returned unchanged.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper, shape_inference
from onnx.reference import ReferenceEvaluator

# Values up to this many elements are folded (shape vectors, masks, position ids); larger constants
# are weights, left for the frontend and FoldConstant.
FOLD_LIMIT = 1 << 16
# A node whose inputs are all small may give a larger value: a relative-position table gathered
# over every query/key pair (BEiT: 38809 x 6). Relax's FoldConstant would fold it anyway, with one
# LLVM build per op of the chain (76 index checks alone: 20 s of BEiT's 21 s build); here it is
# numpy. Up to 4M elements (16 MB of float32).
FOLD_OUTPUT_LIMIT = 1 << 22
# Fold rounds: a folded Reshape target gives a static shape to the next round's shape inference.
MAX_ROUNDS = 8
# Ops whose value is not a function of their inputs, or that hold subgraphs: never evaluated.
_NOT_FOLDABLE = {
    "RandomNormal",
    "RandomNormalLike",
    "RandomUniform",
    "RandomUniformLike",
    "Multinomial",
    "Bernoulli",
    "Dropout",
    "If",
    "Loop",
    "Scan",
    "SequenceMap",
}


def prepare_onnx(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with its static shape subgraphs folded into initializers (``model`` itself is not changed)."""
    opset = default_opset(model)
    graph = model.graph
    outputs = {o.name for o in graph.output}
    big = {i.name for i in graph.initializer if _numel(i.dims) > FOLD_LIMIT}
    known = {i.name: numpy_helper.to_array(i) for i in graph.initializer if i.name not in big}
    nodes = list(graph.node)
    folded: dict[str, np.ndarray] = {}
    for _ in range(MAX_ROUNDS):
        shapes = _inferred_shapes(model, nodes, known, big)
        partial: dict[str, list] = {}  # Shape outputs with some symbolic dims (None)
        remaining = []
        for node in nodes:
            values = _fold(node, known, shapes, partial, opset) if not set(node.output) & outputs else None
            if values is None:
                remaining.append(node)
                continue
            for name, value in zip(node.output, values):
                known[name] = folded[name] = value
        if len(remaining) == len(nodes):
            break
        nodes = remaining
    if not folded:
        return model
    used = {i for n in nodes for i in n.input} | outputs
    prepared = onnx.ModelProto()
    prepared.CopyFrom(model)
    del prepared.graph.node[:]
    prepared.graph.node.extend(nodes)
    prepared.graph.initializer.extend(
        numpy_helper.from_array(np.asarray(v), name) for name, v in folded.items() if name in used
    )
    folded_names = set(folded)
    kept_info = [v for v in prepared.graph.value_info if v.name not in folded_names]
    del prepared.graph.value_info[:]
    prepared.graph.value_info.extend(kept_info)
    return prepared


def _fold(node, known, shapes, partial, opset) -> list[np.ndarray] | None:
    """The node's output values if they are static and small, else None.

    ``Shape`` of a tensor with symbolic dims records its partly known value in ``partial``, so
    that a ``Gather`` of static dims from it (a dynamic-batch model asking for its channels) folds.
    """
    if node.domain not in ("", "ai.onnx") or node.op_type in _NOT_FOLDABLE:
        return None
    if node.op_type in ("Shape", "Size") and node.input[0] not in known:
        shape = shapes.get(node.input[0])
        if shape is None:
            return None
        if node.op_type == "Shape":
            attrs = {a.name: a.i for a in node.attribute}
            shape = shape[attrs.get("start", 0) : attrs["end"] if "end" in attrs else len(shape)]
        if None in shape:
            if node.op_type == "Shape":
                partial[node.output[0]] = list(shape)
            return None
        return [np.array(_numel(shape) if node.op_type == "Size" else shape, np.int64)]
    if node.op_type == "Gather" and node.input[0] in partial and node.input[1] in known:
        picked = np.take(np.array(partial[node.input[0]], dtype=object), known[node.input[1]])
        if any(d is None for d in np.ravel(picked)):
            return None
        return [np.asarray(picked, dtype=np.int64)]
    if not all(i == "" or i in known for i in node.input):
        return None
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
        return None
    feeds = {i: known[i] for i in node.input if i}
    try:
        values = ReferenceEvaluator(node, opsets={"": opset}).run(None, feeds)
    except Exception:  # an op the reference evaluator lacks: leave it to the frontend
        return None
    values = [np.asarray(v) for v in values]
    if any(v.size > FOLD_OUTPUT_LIMIT or v.dtype == object for v in values):
        return None
    return values


def _inferred_shapes(model, nodes, known, big) -> dict[str, tuple]:
    """Shapes of every value (ints, None where symbolic), from ONNX shape inference on a copy
    without the weights' data."""
    graph = model.graph
    read = {i for n in nodes for i in n.input}
    declared = {v.name for v in graph.input}  # old exporters list initializers as inputs too
    sketch = helper.make_graph(
        nodes,
        graph.name,
        list(graph.input)
        + [
            helper.make_tensor_value_info(i.name, i.data_type, list(i.dims))
            for i in graph.initializer
            if i.name in big and i.name not in declared
        ],
        list(graph.output),
        initializer=[
            numpy_helper.from_array(np.asarray(v), name) for name, v in known.items() if name in read
        ],
        value_info=list(graph.value_info),
    )
    sketch_model = helper.make_model(
        sketch, opset_imports=list(model.opset_import), ir_version=max(model.ir_version, 4)
    )
    try:
        inferred = shape_inference.infer_shapes(sketch_model, strict_mode=False, data_prop=True)
    except Exception:  # inconsistent exporter annotations: fold what the constants alone give
        inferred = sketch_model
    shapes = {}
    for value in list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output):
        ttype = value.type.tensor_type
        if not ttype.HasField("shape"):
            continue
        shapes[value.name] = tuple(d.dim_value if d.HasField("dim_value") else None for d in ttype.shape.dim)
    for init in graph.initializer:
        shapes[init.name] = tuple(init.dims)
    return shapes


def _numel(dims) -> int:
    return int(np.prod(list(dims), dtype=np.int64)) if len(dims) else 1


def default_opset(model: onnx.ModelProto, missing: int | None = 1) -> int | None:
    """The version of the default ONNX domain the model imports (``missing`` if it declares none)."""
    for entry in model.opset_import:
        if entry.domain in ("", "ai.onnx"):
            return entry.version
    return missing

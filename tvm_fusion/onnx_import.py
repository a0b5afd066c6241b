"""The Relax ONNX importer with corrected converters, and failures that name the ONNX node.

``tvm.relax.frontend.onnx.from_onnx`` looks converters up in a fixed table and, when one raises,
prints the op and re-raises the bare TVM error, which does not say which node failed. This importer
is the frontend's ``ONNXGraphImporter`` with two changes: converters in ``CONVERTERS`` take
precedence over the frontend's, and a converter's failure becomes an ``ImportNodeError`` naming the
node, its op and its outputs.
"""

from __future__ import annotations

import contextlib
import io

import numpy as np
import onnx
import tvm
from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend as frontend

from .errors import UnsupportedOpError, last_line
from .onnx_col2im import Col2Im
from .onnx_dft import DFT, STFT
from .onnx_prepare import default_opset
from .onnx_rnn import GRU, LSTM


class ImportNodeError(UnsupportedOpError):
    """A converter of the Relax ONNX frontend failed on one node."""


class ConstantOfShape(frontend.OnnxOpConverter):
    """``ConstantOfShape`` whose fill value is a scalar.

    The ``value`` attribute is a one-element tensor of shape [1]; the frontend broadcasts it as is,
    so an empty shape input (a scalar result, as in Hugging Face attention-mask code exported by
    TorchScript) asks ``broadcast_to`` to shrink rank 1 to rank 0, which fails.
    """

    @classmethod
    def _impl_v9(cls, bb, inputs, attr, params):
        fill = attr.get("value")
        value = frontend.get_numpy(fill).reshape(()) if fill is not None else np.zeros((), np.float32)
        shape = frontend.get_constant(inputs[0], params)
        if isinstance(shape, tvm.ir.GenericConst):
            return relax.const(np.full(tuple(int(d) for d in shape.value.numpy()), value), str(value.dtype))
        if isinstance(shape, relax.ShapeExpr) and all(isinstance(d, tvm.tirx.IntImm) for d in shape.values):
            return relax.const(np.full(tuple(int(d) for d in shape.values), value), str(value.dtype))
        if not isinstance(shape, relax.ShapeExpr):
            shape = relax.op.tensor_to_shape(shape)
        return relax.op.broadcast_to(relax.const(value, str(value.dtype)), shape)


class Gather(frontend.OnnxOpConverter):
    """``Gather`` whose constant indices are resolved at import.

    The frontend wraps every index in a run-time fix-up for negative values,
    ``where(index < 0, index + shape_to_tensor(shape_of(data))[axis], index)``, even a constant
    index into a static axis. Each such chain is left to ``FoldConstant``, which builds one LLVM
    module per call: Mamba's 4,098 constant-index Gathers made its first ``FoldConstant`` take
    253 s of a 259 s build. Here a constant index into a static axis is made non-negative with
    numpy; anything else goes to the frontend's converter.
    """

    @classmethod
    def _impl_v1(cls, bb, inputs, attr, params):
        data, indices = inputs
        extent = _static_extent(data, attr.get("axis", 0))
        if not isinstance(indices, tvm.ir.GenericConst) or extent is None:
            return frontend.Gather._impl_v13(bb, inputs, attr, params)
        index = indices.value.numpy()
        outside = index[(index < -extent) | (index >= extent)]
        if outside.size:
            raise ValueError(f"index {outside.flat[0]} out of range for an axis of {extent}")
        index = np.where(index < 0, index + extent, index).astype(index.dtype)
        return relax.op.take(data, relax.const(index, str(index.dtype)), attr.get("axis", 0))


def _static_extent(data, axis: int) -> int | None:
    """``data.shape[axis]`` when ``data`` is a tensor whose shape there is a known constant."""
    ty = getattr(data, "ty", None)
    if isinstance(data, tvm.ir.GenericConst) or not isinstance(ty, relax.TensorType):
        return None  # a constant: the frontend gathers it with numpy
    if not isinstance(ty.shape, relax.ShapeExpr):
        return None
    dims = ty.shape.values
    dim = dims[axis] if -len(dims) <= axis < len(dims) else None
    return int(dim) if isinstance(dim, tvm.tirx.IntImm) else None


CONVERTERS: dict[str, type[frontend.OnnxOpConverter]] = {
    "Col2Im": Col2Im,
    "ConstantOfShape": ConstantOfShape,
    "DFT": DFT,
    "GRU": GRU,
    "Gather": Gather,
    "LSTM": LSTM,
    "STFT": STFT,
}


def supported_ops() -> set[str]:
    """The ONNX ops (default domain) this importer converts: the frontend's and ours."""
    return set(frontend._get_convert_map()) | set(CONVERTERS) | {"Constant", "If"}


class _Importer(frontend.ONNXGraphImporter):
    def __init__(self, **kwargs):
        super().__init__(None, "float32", **kwargs)
        self._node: onnx.NodeProto | None = None

    def _parse_value_proto(self, value_proto):
        # The frontend calls this with each node right before converting it: remember the node, so an
        # error names it by its outputs even when it has no name (unnamed nodes are common).
        if isinstance(value_proto, onnx.NodeProto):
            self._node = value_proto
        return super()._parse_value_proto(value_proto)

    def _check_for_unsupported_ops(self, graph):
        # the frontend's check knows only its own table; ``frontend.check_model`` names the node
        unsupported = sorted({node.op_type for node in graph.node} - supported_ops())
        if unsupported:
            raise tvm.error.OpNotImplemented(f"ONNX operators not supported: {', '.join(unsupported)}")

    def _convert_operator(self, op_name, inputs, attrs, opset):
        converter = CONVERTERS.get(op_name)
        try:
            if converter is None:
                return super()._convert_operator(op_name, inputs, attrs, opset)
            sym = converter.get_converter(opset)(self.bb, inputs, attrs, [self._nodes, self._params])
            return self.bb.normalize(sym) if isinstance(sym, relax.Expr) else sym
        except ImportNodeError:
            raise
        except Exception as err:
            name = attrs.get("tvm_custom", {}).get("name", "")
            node = self._node  # not the node converted when it fails inside an If's branch
            if node is None or (node.op_type, node.name) != (op_name, name):
                node = None
            outputs = f", outputs {list(node.output)}" if node is not None else ""
            raise ImportNodeError(
                f"node {name or '<unnamed>'!r} ({op_name}{outputs}): {last_line(err)}"
            ) from None


def from_onnx(model: onnx.ModelProto) -> tvm.IRModule:
    """``tvm.relax.frontend.onnx.from_onnx(model, keep_params_in_input=False)``, with our converters."""
    opset = default_opset(model)
    importer = _Importer(keep_params_in_input=False)
    # the frontend prints every failing node's inputs (whole constant arrays) before re-raising
    with contextlib.redirect_stdout(io.StringIO()):
        return importer.from_onnx(model.graph, opset)

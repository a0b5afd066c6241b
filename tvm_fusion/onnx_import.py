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
from .onnx_prepare import default_opset


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


CONVERTERS: dict[str, type[frontend.OnnxOpConverter]] = {"ConstantOfShape": ConstantOfShape}


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

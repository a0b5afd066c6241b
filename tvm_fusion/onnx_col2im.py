"""ONNX ``Col2Im`` (``torch.nn.functional.fold``), which the Relax ONNX frontend lacks.

Col2Im sums each column of ``[N, C·kh·kw, L]`` patches back into an ``[N, C, H, W]`` image. Patches
that tile the image without overlap (stride = block, no padding or dilation: MobileViTV2's
unfolded patches) are a pure re-layout: a reshape and a transpose. In general it is a transposed
convolution with one group per channel and one-hot kernels (patch entry ``k`` lands at kernel
offset ``k``), which TVM lowers like any ``conv2d_transpose``. 2-D images only.
"""

from __future__ import annotations

import numpy as np
from tvm import relax
from tvm.relax.frontend.onnx import onnx_frontend as frontend

from .ir import shape_dims
from .onnx_inputs import constant_input


class Col2Im(frontend.OnnxOpConverter):
    """``Col2Im`` (opset 18) over a 2-D image with constant ``image_shape`` and ``block_shape``."""

    @classmethod
    def _impl_v18(cls, bb, inputs, attr, params):
        data = inputs[0]
        image = [int(v) for v in constant_input(inputs[1], params, "image_shape").reshape(-1)]
        block = [int(v) for v in constant_input(inputs[2], params, "block_shape").reshape(-1)]
        if len(image) != 2 or len(block) != 2:
            raise ValueError(f"Col2Im: only 2-D images are supported (image_shape {image})")
        dilations = list(attr.get("dilations", (1, 1)))
        pads = list(attr.get("pads", (0, 0, 0, 0)))
        strides = list(attr.get("strides", (1, 1)))
        ty, dims = data.ty, shape_dims(data)
        if dims is None or len(dims) != 3 or None in dims[1:]:
            raise ValueError("Col2Im: the channel and patch counts must be static")
        batch, (rows, patches) = ty.shape.values[0], dims[1:]
        kernel = block[0] * block[1]
        grid = [
            (image[i] + pads[i] + pads[i + 2] - dilations[i] * (block[i] - 1) - 1) // strides[i] + 1
            for i in range(2)
        ]
        if rows % kernel or min(grid) < 1 or grid[0] * grid[1] != patches:
            raise ValueError(
                f"Col2Im: input [N, {rows}, {patches}] does not hold {block[0]}x{block[1]} patches "
                f"of a {image[0]}x{image[1]} image ({grid[0]}x{grid[1]} of them)"
            )
        channels = rows // kernel
        if (
            strides == block
            and dilations == [1, 1]
            and not any(pads)
            and image == [g * b for g, b in zip(grid, block)]
        ):
            tiles = relax.op.reshape(data, [batch, channels, block[0], block[1], grid[0], grid[1]])
            placed = relax.op.permute_dims(tiles, [0, 1, 4, 2, 5, 3])  # [N, C, gh, kh, gw, kw]
            return relax.op.reshape(placed, [batch, channels, image[0], image[1]])
        dtype = str(ty.dtype)
        one_hot = np.tile(np.eye(kernel).reshape(kernel, 1, block[0], block[1]), (channels, 1, 1, 1))
        weights = relax.const(one_hot.astype("float32"))  # numpy has no bfloat16: cast in Relax
        weights = weights if dtype == "float32" else relax.op.astype(weights, dtype)
        spread = [
            (grid[i] - 1) * strides[i] - pads[i] - pads[i + 2] + dilations[i] * (block[i] - 1) + 1
            for i in range(2)
        ]
        return relax.op.nn.conv2d_transpose(
            relax.op.reshape(data, [batch, rows, grid[0], grid[1]]),
            weights,
            strides=strides,
            padding=pads,
            output_padding=[image[i] - spread[i] for i in range(2)],
            dilation=dilations,
            groups=channels,
        )

"""Node inputs our ONNX converters need at import time (lengths, shapes, windows, axes)."""

from __future__ import annotations

import numpy as np
import tvm
from tvm.relax.frontend.onnx import onnx_frontend as frontend


def constant_input(value, params, what: str) -> np.ndarray | None:
    """The value of an optional node input that must be a constant; None when the input is absent
    (the frontend reads absent inputs as None)."""
    if value is None:
        return None
    value = frontend.get_constant(value, params)
    if not isinstance(value, tvm.ir.GenericConst):
        raise ValueError(f"{what} must be a constant, not computed at run time")
    return value.value.numpy()


def constant_int(value, params, what: str) -> int | None:
    """A scalar (or one-element) constant input as an int; None when absent."""
    array = constant_input(value, params, what)
    return None if array is None else int(array.reshape(-1)[0])

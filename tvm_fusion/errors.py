"""Errors tvm_fusion raises on bad input: each names the file, node, op or target at fault.

The CLI prints ``error: <message>`` for any of these and exits non-zero, so a user sees one
readable line instead of a C++ backtrace.
"""


def last_line(err: BaseException, limit: int = 500) -> str:
    """The informative part of an exception: TVM puts the message on the last line, after the backtrace."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    return (lines[-1] if lines else type(err).__name__)[:limit]


class TvmFusionError(Exception):
    """Base class: a problem with the user's input, not a bug in tvm_fusion."""


class ModelLoadError(TvmFusionError):
    """The model file is missing, unreadable, malformed or uses an unsupported opset."""


class UnsupportedOpError(TvmFusionError):
    """The model uses an operator the Relax ONNX frontend cannot import."""


class TargetError(TvmFusionError):
    """The target name is unknown, or this TVM build / machine cannot compile or run it."""


class TuningRecordError(TvmFusionError):
    """A tuning record file is corrupt, truncated, or belongs to another model/target/TVM."""


class InputError(TvmFusionError):
    """A run-time input has the wrong name, shape or dtype."""

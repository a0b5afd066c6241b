"""Errors tvm_fusion raises on bad input: each names the file, node, op or target at fault.

The CLI prints ``error: <message>`` for any of these and exits non-zero, so a user sees one
readable line instead of a C++ backtrace.
"""

import re

# TVM follows some messages with the IR it failed on ("Error in pass: ...", a TVMScript dump with
# "(... 249 lines skipped ...)"); the message proper comes before these markers.
_IR_DUMP = re.compile(r"\n(?:Error in pass:|Location \(TVMScript\):)")
_SKIPPED = re.compile(r"^\(\.\.\. \d+ lines skipped \.\.\.\)$")


def last_line(err: BaseException, limit: int = 500) -> str:
    """The informative part of an exception: TVM puts the message on the last line, after the
    backtrace, and before any IR dump it appends; "Check failed: (cond) is false: msg" gives msg."""
    text = _IR_DUMP.split(str(err), maxsplit=1)[0]
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not _SKIPPED.match(ln.strip())]
    line = lines[-1] if lines else type(err).__name__
    if line.startswith("Check failed:") and " is false: " in line:
        line = line.split(" is false: ", 1)[1].strip() or line
    return line[:limit]


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


class ModuleError(TvmFusionError):
    """An exported .so or its .so.json is missing, truncated, changed since export or not a TVM module."""


class ExportError(TvmFusionError):
    """The .so or its .so.json could not be written."""


class PolicyError(TvmFusionError):
    """A fusion policy (dict or JSON file) has an unknown key or a value of the wrong type."""

"""JSON files users hand us (policies, ``.so.json``): strict reading, one error line naming the file
and the problem, duplicate keys refused instead of silently keeping the last. Writing is
``files.write_json_atomic``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .errors import TvmFusionError


def json_type(value: Any) -> str:
    """The JSON name of a value's type, for messages ("a string", "true", "a list", ...)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    kind = {str: "string", int: "integer", float: "number", list: "list", tuple: "list", dict: "object"}
    return f"{kind.get(type(value), type(value).__name__)} {json.dumps(value, default=str)[:60]}"


class DuplicateKeyError(ValueError):
    def __init__(self, key: str):
        super().__init__(f"key {key!r} twice")
        self.key = key


def _refuse_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    data: dict = {}
    for key, value in pairs:
        if key in data:
            raise DuplicateKeyError(key)
        data[key] = value
    return data


def loads_strict(text: str) -> Any:
    """``json.loads`` that raises :class:`DuplicateKeyError` on a repeated object key."""
    return json.loads(text, object_pairs_hook=_refuse_duplicates)


def read_json(path: str | os.PathLike, what: str, error: type[TvmFusionError] = TvmFusionError) -> Any:
    """Parse the JSON file ``path`` (a ``what``, for messages); any problem raises ``error``."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise error(f"{path}: no such file (expected the {what})") from None
    except IsADirectoryError:
        raise error(f"{path}: is a directory, expected the {what} (a JSON file)") from None
    except (OSError, UnicodeDecodeError) as err:
        raise error(f"{path}: cannot read the {what}: {getattr(err, 'strerror', None) or err}") from None
    if not text.strip():
        raise error(f"{path}: the {what} is empty")
    try:
        return loads_strict(text)
    except DuplicateKeyError as err:
        raise error(f"{path}: the {what} has {err}") from None
    except json.JSONDecodeError as err:
        raise error(
            f"{path}: the {what} is not valid JSON ({err.msg} at line {err.lineno} column {err.colno}; "
            "truncated?)"
        ) from None

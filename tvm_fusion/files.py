"""Atomic file writes: readers see the old file or the new one, never a part of one.

Tuning records, manifests and ``.so.json`` metadata all go through here, so Ctrl-C, ``kill`` or a
full disk can never leave a half-written file behind. New files get the permissions the user's
umask gives any file (``mkstemp`` alone would make them private, 0600).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path


def _read_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


UMASK = _read_umask()


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` through a temp file in the same folder, fsync and ``os.replace``."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, 0o666 & ~UMASK)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_json_atomic(path: str | os.PathLike, data) -> None:
    """``data`` as indented, key-sorted JSON, written atomically."""
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")

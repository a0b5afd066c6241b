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


def current_umask() -> int:
    """The process umask now (it can change after import), read without changing it where Linux
    allows: ``os.umask`` can only swap, which races with other threads creating files."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # pragma: no cover - non-Linux: swap and restore
    os.umask(mask)  # pragma: no cover
    return mask  # pragma: no cover


def default_mode(executable: bool = False) -> int:
    """The mode ``open()`` (0666) or a linker (0777) gives a new file under the current umask."""
    return (0o777 if executable else 0o666) & ~current_umask()


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` through a temp file in the same folder, fsync and ``os.replace``."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, default_mode())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_json_atomic(path: str | os.PathLike, data) -> None:
    """``data`` as indented, key-sorted JSON, written atomically."""
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")

"""Atomic file publication: a reader sees the old file or the whole new one, never a part."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["fsync_directory", "write_atomic"]


def write_atomic(path: str | Path, data: bytes, mode: int = 0o644) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same directory, fsync'd, then renamed."""
    import tempfile  # (here: a restore's entry imports this module, not tempfile's random)

    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_directory(path.parent)


def fsync_directory(directory: str | Path) -> None:
    """Make a rename or a new entry in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

"""The host's files a CRIU image opens by path at restore, and whether they are still as captured.

CRIU re-opens every file the tree held open or mapped (shared libraries, the interpreter, model files
mapped read-only) by its path and refuses one whose size or mode changed — with one raw line deep in its
log, after the restore has started. A restore checks them first (:func:`changed_host_files`) and names
every file that moved, by path. It also compares modification times, which CRIU does not: a library or
checkpoint replaced by one of the same size is the same hazard. They are recorded at capture
(:func:`read_only_mtimes`) for the files the tree opened read-only — what the tree wrote to itself
(a log, a cache) may change between restores and CRIU handles it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from coldsnap.snapshot.criu_images import RegularFile, read_regular_files

__all__ = ["changed_host_files", "read_only_mtimes"]

# Restored from the image, not opened on the host: a replica's /dev/shm is a tmpfs of its own, filled
# with the image's saved files (coldsnap.snapshot.namespace_init).
_FROM_THE_IMAGE = ("/dev/shm/",)


def _checked(files: list[RegularFile]) -> list[RegularFile]:
    return [f for f in files if f.mode is not None and stat.S_ISREG(f.mode) and not f.name.startswith(_FROM_THE_IMAGE)]


def read_only_mtimes(images: Path) -> dict[str, int]:
    """Path → modification time (ns) now, of the regular files the image opens read-only."""
    mtimes = {}
    for file in _checked(read_regular_files(images)):
        if file.flags & os.O_ACCMODE == os.O_RDONLY:
            try:
                mtimes[file.name] = os.stat(file.name).st_mtime_ns
            except OSError:
                continue  # (gone already: admission names it as missing)
    return mtimes


def changed_host_files(images: Path, mtimes: dict[str, int]) -> list[str]:
    """Each regular file the image opens on the host that is missing, or whose size or mode (as CRIU
    checks) or recorded modification time changed, described in a few words."""
    changed = []
    for file in _checked(read_regular_files(images)):
        try:
            now = os.stat(file.name)
        except FileNotFoundError:
            changed.append(f"{file.name} (missing)")
            continue
        except OSError as exc:
            changed.append(f"{file.name} ({exc.strerror})")
            continue
        if file.size is not None and now.st_size != file.size:
            changed.append(f"{file.name} (size {now.st_size}, captured {file.size})")
        elif file.mode is not None and now.st_mode != file.mode:
            changed.append(f"{file.name} (mode {now.st_mode:o}, captured {file.mode:o})")
        elif file.name in mtimes and now.st_mtime_ns != mtimes[file.name]:
            changed.append(f"{file.name} (modified since capture)")
    return changed

"""When a validation record vouches for a file: the one trust rule, standard library only.

:mod:`coldsnap.payload.validation` keeps the records (``.coldsnap-validation.json``, strictly decoded)
and hashes what they do not vouch for; this module holds what both it and a restore's first step
(:mod:`coldsnap.activation.early_restore`, which runs before pydantic is imported) decide with: a
file's stat identity and whether an entry recorded for it is still good. :func:`vouched_by_records`
never hashes and never writes: a file it does not vouch for is left to :func:`~coldsnap.payload.validation.verify_file`.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any, NamedTuple

from coldsnap.contracts.canonical import parse_strict_json

__all__ = ["FileIdentity", "RACY_WINDOW_NS", "VALIDATION_RECORD_NAME", "identity_of", "vouches", "vouched_by_records"]

VALIDATION_RECORD_NAME = ".coldsnap-validation.json"
RACY_WINDOW_NS = 50_000_000
"""An entry is trusted only if its file last changed at least this long before its hash started.

Linux stamps files from a clock that advances once per tick (1-10 ms); 50 ms is several ticks.
"""


class FileIdentity(NamedTuple):
    """What a record binds a verdict to; any write, truncation, replacement or ``utime`` changes it."""

    st_dev: int
    st_ino: int
    size_bytes: int
    mtime_ns: int
    ctime_ns: int


def identity_of(status: os.stat_result) -> FileIdentity:
    return FileIdentity(status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns)


def vouches(recorded_sha256: str, recorded: FileIdentity, verified_unix_ns: int, now: FileIdentity,
            expected: str) -> bool:
    """Whether an entry (its digest, the identity it was hashed at, when that hash started) vouches for a
    file whose identity is ``now`` holding ``expected``: same digest, same identity, and hashed at least
    :data:`RACY_WINDOW_NS` after the file's last change (a write in the same clock tick leaves no trace)."""
    if recorded_sha256 != expected or recorded != now:
        return False
    return verified_unix_ns - max(recorded.mtime_ns, recorded.ctime_ns) >= RACY_WINDOW_NS


_ENTRY_INTEGERS = ("size_bytes", "st_dev", "st_ino", "mtime_ns", "ctime_ns", "verified_unix_ns")


def _entry_vouches(entry: Any, now: FileIdentity, expected: str) -> bool:
    """:func:`vouches` for one entry as the record's JSON has it; a malformed entry vouches for nothing."""
    if not isinstance(entry, dict) or not isinstance(entry.get("sha256"), str):
        return False
    if any(type(entry.get(name)) is not int for name in _ENTRY_INTEGERS):
        return False
    recorded = FileIdentity(entry["st_dev"], entry["st_ino"], entry["size_bytes"], entry["mtime_ns"], entry["ctime_ns"])
    return vouches(entry["sha256"], recorded, entry["verified_unix_ns"], now, expected)


def _record_files(directory: Path, cache: dict[Path, dict]) -> dict:
    if directory not in cache:
        try:
            document = parse_strict_json((directory / VALIDATION_RECORD_NAME).read_bytes())
        except (OSError, ValueError):
            document = None
        files = document.get("files") if isinstance(document, dict) and document.get("format") == 1 else None
        cache[directory] = files if isinstance(files, dict) else {}
    return cache[directory]


def vouched_by_records(files: list[tuple[Path, str]], record_dirs: dict[Path, Path | None]) -> bool:
    """Whether every ``(path, expected sha256)`` is a regular file that a record vouches for: the one in
    its own folder, else the one in ``record_dirs[its folder]`` (a restore's, under the state root), as
    :func:`~coldsnap.payload.validation.verify_file` consults them. Each record is read once."""
    cache: dict[Path, dict] = {}
    for path, expected in files:
        try:
            status = os.stat(path)
        except OSError:
            return False
        if not stat.S_ISREG(status.st_mode):
            return False
        now = identity_of(status)
        if _entry_vouches(_record_files(path.parent, cache).get(path.name), now, expected):
            continue
        elsewhere = record_dirs.get(path.parent)
        if elsewhere is None or not _entry_vouches(_record_files(elsewhere, cache).get(path.name), now, expected):
            return False
    return True

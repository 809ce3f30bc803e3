"""The one verifier of content-addressed files, and the validation record that makes it cheap to repeat.

Hashing a pack of tens of GiB costs seconds to minutes; restores happen far more often than packs
change. After a full hash matches, the verdict is stored in ``.coldsnap-validation.json`` next to the
file, bound to the file's stat identity ``(st_dev, st_ino, size, mtime_ns, ctime_ns)``. A later
verification trusts the record only while that identity is unchanged: any write, truncation,
replacement (new inode) or ``utime`` changes it, and the file is hashed in full again. ``ctime`` cannot
be set from user space, so a file cannot be changed and made to look unchanged short of changing the
clock.

One gap remains, the one git calls *racily clean*: file timestamps come from a coarse kernel clock,
so a write in the same clock tick as the last change before the hash leaves the identity unchanged.
An entry whose file changed less than :data:`RACY_WINDOW_NS` before its hash started is therefore not
trusted; the next verification hashes again and records a verdict that is no longer racy.

Every caller (restore, the CLI's ``payload verify``) goes through :func:`verify_file` (or
:func:`verify_files`, the same for many files at once).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import re
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal, NamedTuple

from pydantic import Field, model_validator

from coldsnap.atomic import write_atomic
from coldsnap.contracts.base import Contract, ContractError, Sha256Hex, decode_document
from coldsnap.contracts.canonical import INT64_MAX
from coldsnap.payload.errors import ExpectedDigestError, PackDigestMismatch, PackUnreadable
from coldsnap.payload.pack import digest_from_file_name
from coldsnap.payload.pack_reader import open_regular_file
from coldsnap.payload.records import RACY_WINDOW_NS, VALIDATION_RECORD_NAME, FileIdentity, identity_of, vouches

__all__ = [
    "ValidationEntry",
    "ValidationRecord",
    "Verification",
    "recorded",
    "verify_file",
    "verify_files",
    "read_validation_record",
    "record_written_file",
    "hash_and_record",
    "carry_records_over",
]

log = logging.getLogger(__name__)

HASH_CHUNK_BYTES = 8 * 1024 * 1024
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


class ValidationEntry(Contract):
    """A verified file: its digest and the stat identity it had when it was hashed."""

    sha256: Sha256Hex
    """SHA-256 of the file's bytes, found by a full hash."""
    size_bytes: int = Field(ge=0)
    """``st_size`` when hashed."""
    st_dev: int = Field(ge=0)
    """``st_dev`` when hashed (the filesystem)."""
    st_ino: int = Field(ge=0)
    """``st_ino`` when hashed (a replaced file gets a new one)."""
    mtime_ns: int
    """``st_mtime_ns`` when hashed."""
    ctime_ns: int
    """``st_ctime_ns`` when hashed (changes on every write and ``utime``; cannot be set back)."""
    verified_unix_ns: int = Field(ge=0)
    """Unix time, in nanoseconds, when the full hash started (for a file coldsnap wrote itself: when
    its writer vouched for it, past the racy window after the file's last change)."""


class ValidationRecord(Contract):
    """``.coldsnap-validation.json``: the verified files of one directory."""

    SUPPORTED_FORMATS: ClassVar[tuple[int, ...]] = (1,)

    format: Literal[1]
    """Record format version."""
    files: dict[str, ValidationEntry]
    """File name (in the record's directory) → its last successful verification."""

    @model_validator(mode="after")
    def _check_names(self) -> "ValidationRecord":
        for name in self.files:
            if not name or "/" in name or name in (".", ".."):
                raise ValueError(f"files: {name!r} is not a file name")
        return self


@dataclass(frozen=True)
class Verification:
    """A file found to hold the expected bytes."""

    path: Path
    sha256: str
    size_bytes: int
    method: Literal["record", "full-hash"]
    """``record``: trusted from an unchanged validation record; ``full-hash``: every byte was hashed."""
    seconds: float


def _entry_identity(entry: ValidationEntry) -> FileIdentity:
    return FileIdentity(entry.st_dev, entry.st_ino, entry.size_bytes, entry.mtime_ns, entry.ctime_ns)


def _wait_out_racy_window(identity: FileIdentity) -> None:
    """Sleep until the file's last change is :data:`RACY_WINDOW_NS` old (at most that long)."""
    wait_ns = max(identity.mtime_ns, identity.ctime_ns) + RACY_WINDOW_NS - time.time_ns()
    if wait_ns > 0:
        time.sleep(wait_ns / 1e9)


def _trusted(entry: ValidationEntry | None, now: FileIdentity, expected: str) -> bool:
    return entry is not None and vouches(entry.sha256, _entry_identity(entry), entry.verified_unix_ns, now, expected)


def _expected_digest(path: Path, expected: str | None) -> str:
    if expected is None:
        named = digest_from_file_name(path.name)
        if named is None:
            raise ExpectedDigestError(
                f"{path}: no expected SHA-256: the name is not <sha256>.pack or <sha256>.residual, give the digest"
            )
        return named
    if not isinstance(expected, str) or not _SHA256_HEX.match(expected.lower()):
        raise ExpectedDigestError(f"{path}: expected digest {expected!r} is not a hex SHA-256")
    return expected.lower()


def recorded(path: str | Path, sha256: str) -> bool:
    """Whether the file's directory's record vouches for ``path`` holding ``sha256`` now; never hashes (a
    pull asking whether a file it fetched before is whole: without a record it fetches it again)."""
    path = Path(path)
    try:
        now = identity_of(os.stat(path))
    except OSError:
        return False
    return _trusted(_load_record(path.parent, warn=False).files.get(path.name), now, sha256)


def read_validation_record(directory: str | Path) -> ValidationRecord:
    """The directory's validation record; empty when it is absent or unreadable (logged, never raised)."""
    return _load_record(Path(directory), warn=True)


def _load_record(directory: Path, warn: bool) -> ValidationRecord:
    path = directory / VALIDATION_RECORD_NAME
    try:
        return decode_document(ValidationRecord, path.read_bytes(), str(path))
    except FileNotFoundError:
        pass
    except OSError as exc:
        if warn:
            log.warning("%s: cannot read the validation record (%s); files are hashed in full", path, exc.strerror or exc)
    except ContractError as exc:
        if warn:
            log.warning("%s: ignoring the invalid validation record (%s); files are hashed in full and it is rewritten",
                        path, exc.problems[0])
    return ValidationRecord(format=1, files={})


def _update_record(directory: Path, name: str, entry: ValidationEntry | None) -> None:
    """Set (or, with ``None``, remove) one entry, under the directory's lock. Failures are logged only:
    the record is an optimization, and a read-only directory still verifies (in full, every time)."""
    _update_entries(directory, {name: entry})


def _update_entries(directory: Path, changes: dict[str, ValidationEntry | None]) -> None:
    """:func:`_update_record` for several entries at once (one read and one write of the record)."""
    lock_path = directory / (VALIDATION_RECORD_NAME + ".lock")
    try:
        lock_fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        if any(entry is not None for entry in changes.values()) or exc.errno not in (errno.EROFS, errno.EACCES):
            log.warning("%s: cannot lock the validation record (%s); it is not updated", lock_path, exc.strerror or exc)
        return
    try:
        # Read-modify-write under an exclusive lock: verifications of other files in this directory,
        # in other processes, must not lose each other's entries.
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        record = _load_record(directory, warn=False)
        files = dict(record.files)
        for name, entry in changes.items():
            if entry is None:
                files.pop(name, None)
            else:
                files[name] = entry
        if files == record.files:
            return
        write_atomic(directory / VALIDATION_RECORD_NAME, ValidationRecord(format=1, files=files).canonical_json() + b"\n")
    except OSError as exc:
        log.warning("%s: cannot update the validation record (%s)", directory / VALIDATION_RECORD_NAME, exc.strerror or exc)
    finally:
        os.close(lock_fd)  # releases the lock


def _hash_fd(fd: int) -> tuple[str, int]:
    """SHA-256 and byte count of everything readable from ``fd``'s current position."""
    digest = hashlib.sha256()
    buffer = memoryview(bytearray(HASH_CHUNK_BYTES))
    total = 0
    while True:
        count = os.readv(fd, [buffer])
        if count == 0:
            return digest.hexdigest(), total
        digest.update(buffer[:count])  # hashlib releases the GIL for large updates
        total += count


class _Hashed(NamedTuple):
    sha256: str
    bytes: int
    identity: FileIdentity  # the file's stat identity when hashing began
    stable: bool  # the identity did not change while hashing, and every byte was read
    started_ns: int


def _entry(sha256: str, identity: FileIdentity, verified_unix_ns: int) -> ValidationEntry:
    return ValidationEntry(sha256=sha256, size_bytes=identity.size_bytes, st_dev=identity.st_dev, st_ino=identity.st_ino,
                           mtime_ns=identity.mtime_ns, ctime_ns=identity.ctime_ns, verified_unix_ns=verified_unix_ns)


def _hash_file(path: Path) -> _Hashed:
    started_ns = time.time_ns()
    fd = open_regular_file(path)
    try:
        before = os.fstat(fd)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        actual, hashed = _hash_fd(fd)
        after = os.fstat(fd)
    finally:
        os.close(fd)
    identity = identity_of(before)
    return _Hashed(actual, hashed, identity, identity == identity_of(after) and hashed == before.st_size, started_ns)


def _record_hash(path: Path, hashed: _Hashed, directory: Path | None = None) -> None:
    """Record a full hash (in ``directory``'s record, default the file's own directory). A file that
    changed while it was hashed matched by luck of timing; recording that identity would vouch for bytes
    that were never hashed as a whole."""
    if hashed.stable and max(hashed.identity) <= INT64_MAX:
        _update_record(directory or path.parent, path.name, _entry(hashed.sha256, hashed.identity, hashed.started_ns))


def sha256_file(path: str | Path) -> str:
    """The SHA-256 of a file's bytes, recording nothing (a file no record is kept for: a request, a log)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(8 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def hash_and_record(path: str | Path, record_dir: Path | None = None) -> str:
    """Hash every byte of ``path`` and record the verdict as a full verification would (so a later
    :func:`verify_file` against this digest trusts the record while the file is unchanged); returns the
    SHA-256. For files whose digest is listed elsewhere (a capsule's CRIU images) rather than named by
    them. Raises OSError when the file cannot be read. A file changed within the racy window is
    hashed once the window has passed (at most :data:`RACY_WINDOW_NS` of waiting), so its record is
    trusted: a capsule's images are hashed right after CRIU wrote them. ``record_dir``: record there
    instead of in the file's own directory (as :func:`verify_file`'s)."""
    path = Path(path)
    _wait_out_racy_window(identity_of(os.stat(path)))
    hashed = _hash_file(path)
    _record_hash(path, hashed, record_dir)
    return hashed.sha256


def verify_file(path: str | Path, expected_sha256: str | None = None, record_dir: Path | None = None) -> Verification:
    """Verify that ``path`` holds the bytes of ``expected_sha256`` (default: the digest its name claims).

    Trusts the directory's validation record while the file's stat identity is what it was when the
    record was made; otherwise hashes every byte, then records a match or removes a stale entry.
    ``record_dir``: where this caller keeps its own record instead (a restore's state directory: an
    artifact is read-only to restores, and a moved or copied one has new stat identities), consulted
    after the file's own and written instead of it.

    Raises :class:`PackDigestMismatch` (the file is not what is expected), :class:`PackUnreadable`
    (missing, not a regular file, unreadable) or :class:`ExpectedDigestError`.
    """
    return _verify(Path(path), expected_sha256, record_dir, _RecordCache())


def verify_files(files: list[tuple[Path, str]], record_dir: Path | None = None) -> list[Verification]:
    """:func:`verify_file` for many files (a capsule's CRIU images: hundreds of them), each directory's
    record read once instead of once per file: a capsule of 231 images was admitted in 0.49 s that way,
    nearly all of it decoding the same record again. Same verdicts and errors, in the order given;
    ``record_dir`` as for :func:`verify_file`, one for all the files."""
    records = _RecordCache()
    return [_verify(Path(path), expected, record_dir, records) for path, expected in files]


class _RecordCache:
    """Validation records read once per directory within one verification call. A record this call
    updates (a file hashed in full) is read again afterwards, so later files see the update."""

    def __init__(self) -> None:
        self._records: dict[tuple[Path, bool], ValidationRecord] = {}

    def entry(self, directory: Path, name: str, warn: bool) -> ValidationEntry | None:
        key = (directory, warn)
        if key not in self._records:
            self._records[key] = _load_record(directory, warn=warn)
        return self._records[key].files.get(name)

    def forget(self, directory: Path) -> None:
        self._records = {k: v for k, v in self._records.items() if k[0] != directory}


def _verify(path: Path, expected_sha256: str | None, record_dir: Path | None, records: _RecordCache) -> Verification:
    started = time.perf_counter()
    expected = _expected_digest(path, expected_sha256)
    try:
        status = os.stat(path)
    except OSError as exc:
        raise PackUnreadable(str(path), exc.strerror or str(exc)) from None
    if not stat.S_ISREG(status.st_mode):
        raise PackUnreadable(str(path), "not a regular file")

    entry = records.entry(path.parent, path.name, warn=True)
    if _trusted(entry, identity_of(status), expected):
        return Verification(path, expected, status.st_size, "record", time.perf_counter() - started)
    if record_dir is not None:
        entry = records.entry(record_dir, path.name, warn=False)
        if _trusted(entry, identity_of(status), expected):
            return Verification(path, expected, status.st_size, "record", time.perf_counter() - started)

    try:
        hashed = _hash_file(path)
    except OSError as exc:
        raise PackUnreadable(str(path), exc.strerror or str(exc)) from None
    actual = hashed.sha256
    written = record_dir or path.parent
    records.forget(written)
    if actual != expected:
        # The entry is stale unless it describes the file exactly as hashed (then only the caller's
        # expectation was wrong, and a later verification with the right one may still trust it).
        if entry is not None and not (entry.sha256 == actual and _entry_identity(entry) == hashed.identity):
            _update_record(written, path.name, None)
        raise PackDigestMismatch(str(path), expected, actual)
    _record_hash(path, hashed, record_dir)
    return Verification(path, actual, hashed.bytes, "full-hash", time.perf_counter() - started)


def record_written_file(path: str | Path, sha256: str) -> None:
    """Record a file its writer has just finished (fsync'd and renamed into place), using the digest
    the writer computed over every byte it wrote: that single pass is the file's full hash, so the
    first restore after a capture trusts the record instead of hashing tens of GiB again.

    The entry is vouched for only once the file's last change is a racy window old (this waits at
    most :data:`RACY_WINDOW_NS`), so the same rule as a verifier's entry holds for it. Best effort,
    like every record update."""
    path = Path(path)
    status = os.stat(path)
    identity = identity_of(status)
    _wait_out_racy_window(identity)
    if identity_of(os.stat(path)) != identity or max(identity) > INT64_MAX:
        return  # changed meanwhile: leave it to a full verification
    _update_record(path.parent, path.name, _entry(sha256, identity, time.time_ns()))


def carry_records_over(directory: Path, before: dict[str, os.stat_result]) -> int:
    """After this process changed only the owner of files in ``directory`` (:mod:`coldsnap.ownership`), whose
    stat results were ``before``: the record's entries that vouched for them then are moved to their new
    identity, which differs in ``ctime`` only, so the next verification trusts them instead of hashing every
    byte again. An entry moves only if it was trusted for the file as it was and the file's device, inode,
    size and mtime are the same; it is vouched for once the racy window after the change has passed (this
    waits at most :data:`RACY_WINDOW_NS`). Returns how many entries moved; best effort, like every record
    update."""
    record = _load_record(directory, warn=False)
    moving: dict[str, tuple[ValidationEntry, FileIdentity]] = {}
    for name, status in before.items():
        entry = record.files.get(name)
        if entry is None or not _trusted(entry, identity_of(status), entry.sha256):
            continue
        try:
            now = identity_of(os.stat(directory / name))
        except OSError:
            continue
        if now[:4] == identity_of(status)[:4] and max(now) <= INT64_MAX:
            moving[name] = (entry, now)
    if not moving:
        return 0
    _wait_out_racy_window(max((identity for _, identity in moving.values()), key=lambda i: i.ctime_ns))
    verified_ns = time.time_ns()
    changes: dict[str, ValidationEntry | None] = {}
    for name, (entry, identity) in moving.items():
        try:
            if identity_of(os.stat(directory / name)) == identity:  # (changed meanwhile: hashed again when verified)
                changes[name] = _entry(entry.sha256, identity, verified_ns)
        except OSError:
            pass
    _update_entries(directory, changes)
    return len(changes)

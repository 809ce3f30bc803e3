"""Writing a native pack (:mod:`coldsnap.payload.pack`): lay out the planned extents, write header, table and
data from a caller's ``read_source``, publish the file under its content's name. Host bytes only."""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from pydantic import ValidationError

from coldsnap.atomic import fsync_directory
from coldsnap.contracts.base import describe_validation_error
from coldsnap.contracts.canonical import CanonicalJsonError
from coldsnap.contracts.layout import TensorExtent
from coldsnap.payload.errors import PackPlanInvalid
from coldsnap.payload.pack import (DEFAULT_CHUNK_BYTES, HEADER_BYTES, PACK_ALIGNMENT, PACK_FORMAT_VERSION, PackHeader,
                                   PackKind, PackTable, align_up, pack_file_name)

__all__ = ["PlannedExtent", "Progress", "ReadSource", "WrittenPack", "write_pack"]

_ZEROS = bytes(PACK_ALIGNMENT)
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


ReadSource = Callable[[str, int, memoryview], None]
"""``read_source(region_tag, region_offset, dest)`` fills all of ``dest`` with the region's bytes there."""
Progress = Callable[[int, int], None]
"""``progress(data_bytes_done, data_bytes_total)``, called after every chunk."""


@dataclass(frozen=True)
class PlannedExtent:
    """An extent to write, before its file offset is known."""

    region: str
    region_offset: int
    length: int
    tensors: Sequence[TensorExtent] = ()


@dataclass(frozen=True)
class WrittenPack:
    """A pack published by :func:`write_pack`."""

    path: Path
    sha256: str
    size_bytes: int
    kind: PackKind
    table: PackTable
    reused: bool
    """True when an identical pack (same name and size) was already there and was kept."""


def _lay_out(planned: Sequence[PlannedExtent]) -> tuple[PackTable, bytes, int, int]:
    """The table, its canonical bytes, the data offset and the data length of ``planned`` in order."""
    # Extent file offsets depend on the data offset, which depends on the table's length, which
    # depends on the offsets' digits. Starting from the smallest possible data offset, each pass can
    # only grow it, so this reaches the fixed point in a pass or two.
    data_offset = HEADER_BYTES + PACK_ALIGNMENT
    while True:
        extents = []
        cursor = data_offset
        for item in planned:
            extents.append(
                {
                    "region": item.region,
                    "region_offset": item.region_offset,
                    "length": item.length,
                    "file_offset": cursor,
                    "tensors": list(item.tensors),
                }
            )
            cursor = align_up(cursor + item.length)
        try:
            table = PackTable.model_validate({"format": 1, "extents": extents})
            table_bytes = table.canonical_json()
        except ValidationError as exc:
            raise PackPlanInvalid("invalid pack plan: " + "; ".join(describe_validation_error(exc))) from None
        except CanonicalJsonError as exc:
            raise PackPlanInvalid(f"invalid pack plan: {exc}") from None
        needed = align_up(HEADER_BYTES + len(table_bytes))
        if needed == data_offset:
            return table, table_bytes, data_offset, cursor - data_offset
        data_offset = needed


def _write_all(fd: int, data: memoryview | bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def write_pack(
    directory: str | Path,
    kind: PackKind,
    layout_digest: str,
    extents: Sequence[PlannedExtent],
    read_source: ReadSource,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    progress: Progress | None = None,
    staging: memoryview | bytearray | None = None,
) -> WrittenPack:
    """Stream ``extents`` (in this order) from ``read_source`` into a new pack in ``directory``.

    Offsets are known before any data is read, so header, table and data are streamed once, in file
    order, through one running SHA-256 into a temporary file; it is fsync'd and renamed to
    ``<sha256>.pack`` / ``<sha256>.residual``. Memory stays bounded by one chunk buffer whatever the pack
    size: ``staging`` if given (e.g. a pinned host buffer a GPU caller copies into, in which case every
    ``dest`` view is a prefix of it), else ``chunk_bytes`` allocated once. On any failure the temporary
    file is removed. An existing file of the same name and size is kept (same name, same bytes), which
    leaves its inode and validation record intact.
    """
    try:
        kind = PackKind(kind)
    except ValueError:
        raise PackPlanInvalid(f"invalid pack kind {kind!r} (1 payload, 2 residual)") from None
    if not isinstance(layout_digest, str) or not _SHA256_HEX.match(layout_digest):
        raise PackPlanInvalid(f"layout digest {layout_digest!r} is not a lower-case hex SHA-256")
    table, table_bytes, data_offset, data_length = _lay_out(extents)
    header = PackHeader(
        version=PACK_FORMAT_VERSION,
        kind=kind,
        table_offset=HEADER_BYTES,
        table_length=len(table_bytes),
        table_sha256=hashlib.sha256(table_bytes).hexdigest(),
        data_offset=data_offset,
        data_length=data_length,
        layout_digest=layout_digest,
    )
    if staging is not None:
        buffer = memoryview(staging).cast("B")
        if buffer.readonly or len(buffer) == 0:
            raise PackPlanInvalid("the staging buffer must be writable and not empty")
    else:
        if chunk_bytes <= 0:
            raise PackPlanInvalid(f"chunk_bytes must be positive, got {chunk_bytes}")
        largest = max((extent.length for extent in table.extents), default=0)
        buffer = memoryview(bytearray(max(1, min(chunk_bytes, largest))))
    chunk = len(buffer)

    directory = Path(directory)
    temporary = directory / f".{secrets.token_hex(8)}{kind.suffix}.tmp"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        os.fchmod(fd, 0o644)  # the mode given to open() is masked by the umask
        digest = hashlib.sha256()

        def emit(data: memoryview | bytes) -> None:
            digest.update(data)
            _write_all(fd, data)

        emit(header.to_bytes())
        emit(table_bytes)
        emit(_ZEROS[: data_offset - HEADER_BYTES - len(table_bytes)])
        done, total = 0, sum(extent.length for extent in table.extents)
        for extent in table.extents:
            for start in range(0, extent.length, chunk):
                view = buffer[: min(chunk, extent.length - start)]
                read_source(extent.region, extent.region_offset + start, view)
                emit(view)
                done += len(view)
                if progress is not None:
                    progress(done, total)
            emit(_ZEROS[: align_up(extent.file_end) - extent.file_end])
        os.fsync(fd)
        size = data_offset + data_length
        os.close(fd)
        fd = -1
        sha256 = digest.hexdigest()
        final = directory / pack_file_name(sha256, kind)
        try:
            existing = os.stat(final)
        except FileNotFoundError:
            existing = None
        reused = existing is not None and stat.S_ISREG(existing.st_mode) and existing.st_size == size
        if reused:
            os.unlink(temporary)
        else:
            os.rename(temporary, final)
            fsync_directory(directory)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        try:
            os.unlink(temporary)
        except FileNotFoundError:
            pass
        raise
    return WrittenPack(path=final, sha256=sha256, size_bytes=size, kind=kind, table=table, reused=reused)

"""The native pack: a content-addressed file of preserved GPU bytes, laid out for O_DIRECT hydration.

Layout of format version 1 (all integers little-endian)::

    [0, 4096)                header: magic b"CSNPACK\\0", format version u32, kind u32,
                             table offset u64, table length u64, table SHA-256 (32 bytes),
                             data offset u64, data length u64, layout digest (32 bytes), zeros
    [4096, 4096 + T)         extents table: canonical JSON of :class:`PackTable`
    ... zeros to 4096        so the data starts aligned
    [data_offset, EOF)       data extents in table order, each at a 4096-aligned file offset and
                             followed by zeros to the next 4096 boundary (the last one too)

Every extent's aligned read span ``[file_offset, align_up(file_offset + length))`` therefore lies
inside the file, so the hydration engine can read any extent with O_DIRECT without a short tail read.
The file is named ``<sha256>.pack`` (model payload) or ``<sha256>.residual`` (the other preserved
stable bytes, see :mod:`coldsnap.payload.residual`) after the SHA-256 of its whole content; the
header binds the digest of the :class:`~coldsnap.contracts.layout.MemoryLayout` it was cut from.

This module reads and writes host bytes only; a GPU caller supplies ``read_source`` and consumes
:meth:`NativePack.hydration_plan`. It imports no torch.
"""

from __future__ import annotations

import enum
import errno
import hashlib
import os
import re
import secrets
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ClassVar, Literal, Mapping, NamedTuple, Sequence

from pydantic import Field, ValidationError, model_validator

from coldsnap.atomic import fsync_directory
from coldsnap.contracts.base import Contract, ContractError, decode_document, describe_validation_error
from coldsnap.contracts.canonical import CanonicalJsonError
from coldsnap.contracts.common import RegionTag
from coldsnap.contracts.layout import TensorExtent
from coldsnap.payload.errors import (
    ExtentOutOfRegion,
    PackBadMagic,
    PackCorrupt,
    PackLayoutMismatch,
    PackPlanInvalid,
    PackTruncated,
    PackUnreadable,
    PackUnsupportedVersion,
    RegionTooSmall,
)

__all__ = [
    "PACK_MAGIC",
    "PACK_FORMAT_VERSION",
    "SUPPORTED_PACK_VERSIONS",
    "PACK_ALIGNMENT",
    "HEADER_BYTES",
    "DEFAULT_CHUNK_BYTES",
    "PackKind",
    "PackExtent",
    "PackTable",
    "PackHeader",
    "PlannedExtent",
    "WrittenPack",
    "HydrationCopy",
    "NativePack",
    "write_pack",
    "align_up",
    "pack_file_name",
    "digest_from_file_name",
    "open_regular_file",
]

PACK_MAGIC = b"CSNPACK\0"
PACK_FORMAT_VERSION = 1
SUPPORTED_PACK_VERSIONS: tuple[int, ...] = (1,)
PACK_ALIGNMENT = 4096
"""File alignment of the header, the data area and every data extent (the O_DIRECT block size)."""
HEADER_BYTES = 4096
DEFAULT_CHUNK_BYTES = 64 * 1024 * 1024
# A table describes at most a few hundred thousand tensors (~100 MiB); a larger length field is a
# corrupt header, and refusing it keeps a bad file from making the reader allocate without bound.
MAX_TABLE_BYTES = 256 * 1024 * 1024

# magic, version, kind, table_offset, table_length, table_sha256, data_offset, data_length, layout_digest
_HEADER = struct.Struct("<8sIIQQ32sQQ32s")
_VERSION = struct.Struct("<I")
_ZEROS = bytes(PACK_ALIGNMENT)
_CONTENT_NAME = re.compile(r"^([0-9a-f]{64})\.(pack|residual)$")
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


def align_up(value: int, alignment: int = PACK_ALIGNMENT) -> int:
    """``value`` rounded up to a multiple of ``alignment``."""
    return -(-value // alignment) * alignment


class PackKind(enum.IntEnum):
    """What a pack holds; the header's ``kind`` field and the file name's suffix."""

    PAYLOAD = 1
    """Model bytes, with the names, dtypes and shapes of the tensors they hold."""
    RESIDUAL = 2
    """The other preserved stable bytes (see :mod:`coldsnap.payload.residual`)."""

    @property
    def suffix(self) -> str:
        return ".pack" if self is PackKind.PAYLOAD else ".residual"


def pack_file_name(sha256: str, kind: PackKind) -> str:
    """The content-addressed file name of a pack: ``<sha256>.pack`` or ``<sha256>.residual``."""
    return f"{sha256}{PackKind(kind).suffix}"


def digest_from_file_name(name: str) -> str | None:
    """The SHA-256 a content-addressed file name claims, or ``None`` when the name is not one."""
    match = _CONTENT_NAME.match(name)
    return match.group(1) if match else None


class PackExtent(Contract):
    """One contiguous run of a region's bytes, stored at one place in the pack."""

    region: RegionTag
    """The stable region the bytes come from and are hydrated into."""
    region_offset: int = Field(ge=0)
    """Byte offset of the run from the region's base address."""
    length: int = Field(ge=1)
    """Byte length of the run."""
    file_offset: int = Field(ge=0)
    """Where the run starts in the pack file; a multiple of 4096."""
    tensors: list[TensorExtent] = Field(default_factory=list)
    """Named tensors inside the run, with region offsets inside ``[region_offset, region_offset + length)``;
    empty in a residual."""

    @property
    def region_end(self) -> int:
        return self.region_offset + self.length

    @property
    def file_end(self) -> int:
        return self.file_offset + self.length

    @model_validator(mode="after")
    def _check_extent(self) -> "PackExtent":
        if self.file_offset % PACK_ALIGNMENT:
            raise ValueError(f"file_offset {self.file_offset} is not a multiple of {PACK_ALIGNMENT}")
        for tensor in self.tensors:
            if tensor.offset < self.region_offset or tensor.offset + tensor.length > self.region_end:
                raise ValueError(
                    f"tensor {tensor.name!r} [{tensor.offset}, {tensor.offset + tensor.length}) is outside "
                    f"its extent [{self.region_offset}, {self.region_end})"
                )
        return self


class PackTable(Contract):
    """The extents table stored after the header, as canonical JSON."""

    SUPPORTED_FORMATS: ClassVar[tuple[int, ...]] = (1,)

    format: Literal[1]
    """Table format version."""
    extents: list[PackExtent]
    """Data extents in file order: sorted by ``file_offset``, not overlapping in the file nor in a region."""

    @model_validator(mode="after")
    def _check_extents(self) -> "PackTable":
        file_end = 0
        for index, extent in enumerate(self.extents):
            if extent.file_offset < file_end:
                raise ValueError(f"extent {index} at file offset {extent.file_offset} overlaps or is out of file order")
            file_end = extent.file_end
        by_region: dict[str, list[tuple[int, int, int]]] = {}
        for index, extent in enumerate(self.extents):
            by_region.setdefault(extent.region, []).append((extent.region_offset, extent.region_end, index))
        for region, runs in by_region.items():
            runs.sort()
            for (_, end, first), (start, _, second) in zip(runs, runs[1:]):
                if start < end:
                    raise ValueError(f"extents {first} and {second} overlap in region {region!r}")
        names: set[str] = set()
        for extent in self.extents:
            for tensor in extent.tensors:
                if tensor.name in names:
                    raise ValueError(f"tensor {tensor.name!r} appears twice")
                names.add(tensor.name)
        return self


@dataclass(frozen=True)
class PackHeader:
    """The fixed 4096-byte header, decoded; digests as lower-case hex."""

    version: int
    kind: PackKind
    table_offset: int
    table_length: int
    table_sha256: str
    data_offset: int
    data_length: int
    layout_digest: str

    def to_bytes(self) -> bytes:
        fixed = _HEADER.pack(
            PACK_MAGIC,
            self.version,
            int(self.kind),
            self.table_offset,
            self.table_length,
            bytes.fromhex(self.table_sha256),
            self.data_offset,
            self.data_length,
            bytes.fromhex(self.layout_digest),
        )
        return fixed + bytes(HEADER_BYTES - len(fixed))

    @classmethod
    def parse(cls, path: str, head: bytes, file_size: int) -> "PackHeader":
        """Decode and check a header read from the start of a file of ``file_size`` bytes."""
        # Magic first, then the version: a pack of a later version may have another header size, so
        # it must be named as such before its length is judged.
        if head[: len(PACK_MAGIC)] != PACK_MAGIC:
            if len(head) < len(PACK_MAGIC) and PACK_MAGIC.startswith(head):
                raise PackTruncated(path, "the magic", len(PACK_MAGIC), file_size)
            raise PackBadMagic(path, head[: len(PACK_MAGIC)], PACK_MAGIC)
        if len(head) < len(PACK_MAGIC) + _VERSION.size:
            raise PackTruncated(path, "the format version", len(PACK_MAGIC) + _VERSION.size, file_size)
        (version,) = _VERSION.unpack_from(head, len(PACK_MAGIC))
        if version not in SUPPORTED_PACK_VERSIONS:
            raise PackUnsupportedVersion(path, version, SUPPORTED_PACK_VERSIONS)
        if len(head) < HEADER_BYTES:
            raise PackTruncated(path, "the header", HEADER_BYTES, file_size)
        _, _, kind, table_offset, table_length, table_sha, data_offset, data_length, layout = _HEADER.unpack_from(head)
        if any(head[_HEADER.size : HEADER_BYTES]):
            raise PackCorrupt(path, f"header bytes {_HEADER.size}..{HEADER_BYTES - 1} are not zero")
        try:
            kind = PackKind(kind)
        except ValueError:
            raise PackCorrupt(path, f"unknown pack kind {kind} (1 payload, 2 residual)") from None
        if table_offset != HEADER_BYTES:
            raise PackCorrupt(path, f"table offset {table_offset}, expected {HEADER_BYTES}")
        if not 0 < table_length <= MAX_TABLE_BYTES:
            raise PackCorrupt(path, f"table length {table_length} is not within 1..{MAX_TABLE_BYTES}")
        if data_offset != align_up(table_offset + table_length):
            raise PackCorrupt(path, f"data offset {data_offset}, expected {align_up(table_offset + table_length)}")
        if data_length % PACK_ALIGNMENT:
            raise PackCorrupt(path, f"data length {data_length} is not a multiple of {PACK_ALIGNMENT}")
        if file_size < table_offset + table_length:
            raise PackTruncated(path, "the extents table", table_offset + table_length, file_size)
        if file_size < data_offset + data_length:
            raise PackTruncated(path, "the data extents", data_offset + data_length, file_size)
        if file_size > data_offset + data_length:
            raise PackCorrupt(path, f"{file_size - data_offset - data_length} bytes follow the data area")
        return cls(
            version=version,
            kind=kind,
            table_offset=table_offset,
            table_length=table_length,
            table_sha256=table_sha.hex(),
            data_offset=data_offset,
            data_length=data_length,
            layout_digest=layout.hex(),
        )


class HydrationCopy(NamedTuple):
    """One copy of the hydration engine: ``length`` bytes from ``file_offset`` to ``dst_address``."""

    file_offset: int
    length: int
    dst_address: int


class NativePack:
    """An opened pack whose header and extents table were read and checked; data is read on demand."""

    def __init__(self, path: Path, header: PackHeader, table: PackTable, size_bytes: int):
        self.path = path
        self.header = header
        self.table = table
        self.size_bytes = size_bytes

    def __repr__(self) -> str:
        return f"NativePack({str(self.path)!r}, {self.kind.name.lower()}, {len(self.extents)} extents)"

    @property
    def kind(self) -> PackKind:
        return self.header.kind

    @property
    def layout_digest(self) -> str:
        return self.header.layout_digest

    @property
    def extents(self) -> list[PackExtent]:
        return self.table.extents

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> "NativePack":
        """Read and check the header and extents table of ``path``; no data is read.

        Raises :class:`PackBadMagic`, :class:`PackUnsupportedVersion`, :class:`PackTruncated`,
        :class:`PackCorrupt` or :class:`PackUnreadable`. The content digest is not checked here: that is
        :func:`coldsnap.payload.validation.verify_file`'s job, which the record makes cheap to repeat.
        """
        path = Path(path)
        name = str(path)
        try:
            fd = open_regular_file(path)
            try:
                size = os.fstat(fd).st_size
                header = PackHeader.parse(name, _read_at(fd, 0, HEADER_BYTES), size)
                table_and_padding = _read_at(fd, header.table_offset, header.data_offset - header.table_offset)
            finally:
                os.close(fd)
        except OSError as exc:
            raise PackUnreadable(name, exc.strerror or str(exc)) from None
        if len(table_and_padding) != header.data_offset - header.table_offset:  # shrank since fstat
            raise PackTruncated(name, "the extents table", header.data_offset, header.table_offset + len(table_and_padding))
        table_bytes = table_and_padding[: header.table_length]
        if hashlib.sha256(table_bytes).hexdigest() != header.table_sha256:
            raise PackCorrupt(name, "extents table SHA-256 does not match the header")
        if any(table_and_padding[header.table_length :]):
            raise PackCorrupt(name, "the padding after the extents table is not zero")
        try:
            table = decode_document(PackTable, table_bytes, name)
        except ContractError as exc:
            raise PackCorrupt(name, "extents table: " + "; ".join(exc.problems)) from None
        try:
            canonical = table.canonical_json()
        except CanonicalJsonError as exc:
            raise PackCorrupt(name, f"extents table: {exc}") from None
        if canonical != table_bytes:
            raise PackCorrupt(name, "extents table is not canonical JSON")
        data_end = header.data_offset + header.data_length
        for index, extent in enumerate(table.extents):
            if extent.file_offset < header.data_offset or extent.file_end > data_end:
                raise PackCorrupt(
                    name,
                    f"extent {index} [{extent.file_offset}, {extent.file_end}) is outside the data area "
                    f"[{header.data_offset}, {data_end})",
                )
        return cls(path, header, table, size)

    def expect_layout(self, layout_digest: str) -> None:
        """Raise :class:`PackLayoutMismatch` unless the pack was cut from the layout ``layout_digest``."""
        if layout_digest != self.layout_digest:
            raise PackLayoutMismatch(str(self.path), self.layout_digest, layout_digest)

    def check_regions(self, region_sizes: Mapping[str, int]) -> None:
        """Check every extent fits its region of ``region_sizes`` (tag → mapped size in bytes).

        An extent whose region is absent raises :class:`ExtentOutOfRegion`; a region smaller than the
        end of its last extent raises :class:`RegionTooSmall` (a subclass, so catching the former
        catches every extent that does not fit).
        """
        needed: dict[str, int] = {}
        for index, extent in enumerate(self.extents):
            if extent.region not in region_sizes:
                present = ", ".join(sorted(region_sizes)) or "none"
                raise ExtentOutOfRegion(
                    f"{self.path}: extent {index} ({extent.length} bytes at {extent.region} +{extent.region_offset}) "
                    f"targets region {extent.region!r}, which is not mapped (regions: {present})"
                )
            needed[extent.region] = max(needed.get(extent.region, 0), extent.region_end)
        for tag, need in needed.items():
            if need > region_sizes[tag]:
                raise RegionTooSmall(str(self.path), tag, need, region_sizes[tag])

    def hydration_plan(self, region_bases: Mapping[str, int], region_sizes: Mapping[str, int]) -> list[HydrationCopy]:
        """The copies that hydrate this pack into regions mapped at ``region_bases`` (tag → address).

        Checks :meth:`check_regions` first, so every destination range lies inside its region.
        """
        self.check_regions(region_sizes)
        for tag in {extent.region for extent in self.extents}:
            base = region_bases.get(tag)
            # Address 0 is never a mapped region: it is an unset base, and copying there would scribble
            # over whatever the low addresses hold.
            if base is None or base <= 0 or base + region_sizes[tag] > 2**64:
                raise ExtentOutOfRegion(f"{self.path}: region {tag!r} has no valid base address (got {base})")
        return [
            HydrationCopy(extent.file_offset, extent.length, region_bases[extent.region] + extent.region_offset)
            for extent in self.extents
        ]

    def read_extent(self, extent: PackExtent) -> bytes:
        """The bytes of one extent (tests, small packs; hydration goes through the native engine)."""
        try:
            fd = open_regular_file(self.path)
            try:
                data = _read_at(fd, extent.file_offset, extent.length)
            finally:
                os.close(fd)
        except OSError as exc:
            raise PackUnreadable(str(self.path), exc.strerror or str(exc)) from None
        if len(data) != extent.length:
            actual = extent.file_offset + len(data)
            raise PackTruncated(str(self.path), f"the extent at {extent.file_offset}", extent.file_end, actual)
        return data


def open_regular_file(path: Path) -> int:
    """A read-only descriptor of a regular file; anything else raises OSError (EISDIR, ENXIO...)."""
    # O_NONBLOCK so that a FIFO put where a pack should be fails here instead of blocking the open;
    # it changes nothing for a regular file.
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file")
    return fd


def _read_at(fd: int, offset: int, length: int) -> bytes:
    """Up to ``length`` bytes at ``offset``; fewer only at end of file."""
    parts = []
    while length > 0:
        part = os.pread(fd, min(length, 1 << 30), offset)
        if not part:
            break
        parts.append(part)
        offset += len(part)
        length -= len(part)
    return b"".join(parts)


# --- writing -------------------------------------------------------------------------------------

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

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

This module is the format: its header, table, extents and file names. Reading a pack is
:mod:`coldsnap.payload.pack_reader` (a GPU caller consumes :meth:`~coldsnap.payload.pack_reader.NativePack.hydration_plan`),
writing one :mod:`coldsnap.payload.pack_writer` (a GPU caller supplies ``read_source``). Host bytes only; no torch.
"""

from __future__ import annotations

import enum
import re
import struct
from dataclasses import dataclass
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from coldsnap.contracts.base import Contract
from coldsnap.contracts.common import RegionTag
from coldsnap.contracts.layout import TensorExtent
from coldsnap.payload.errors import PackBadMagic, PackCorrupt, PackTruncated, PackUnsupportedVersion

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
    "align_up",
    "pack_file_name",
    "digest_from_file_name",
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
_CONTENT_NAME = re.compile(r"^([0-9a-f]{64})\.(pack|residual)$")


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

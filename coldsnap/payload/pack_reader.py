"""Reading a native pack (:mod:`coldsnap.payload.pack`): open it, check its header and table against the
memory it is for, plan its hydration, read an extent. Host bytes only; it imports no torch."""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from pathlib import Path
from typing import Mapping, NamedTuple

from coldsnap.contracts.base import ContractError, decode_document
from coldsnap.contracts.canonical import CanonicalJsonError
from coldsnap.payload.errors import (
    ExtentOutOfRegion,
    PackCorrupt,
    PackLayoutMismatch,
    PackTruncated,
    PackUnreadable,
    RegionTooSmall,
)
from coldsnap.payload.pack import HEADER_BYTES, PackExtent, PackHeader, PackKind, PackTable

__all__ = ["HydrationCopy", "NativePack", "open_regular_file"]


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

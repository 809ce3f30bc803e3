"""Native packs and stable regions: write a pack from live regions, hydrate a pack into them."""

from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path
from typing import Mapping

from coldsnap.contracts.layout import MemoryLayout, TensorExtent
from coldsnap.hydrate.engine import CopyItem, HydrationError, HydrationStats, hydrate_items
from coldsnap.memory.regions import StableRegion
from coldsnap.native import native
from coldsnap.payload.arrival import ArrivalFailed, PackArrival
from coldsnap.payload.errors import PackError
from coldsnap.payload.pack import PackKind
from coldsnap.payload.pack_reader import NativePack
from coldsnap.payload.pack_writer import PlannedExtent, WrittenPack, write_pack
from coldsnap.payload.validation import record_written_file

__all__ = ["payload_extents", "write_pack_from_regions", "hydrate_pack", "hydrate_pack_as_it_arrives", "PinnedPack"]


def payload_extents(layout: MemoryLayout) -> list[PlannedExtent]:
    """The layout's tensors as pack extents, tensors that touch in memory merged into one extent
    (fewer, larger extents hydrate faster)."""
    planned: list[PlannedExtent] = []
    for region_layout in layout.regions:
        run: list[TensorExtent] = []
        for tensor in region_layout.tensors:
            if tensor.length == 0:
                continue
            if run and run[-1].offset + run[-1].length != tensor.offset:
                planned.append(_extent(region_layout.tag, run))
                run = []
            run.append(tensor)
        if run:
            planned.append(_extent(region_layout.tag, run))
    return planned


def _extent(tag: str, run: list[TensorExtent]) -> PlannedExtent:
    start = run[0].offset
    return PlannedExtent(tag, start, run[-1].offset + run[-1].length - start, tuple(run))


def _region_reader(regions: Mapping[str, StableRegion]):
    C = native()

    def read(tag: str, offset: int, dest: memoryview) -> None:
        source = regions[tag]
        address = source.address(offset, len(dest))
        if source.backend == "host":
            dest[:] = source.host_view(offset, len(dest))
        else:
            destination = ctypes.addressof(ctypes.c_char.from_buffer(dest))
            C.copy_device_to_host(destination, address, len(dest), source.device)

    return read


def write_pack_from_regions(
    directory: str | os.PathLike[str],
    layout: MemoryLayout,
    regions: Mapping[str, StableRegion],
    *,
    kind: PackKind = PackKind.PAYLOAD,
    extents: list[PlannedExtent] | None = None,
    progress=None,
) -> WrittenPack:
    """Stream the layout's tensors (or ``extents``) from live regions into a content-addressed pack."""
    planned = payload_extents(layout) if extents is None else extents
    missing = sorted({e.region for e in planned} - set(regions))
    if missing:
        raise HydrationError(f"no region given for {', '.join(missing)}")
    written = write_pack(Path(directory), kind, layout.digest(), planned, _region_reader(regions), progress=progress)
    if not written.reused:  # a reused file keeps (or earns) its own record
        record_written_file(written.path, written.sha256)
    return written


def _plan(path: str | os.PathLike[str], regions: Mapping[str, StableRegion],
          layout_digest: str | None) -> tuple[list[CopyItem], dict[str, StableRegion]]:
    """The pack's extents as copies into ``regions`` (checked against the layout digest and each
    region's mapped bytes before anything is read), and the regions they land in."""
    try:
        pack = NativePack.open(path)
        if layout_digest is not None:
            pack.expect_layout(layout_digest)
        tags = {e.region for e in pack.extents}
        used: dict[str, StableRegion] = {tag: regions[tag] for tag in tags if tag in regions}
        plan = pack.hydration_plan({t: r.base for t, r in used.items()}, {t: r.mapped_bytes for t, r in used.items()})
    except PackError as exc:
        raise HydrationError(str(exc)) from None
    return [CopyItem(c.file_offset, c.length, c.dst_address) for c in plan], used


_NOTHING = HydrationStats(bytes=0, items=0, seconds=0.0, threads=0, chunk_bytes=0, pinned_bytes=0, direct=False,
                          cached_fraction=-1.0)


def hydrate_pack(
    path: str | os.PathLike[str],
    regions: Mapping[str, StableRegion],
    *,
    layout_digest: str | None = None,
    **engine_options: object,
) -> HydrationStats:
    """Copy every extent of the pack to its region. The pack's layout digest must match
    ``layout_digest`` when given; extents outside a region's mapped bytes are refused before reading."""
    items, used = _plan(path, regions, layout_digest)
    if not items:  # a residual can be empty: every preserved byte was in the payload
        return _NOTHING
    return hydrate_items(path, items, used.values(), **engine_options)  # type: ignore[arg-type]


def hydrate_pack_as_it_arrives(
    path: str | os.PathLike[str],
    regions: Mapping[str, StableRegion],
    arrival: PackArrival,
    *,
    layout_digest: str | None = None,
    progress=None,
    **engine_options: object,
) -> HydrationStats:
    """:func:`hydrate_pack` of a pack still being pulled: each batch of chunks that arrived (verified) since the
    last is hydrated at once, so the copy to the GPU keeps pace with the pull and ends just after its last
    chunk. The pack's header and index (its first chunk) must be in before the plan can be read. The bytes
    were just written through the page cache: they are read from there (buffered), not from the disk."""
    keep_going = (lambda: progress(0, 0) is not False) if progress is not None else (lambda: True)
    try:
        arrival.wait(0, 1, keep_going)  # the first chunk: the header and (nearly always all of) the extents table
        try:
            items, used = _plan(path, regions, layout_digest)
        except HydrationError:  # a table longer than the first chunk: read once the whole pack is in
            arrival.wait(keep_going=keep_going)
            items, used = _plan(path, regions, layout_digest)
    except ArrivalFailed as exc:
        raise HydrationError(str(exc)) from None
    by_chunk: dict[int, list[CopyItem]] = {}
    for item in items:  # each item cut at chunk boundaries, filed under the chunk that holds it
        offset, end, dst = item.file_offset, item.file_offset + item.length, item.dst
        for index in arrival.chunks_of(item.file_offset, item.length):
            lo, hi = arrival.chunk_range(index)
            piece = min(end, hi) - max(offset, lo)
            by_chunk.setdefault(index, []).append(CopyItem(offset, piece, dst))
            offset, dst = offset + piece, dst + piece
    started = time.perf_counter()
    total = HydrationStats(bytes=0, items=0, seconds=0.0, threads=0, chunk_bytes=0, pinned_bytes=0, direct=False,
                           cached_fraction=-1.0)
    try:
        for batch in arrival.as_they_arrive(keep_going):
            work = [item for index in batch for item in by_chunk.get(index, [])]
            if not work:
                continue
            stats = hydrate_items(path, work, used.values(), direct=False, progress=progress, **engine_options)  # type: ignore[arg-type]
            total = HydrationStats(bytes=total.bytes + stats.bytes, items=total.items + stats.items, seconds=0.0,
                                   threads=stats.threads, chunk_bytes=stats.chunk_bytes, pinned_bytes=stats.pinned_bytes,
                                   direct=False, cached_fraction=-1.0)
    except ArrivalFailed as exc:
        raise HydrationError(str(exc)) from None
    return HydrationStats(bytes=total.bytes, items=total.items, seconds=time.perf_counter() - started,
                          threads=total.threads, chunk_bytes=total.chunk_bytes, pinned_bytes=total.pinned_bytes,
                          direct=False, cached_fraction=-1.0)


class PinnedPack:
    """A pack file mapped from the page cache and registered with the CUDA driver as pinned host
    memory (read-only): :meth:`hydrate` is then DMA copies at the link's rate, no CPU copy through a
    staging ring. Registering costs ~30 ms per GB and keeps the file's pages locked in memory until
    :meth:`close` — a warm standby pays it ahead of its wake."""

    def __init__(self, path: str | os.PathLike[str], device: int):
        self.path = str(path)
        self.device = device
        self.address, self.length = native().map_file_pinned(self.path, device)

    def hydrate(self, regions: Mapping[str, StableRegion], *, layout_digest: str | None = None) -> HydrationStats:
        """Copy every extent of this pack to its (GPU) region; the same checks as :func:`hydrate_pack`."""
        items, used = _plan(self.path, regions, layout_digest)
        if any(r.backend != "cuda" or r.device != self.device for r in used.values()):
            raise HydrationError(f"a pinned pack fills regions of GPU {self.device} only")
        if not items:
            return _NOTHING
        if any(item.file_offset + item.length > self.length for item in items):
            raise HydrationError(f"{self.path} changed since it was pinned (an extent lies past its end)")
        started = time.perf_counter()
        native().copy_pinned_to_device([(self.address + i.file_offset, i.length, i.dst) for i in items], self.device)
        seconds = time.perf_counter() - started
        return HydrationStats(bytes=sum(i.length for i in items), items=len(items), seconds=seconds, threads=1,
                              chunk_bytes=0, pinned_bytes=self.length, direct=False, cached_fraction=1.0)

    def close(self) -> None:
        if self.length:
            native().unmap_file_pinned(self.address, self.length, self.device)
            self.address = self.length = 0

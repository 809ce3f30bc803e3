"""Thin typed wrapper over the native hydration engine."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Iterable, NamedTuple, Sequence

from coldsnap.memory.regions import StableRegion
from coldsnap.native import native
from coldsnap.settings import SETTINGS

__all__ = [
    "DEFAULT_THREADS",
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_RING_BYTES",
    "CopyItem",
    "HydrationError",
    "HydrationStats",
    "hydrate_items",
    "prefetch_file",
    "read_file",
]

# Tuned on the H200 host (16 cores), page cache -> GPU: the copy out of the page cache is the CPU's
# work, and the pinned ring must stay small enough to live in the last-level cache, so the DMA engine
# reads it from there instead of DRAM. 2 MiB chunks with a 96 MiB ring and 12 threads reached
# 51 GB/s; a 1 GiB ring with 16 MiB chunks stayed under 39 GB/s (benchmarks/hydrate.py).
DEFAULT_THREADS = SETTINGS.number("COLDSNAP_HYDRATE_THREADS") or min(16, max(4, (os.cpu_count() or 4) * 3 // 4))
DEFAULT_CHUNK_BYTES = SETTINGS.number("COLDSNAP_HYDRATE_CHUNK_BYTES") or 2 << 20
# The pinned ring is the only memory hydration holds, whatever the pack size.
DEFAULT_RING_BYTES = SETTINGS.number("COLDSNAP_HYDRATE_RING_BYTES") or 96 << 20
# O_DIRECT (cold file) reads are disk-bound and want large requests: their own chunk and ring bound.
DIRECT_CHUNK_BYTES = SETTINGS.number("COLDSNAP_HYDRATE_DIRECT_CHUNK_BYTES") or 16 << 20
DIRECT_RING_BYTES = SETTINGS.number("COLDSNAP_HYDRATE_DIRECT_RING_BYTES") or 512 << 20

Progress = Callable[[int, int], object]


class HydrationError(RuntimeError):
    """Hydration could not run or failed midway (bad plan, short file, I/O or CUDA error); ``cuda_code`` is the
    CUresult of the driver call that failed (None when none did)."""

    def __init__(self, message: str, cuda_code: int | None = None):
        super().__init__(message)
        self.cuda_code = cuda_code


class CopyItem(NamedTuple):
    """``length`` bytes at ``file_offset`` go to address ``dst``."""

    file_offset: int
    length: int
    dst: int


@dataclass(frozen=True)
class HydrationStats:
    bytes: int
    items: int
    seconds: float
    threads: int
    chunk_bytes: int
    pinned_bytes: int
    direct: bool
    cached_fraction: float
    """Page-cache residency of the extents before the run (-1 when not measured)."""

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def _run(path: str | os.PathLike[str], items: Sequence[CopyItem], target: str, device: int, threads: int,
         chunk_bytes: int, ring_bytes: int, direct: bool | None, allowed: list[tuple[int, int]],
         progress: Progress | None) -> HydrationStats:
    C = native()
    try:
        raw = C.hydrate(os.fspath(path), [tuple(i) for i in items], target, device, threads, chunk_bytes,
                        ring_bytes, direct, allowed, progress, DIRECT_CHUNK_BYTES, DIRECT_RING_BYTES)
    except (C.HydrationError, C.CudaError) as exc:
        raise HydrationError(str(exc), getattr(exc, "code", None)) from None
    return HydrationStats(**raw)


def hydrate_items(
    path: str | os.PathLike[str],
    items: Sequence[CopyItem],
    targets: Iterable[StableRegion],
    *,
    threads: int = DEFAULT_THREADS,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ring_bytes: int = DEFAULT_RING_BYTES,
    direct: bool | None = None,
    progress: Progress | None = None,
) -> HydrationStats:
    """Copy file extents into regions. Every destination must lie in the mapped bytes of one of
    ``targets`` (checked before the first read); all targets must share one backend and device.

    ``direct``: ``None`` (default) reads with O_DIRECT unless most of the extents are already in the
    page cache; ``True``/``False`` force O_DIRECT / buffered reads."""
    targets = list(targets)
    if not targets:
        raise HydrationError("no target regions given")
    kinds = {(t.backend, t.device) for t in targets}
    if len(kinds) != 1:
        raise HydrationError(f"target regions mix backends or devices: {sorted(kinds)}")
    backend, device = kinds.pop()
    allowed = [(t.base, t.base + t.mapped_bytes) for t in targets]
    return _run(path, items, backend, device, threads, chunk_bytes, ring_bytes, direct, allowed, progress)


def prefetch_file(path: str | os.PathLike[str], *, threads: int = DEFAULT_THREADS,
                  chunk_bytes: int = 64 << 20) -> HydrationStats:
    """Warm the page cache with the whole file (readahead in parallel); copies nothing."""
    size = os.stat(path).st_size
    return _run(path, [CopyItem(0, size, 0)], "prefetch", 0, threads, chunk_bytes, DEFAULT_RING_BYTES, False, [], None)


def read_file(path: str | os.PathLike[str], *, threads: int = DEFAULT_THREADS, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
              direct: bool | None = None) -> HydrationStats:
    """Read the whole file and drop the bytes: the raw read bandwidth of the same engine."""
    size = os.stat(path).st_size
    return _run(path, [CopyItem(0, size, 0)], "discard", 0, threads, chunk_bytes, DEFAULT_RING_BYTES, direct, [], None)

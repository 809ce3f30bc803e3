"""Stable regions (see the package docstring); the native part is ``coldsnap._C.StableRegion``."""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import threading
from typing import Any, Iterator

from coldsnap.native import native

__all__ = [
    "DISCARDED_TAGS",
    "engine_graph_pool",
    "graph_pool",
    "reserve_staging",
    "REGION_TAGS",
    "RegionError",
    "AllocationError",
    "StableRegion",
    "reserve",
    "get_region",
    "regions",
    "release_all",
    "region",
]

REGION_TAGS = ("weights", "kv_cache", "cudagraph", "runtime")

# Physical memory is mapped in chunks as allocations reach it. GPU chunks are large (few VMM handles,
# fast remap); host chunks are small (no memory committed before it is used).
DEFAULT_CHUNK_BYTES = {"cuda": 64 << 20, "host": 2 << 20}


DISCARDED_TAGS = ("kv_cache", "cudagraph")
"""Regions whose bytes a snapshot drops: KV is recomputed, graph memory is scratch between replays.
They are never packed or staged; resume maps them again and zeroes them."""


class RegionError(RuntimeError):
    """A region cannot be reserved, mapped or used as asked; ``cuda_code`` is the CUresult of the driver call
    that failed (None when none did)."""

    def __init__(self, message: str, cuda_code: int | None = None):
        super().__init__(message)
        self.cuda_code = cuda_code


class AllocationError(MemoryError):
    """An allocation inside ``with region(tag):`` failed; the message says why (raised from torch's OOM)."""


class StableRegion:
    """One tagged, reserved address range. Create with :func:`reserve`."""

    def __init__(self, handle: Any):
        self._handle = handle
        self.id: int = native().register_region(handle)
        self._pool: Any = None

    tag = property(lambda self: self._handle.tag)
    backend = property(lambda self: self._handle.backend)
    device = property(lambda self: self._handle.device)
    base = property(lambda self: self._handle.base, doc="Fixed virtual address of the region.")
    size = property(lambda self: self._handle.size, doc="Reserved bytes (a multiple of chunk_bytes).")
    chunk_bytes = property(lambda self: self._handle.chunk_bytes)
    mapped_bytes = property(lambda self: self._handle.mapped_bytes, doc="Physically backed prefix.")
    high_water = property(lambda self: self._handle.high_water, doc="Mapped bytes before the last unmap().")

    def __repr__(self) -> str:
        return (
            f"StableRegion({self.tag!r}, {self.backend}, base=0x{self.base:x}, size={self.size}, "
            f"mapped={self.mapped_bytes})"
        )

    def _call(self, method: str, *args: Any) -> Any:
        C = native()
        try:
            return getattr(self._handle, method)(*args)
        except C.RegionError as exc:
            raise RegionError(str(exc)) from None
        except C.CudaError as exc:
            raise RegionError(f"region {self.tag!r}: {exc}", exc.code) from None

    def map(self, length: int | None = None) -> None:
        """Back ``[0, length)`` with physical memory; by default what was mapped before the last
        :meth:`unmap` (or the whole region if nothing was)."""
        if length is None:
            self._call("remap") if self.high_water else self._call("map", self.size)
        else:
            self._call("map", length)

    def unmap(self) -> None:
        """Release all physical memory; the addresses stay reserved, the bytes are gone."""
        self._call("unmap")

    def zero(self, offset: int = 0, length: int | None = None) -> None:
        """Zero mapped bytes (all of them by default)."""
        self._call("zero", offset, self.mapped_bytes - offset if length is None else length)

    def allocate(self, length: int, alignment: int = 4096) -> int:
        """Sub-allocate ``length`` bytes; returns the offset (mapping memory as needed)."""
        return self._call("allocate", length, alignment)

    def deallocate(self, offset: int) -> None:
        self._call("deallocate", offset)

    def allocations(self) -> list[tuple[int, int]]:
        """``(offset, length)`` of every live allocation: the bytes a snapshot must preserve."""
        return self._call("allocations")

    def export_chunks(self) -> list[int]:
        """One POSIX file descriptor per mapped chunk, in address order, for another process's
        :meth:`adopt_chunks`; the caller closes them. Only regions from :func:`reserve_staging`."""
        return self._call("export_chunks")

    def adopt_chunks(self, fds: list[int]) -> None:
        """Map chunks another process exported (same chunk size) right after what is mapped here, all
        or nothing; the file descriptors stay open (the caller closes them). The bytes are whatever
        the exporter wrote: this is how weights hydrated outside the process arrive at their address."""
        self._call("adopt_chunks", list(fds))

    def release(self) -> None:
        """Give the address range back; the region cannot be used afterwards."""
        native().unregister_region(self._handle)
        self._call("release")

    def address(self, offset: int, length: int) -> int:
        """Absolute address of ``[offset, offset+length)``, checked to lie in the mapped bytes."""
        if offset < 0 or length < 0 or offset + length > self.mapped_bytes:
            raise RegionError(
                f"region {self.tag!r}: bytes {offset}+{length} are outside its {self.mapped_bytes} mapped bytes"
            )
        return self.base + offset

    def host_view(self, offset: int = 0, length: int | None = None) -> memoryview:
        """A writable memoryview of host-region bytes (host backend only)."""
        if self.backend != "host":
            raise RegionError(f"region {self.tag!r} is on the GPU; use tensor() or copy through the host")
        length = self.mapped_bytes - offset if length is None else length
        array = (ctypes.c_ubyte * length).from_address(self.address(offset, length))
        return memoryview(array).cast("B")

    def tensor(self, dtype: Any, shape: tuple[int, ...] | list[int], offset: int = 0) -> Any:
        """A torch tensor viewing region bytes at ``offset`` (no copy). Imports torch."""
        torch = importlib.import_module("torch")
        numel = 1
        for dim in shape:
            numel *= dim
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        address = self.address(offset, nbytes)
        if self.backend == "host":
            raw = torch.frombuffer((ctypes.c_ubyte * max(nbytes, 1)).from_address(address), dtype=torch.uint8)
        else:
            raw = torch.as_tensor(_CudaBytes(address, nbytes), device=f"cuda:{self.device}")
        return raw[:nbytes].view(dtype).view(tuple(shape))


class _CudaBytes:
    """Exposes raw device bytes to torch through the CUDA array interface."""

    def __init__(self, address: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
            "strides": None,
        }


_lock = threading.Lock()
_regions: dict[str, StableRegion] = {}


def reserve(
    tag: str,
    size: int,
    *,
    backend: str = "cuda",
    device: int = 0,
    chunk_bytes: int | None = None,
    fixed_address: int = 0,
) -> StableRegion:
    """Reserve the region for ``tag`` once per process; a second call with the same arguments returns it."""
    if tag not in REGION_TAGS:
        raise RegionError(f"unknown region tag {tag!r}; tags are {', '.join(REGION_TAGS)}")
    if backend not in DEFAULT_CHUNK_BYTES:
        raise RegionError(f"backend must be 'cuda' or 'host', not {backend!r}")
    if size <= 0:
        raise RegionError(f"region {tag!r}: size must be positive, got {size}")
    with _lock:
        existing = _regions.get(tag)
        if existing is not None:
            if existing.backend != backend or existing.device != device or existing.size < size:
                raise RegionError(
                    f"region {tag!r} is already reserved ({existing.backend}, device {existing.device}, "
                    f"{existing.size} bytes); it cannot be reserved again differently"
                )
            return existing
        C = native()
        try:
            handle = C.StableRegion(tag, backend, device, size, chunk_bytes or DEFAULT_CHUNK_BYTES[backend], fixed_address)
        except C.RegionError as exc:
            raise RegionError(str(exc)) from None
        except C.CudaError as exc:
            raise RegionError(f"region {tag!r}: {exc}", exc.code) from None
        created = _regions[tag] = StableRegion(handle)
        return created


def reserve_staging(tag: str, size: int, *, device: int = 0, chunk_bytes: int) -> StableRegion:
    """A GPU region whose chunks can be exported to another process, outside the per-tag registry
    (a launcher stages several restores one after another). ``chunk_bytes`` must be the chunk size of
    the region that will adopt the chunks. Release it when done; adopted memory lives on."""
    C = native()
    try:
        handle = C.StableRegion(tag, "cuda", device, size, chunk_bytes, 0, True)
    except C.RegionError as exc:
        raise RegionError(str(exc)) from None
    except C.CudaError as exc:
        raise RegionError(f"staging region {tag!r}: {exc}", exc.code) from None
    return StableRegion(handle)


def get_region(tag: str) -> StableRegion:
    try:
        return _regions[tag]
    except KeyError:
        raise RegionError(f"no region {tag!r} is reserved in this process") from None


def regions() -> dict[str, StableRegion]:
    return dict(_regions)


def release_all() -> None:
    """Release every region (tests and shutdown)."""
    with _lock:
        for created in _regions.values():
            created.release()
        _regions.clear()


_allocator: Any = None


def _torch_pool(created: StableRegion) -> Any:
    global _allocator
    torch = importlib.import_module("torch")
    if _allocator is None:
        C = native()
        _allocator = torch.cuda.memory.CUDAPluggableAllocator(C.__file__, C.ALLOCATOR_MALLOC, C.ALLOCATOR_FREE)
    if created._pool is None:
        created._pool = torch.cuda.MemPool(_allocator.allocator())
    return created._pool


@contextlib.contextmanager
def _allocating_in(tag: str) -> Iterator[tuple[StableRegion, Any]]:
    """The CUDA region ``tag`` active for the allocator hooks, with its torch pool; errors the native
    hook stored (it cannot raise through torch) are raised here as :class:`AllocationError`."""
    created = get_region(tag)
    if created.backend != "cuda":
        raise RegionError(f"region {tag!r} is a host region; torch pools exist only for CUDA regions")
    C = native()
    pool = _torch_pool(created)
    C.take_allocator_error()  # a stale error from elsewhere must not be blamed on this block
    previous = C.active_region()
    C.set_active_region(created.id)
    try:
        yield created, pool
    except Exception as exc:
        stored = C.take_allocator_error()
        if stored:
            raise AllocationError(f"region {tag!r}: {stored}") from exc
        raise
    finally:
        C.set_active_region(previous)
    stored = C.take_allocator_error()
    if stored:
        raise AllocationError(f"region {tag!r}: {stored}")


@contextlib.contextmanager
def region(tag: str) -> Iterator[StableRegion]:
    """Torch CUDA allocations inside the block come from the stable region ``tag``.

    Allocation failures inside the native hook cannot raise through torch; they are stored and raised
    here as :class:`AllocationError` with the hook's own message.
    """
    torch = importlib.import_module("torch")
    with _allocating_in(tag) as (created, pool):
        with torch.cuda.use_mem_pool(pool, device=torch.device("cuda", created.device)):
            yield created


@contextlib.contextmanager
def graph_pool(tag: str = "cudagraph") -> Iterator[Any]:
    """``with graph_pool() as pool: with torch.cuda.graph(g, pool=pool): ...`` puts the graph's private
    memory in the stable region ``tag``. Between replays that memory is scratch (every replay rewrites
    it before reading), so a snapshot discards it like the KV cache: the CUDA checkpoint does not copy
    it into the process image, and resume maps it again at the same addresses the graph captured."""
    with _allocating_in(tag) as (_, pool):
        yield pool.id


_retired_pools: list[Any] = []  # pools replaced by a fresh one: torch must never see them destroyed under live blocks


def engine_graph_pool(tag: str = "cudagraph", *, fresh: bool = False) -> Any:
    """The id of a torch memory pool served by the CUDA region ``tag``, for an engine that captures its
    CUDA graphs itself, later and wherever it likes (vLLM's graph managers take a pool id once, and
    capture deep inside their own code): the region becomes the allocator hooks' active one and stays so,
    so every capture into the pool lands in the region whenever it runs. Only pools on the allocator
    hooks route through the active region, so ordinary torch allocations are unaffected, and
    :func:`region` blocks still put theirs where they say and give the region back as active after.

    ``fresh``: a new pool on the same region, for captures after the graphs of the old one were
    released (torch refuses to capture into a private pool whose graphs are gone while blocks made
    during its captures are still referenced); the old pool is kept alive with what it still holds."""
    with _allocating_in(tag) as (created, pool):
        if fresh:
            _retired_pools.append(pool)
            created._pool = None
            pool = _torch_pool(created)
    native().set_active_region(created.id)  # (after the block, which gives back what was active before)
    return pool.id

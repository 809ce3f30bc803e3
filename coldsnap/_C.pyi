"""Type stub for coldsnap._C (csrc/module.cpp)."""

from typing import Callable, TypedDict, type_check_only

# The TypedDicts exist only for type checkers (the runtime returns plain dicts):
# import them under `if TYPE_CHECKING:`.

@type_check_only
class CudaDevice(TypedDict):
    ordinal: int
    name: str
    uuid: str  # "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"; "" if the driver has no UUID call
    compute_capability: str  # e.g. "9.0"
    total_memory_bytes: int
    pci_bus_id: str  # e.g. "0000:19:00.0"

@type_check_only
class CudaProbe(TypedDict):
    available: bool
    reason: str  # "" when available
    library: str  # path of the loaded libcuda, "" if it could not be loaded
    driver_version: int  # cuDriverGetVersion, e.g. 13000; 0 if unknown
    devices: list[CudaDevice]  # on a mid-enumeration failure: those fully queried
    checkpoint_api: bool
    vmm_api: bool

@type_check_only
class BuildInfo(TypedDict):
    compiler: str
    cxx_standard: int  # __cplusplus, e.g. 201703
    pybind11_version: str
    python_headers: str  # PY_VERSION compiled against
    built: str  # __DATE__ " " __TIME__ of module.cpp
    cuda_loading: str  # always "dlopen"
    cuda_library: str  # "libcuda.so.1"

class CudaError(RuntimeError):
    code: int | None  # CUresult, or None when no driver call failed (e.g. no libcuda)

def cuda_probe() -> CudaProbe: ...
def driver_version() -> int: ...
def build_info() -> BuildInfo: ...

class RegionError(RuntimeError): ...
class HydrationError(RuntimeError): ...

class StableRegion:
    """A reserved virtual address range whose physical memory can be dropped and mapped again."""

    def __init__(self, tag: str, backend: str, device: int, size: int, chunk_bytes: int, fixed_address: int = 0,
                 shareable: bool = False) -> None: ...
    @property
    def tag(self) -> str: ...
    @property
    def backend(self) -> str: ...  # "host" | "cuda"
    @property
    def device(self) -> int: ...
    @property
    def base(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def chunk_bytes(self) -> int: ...
    @property
    def granularity(self) -> int: ...
    @property
    def mapped_bytes(self) -> int: ...
    @property
    def high_water(self) -> int: ...
    @property
    def released(self) -> bool: ...
    def map(self, end: int) -> None: ...
    def remap(self) -> None: ...
    def unmap(self) -> None: ...
    def zero(self, offset: int, length: int) -> None: ...
    def release(self) -> None: ...
    def allocate(self, length: int, alignment: int) -> int: ...
    def deallocate(self, offset: int) -> None: ...
    def allocations(self) -> list[tuple[int, int]]: ...
    def export_chunks(self) -> list[int]: ...
    def adopt_chunks(self, fds: list[int]) -> None: ...

def register_region(region: StableRegion) -> int: ...
def unregister_region(region: StableRegion) -> None: ...
def set_active_region(id: int) -> None: ...
def active_region() -> int: ...
def take_allocator_error() -> str: ...

ALLOCATOR_MALLOC: str  # C symbol names for torch.cuda.memory.CUDAPluggableAllocator
ALLOCATOR_FREE: str

@type_check_only
class HydrateStats(TypedDict):
    bytes: int
    items: int
    seconds: float
    threads: int
    chunk_bytes: int
    pinned_bytes: int
    direct: bool
    cached_fraction: float  # -1 when not measured

def hydrate(
    path: str,
    items: list[tuple[int, int, int]],  # (file_offset, length, dst_address)
    target: str,  # "cuda" | "host" | "prefetch" | "discard"
    device: int = 0,
    threads: int = 8,
    chunk_bytes: int = ...,
    ring_bytes: int = ...,
    direct: bool | None = None,  # None: O_DIRECT unless the extents are mostly in the page cache
    allowed: list[tuple[int, int]] = ...,  # [lo, hi) destination ranges
    progress: Callable[[int, int], object] | None = None,  # return False to cancel
    direct_chunk_bytes: int = ...,
    direct_ring_bytes: int = ...,
) -> HydrateStats: ...
def release_pinned() -> None: ...
def pinned_bytes() -> int: ...
def copy_device_to_host(dst: int, src: int, length: int, device: int) -> None: ...
def copy_host_to_device(dst: int, src: int, length: int, device: int) -> None: ...
def checkpoint_call(op: str, pid: int, timeout_ms: int = 0, gpu_pairs: list[tuple[str, str]] = ...) -> None: ...
def checkpoint_state(pid: int) -> int: ...  # 0 running, 1 locked, 2 checkpointed, 3 failed

"""Type stub for coldsnap._C (csrc/module.cpp)."""

from typing import TypedDict, type_check_only

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

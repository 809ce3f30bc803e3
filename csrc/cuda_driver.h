// Run-time loader for the CUDA driver API (libcuda.so.1).
//
// We never link libcuda/cudart and never include cuda.h: the few types the
// calls below need are mirrored here (same ABI on Linux x86-64/aarch64), and
// every entry point is resolved with dlsym() into the DriverApi table. With no
// driver installed, the table only records why, and callers get a clear answer.
#pragma once

#include <cstddef>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace coldsnap::cuda {

// ---- Mirrored driver types (subset of cuda.h, CUDA 11.4 .. 13.x) ----------
using CUresult = int;  // enum cudaError_enum; 0 == CUDA_SUCCESS
using CUdevice = int;  // CUdevice_v1
using CUdeviceptr = unsigned long long;                   // CUdeviceptr_v2
using CUmemGenericAllocationHandle = unsigned long long;  // ..._v1
using CUdevice_attribute = int;                           // enum, int-sized
using CUmemAllocationGranularity_flags = int;             // enum, int-sized
using CUprocessState = int;                               // enum, int-sized
struct CUuuid {
  char bytes[16];
};

constexpr CUresult CUDA_SUCCESS = 0;
constexpr CUdevice_attribute CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75;
constexpr CUdevice_attribute CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76;

using CUcontext = struct CUctx_st*;
using CUstream = struct CUstream_st*;
using CUevent = struct CUevent_st*;

// VMM structs, layouts copied from cuda.h (CUDA 13.0; unchanged since 11.x).
struct CUmemLocation {
  int type;  // CUmemLocationType
  int id;
};
struct CUmemAllocationProp {
  int type;                  // CUmemAllocationType
  int requestedHandleTypes;  // CUmemAllocationHandleType
  CUmemLocation location;
  void* win32HandleMetaData;
  struct {
    unsigned char compressionType;
    unsigned char gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
  } allocFlags;
};
struct CUmemAccessDesc {
  CUmemLocation location;
  int flags;  // CUmemAccess_flags
};
constexpr int CU_MEM_LOCATION_TYPE_DEVICE = 1;
constexpr int CU_MEM_ALLOCATION_TYPE_PINNED = 1;
constexpr int CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3;
constexpr int CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0;
constexpr int CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1;
constexpr unsigned int CU_STREAM_NON_BLOCKING = 1;
constexpr unsigned int CU_EVENT_DISABLE_TIMING = 2;
constexpr unsigned int CU_MEMHOSTALLOC_PORTABLE = 1;
constexpr unsigned int CU_MEMHOSTREGISTER_PORTABLE = 1;
constexpr unsigned int CU_MEMHOSTREGISTER_READ_ONLY = 8;

// CUDA checkpoint argument structs, layouts copied from cuda.h (CUDA 13.0).
struct CUcheckpointLockArgs {
  unsigned int timeoutMs;  // 0: no timeout
  unsigned int reserved0;
  unsigned long long reserved1[7];
};
struct CUcheckpointCheckpointArgs {
  unsigned long long reserved[8];
};
struct CUcheckpointGpuPair {
  CUuuid oldUuid;
  CUuuid newUuid;
};
struct CUcheckpointRestoreArgs {
  CUcheckpointGpuPair* gpuPairs;
  unsigned int gpuPairsCount;
  char reserved[52 - sizeof(CUcheckpointGpuPair*)];
  unsigned long long reserved1;
};
struct CUcheckpointUnlockArgs {
  unsigned long long reserved[8];
};
static_assert(sizeof(CUcheckpointLockArgs) == 64, "CUcheckpointLockArgs layout");
static_assert(sizeof(CUcheckpointRestoreArgs) == 64, "CUcheckpointRestoreArgs layout");

// ---- Function pointer types: PFN_<member> ---------------------------------
// The signature is the one of the *exported symbol* named in the lists below
// (e.g. cuDeviceTotalMem_v2 takes size_t*, the legacy cuDeviceTotalMem took
// unsigned int*).
using PFN_cuGetErrorName = CUresult (*)(CUresult, const char**);
using PFN_cuGetErrorString = CUresult (*)(CUresult, const char**);
using PFN_cuInit = CUresult (*)(unsigned int);
using PFN_cuDriverGetVersion = CUresult (*)(int*);
using PFN_cuDeviceGetCount = CUresult (*)(int*);
using PFN_cuDeviceGet = CUresult (*)(CUdevice*, int);
using PFN_cuDeviceGetName = CUresult (*)(char*, int, CUdevice);
using PFN_cuDeviceGetAttribute = CUresult (*)(int*, CUdevice_attribute, CUdevice);
using PFN_cuDeviceTotalMem = CUresult (*)(std::size_t*, CUdevice);
using PFN_cuDeviceGetPCIBusId = CUresult (*)(char*, int, CUdevice);
using PFN_cuDeviceGetUuid_v2 = CUresult (*)(CUuuid*, CUdevice);
using PFN_cuDeviceGetUuid = CUresult (*)(CUuuid*, CUdevice);
// CUDA checkpoint API (recent drivers only; hence probed, never required).
using PFN_cuCheckpointProcessLock = CUresult (*)(int, CUcheckpointLockArgs*);
using PFN_cuCheckpointProcessCheckpoint = CUresult (*)(int, CUcheckpointCheckpointArgs*);
using PFN_cuCheckpointProcessRestore = CUresult (*)(int, CUcheckpointRestoreArgs*);
using PFN_cuCheckpointProcessUnlock = CUresult (*)(int, CUcheckpointUnlockArgs*);
using PFN_cuCheckpointProcessGetState = CUresult (*)(int, CUprocessState*);
// Virtual memory management (CUDA 10.2+).
using PFN_cuMemAddressReserve = CUresult (*)(CUdeviceptr*, std::size_t, std::size_t, CUdeviceptr,
                                             unsigned long long);
using PFN_cuMemCreate = CUresult (*)(CUmemGenericAllocationHandle*, std::size_t,
                                     const CUmemAllocationProp*, unsigned long long);
using PFN_cuMemMap = CUresult (*)(CUdeviceptr, std::size_t, std::size_t,
                                  CUmemGenericAllocationHandle, unsigned long long);
using PFN_cuMemSetAccess = CUresult (*)(CUdeviceptr, std::size_t, const CUmemAccessDesc*,
                                        std::size_t);
using PFN_cuMemUnmap = CUresult (*)(CUdeviceptr, std::size_t);
using PFN_cuMemRelease = CUresult (*)(CUmemGenericAllocationHandle);
using PFN_cuMemAddressFree = CUresult (*)(CUdeviceptr, std::size_t);
using PFN_cuMemExportToShareableHandle = CUresult (*)(void*, CUmemGenericAllocationHandle, int, unsigned long long);
using PFN_cuMemImportFromShareableHandle = CUresult (*)(CUmemGenericAllocationHandle*, void*, int);
using PFN_cuMemGetAllocationGranularity = CUresult (*)(std::size_t*, const CUmemAllocationProp*,
                                                       CUmemAllocationGranularity_flags);

// Contexts, copies, streams, events, pinned host memory (hydration engine).
using PFN_cuDevicePrimaryCtxRetain = CUresult (*)(CUcontext*, CUdevice);
using PFN_cuCtxGetCurrent = CUresult (*)(CUcontext*);
using PFN_cuCtxSetCurrent = CUresult (*)(CUcontext);
using PFN_cuMemsetD8 = CUresult (*)(CUdeviceptr, unsigned char, std::size_t);
using PFN_cuMemcpyHtoD = CUresult (*)(CUdeviceptr, const void*, std::size_t);
using PFN_cuMemcpyDtoH = CUresult (*)(void*, CUdeviceptr, std::size_t);
using PFN_cuMemcpyHtoDAsync = CUresult (*)(CUdeviceptr, const void*, std::size_t, CUstream);
using PFN_cuStreamCreate = CUresult (*)(CUstream*, unsigned int);
using PFN_cuStreamDestroy = CUresult (*)(CUstream);
using PFN_cuStreamSynchronize = CUresult (*)(CUstream);
using PFN_cuEventCreate = CUresult (*)(CUevent*, unsigned int);
using PFN_cuEventRecord = CUresult (*)(CUevent, CUstream);
using PFN_cuEventSynchronize = CUresult (*)(CUevent);
using PFN_cuEventDestroy = CUresult (*)(CUevent);
using PFN_cuMemHostAlloc = CUresult (*)(void**, std::size_t, unsigned int);
using PFN_cuMemFreeHost = CUresult (*)(void*);
using PFN_cuMemHostRegister = CUresult (*)(void*, std::size_t, unsigned int);
using PFN_cuMemHostUnregister = CUresult (*)(void*);
using PFN_cuMemGetInfo = CUresult (*)(std::size_t*, std::size_t*);
// Context limits (CUlimit: 0 stack bytes per thread, 1 printf FIFO, 2 device malloc heap). The stack limit
// sizes the local memory the context reserves for every resident thread, which a CUDA checkpoint copies.
using PFN_cuCtxGetLimit = CUresult (*)(std::size_t*, int);
using PFN_cuCtxSetLimit = CUresult (*)(int, std::size_t);
// Legacy CUDA IPC (cudaIpcOpenMemHandle maps a peer's allocation; the checkpoint API of driver 580
// refuses a process holding such a mapping, and vLLM's custom all-reduce never closes its own).
using PFN_cuIpcCloseMemHandle = CUresult (*)(CUdeviceptr);

// ---- Symbol lists (X-macros): X(member, "exported symbol") -----------------
// `member` is the DriverApi field (and the PFN_ suffix); the string is what
// dlsym looks up, i.e. the versioned name cuda.h's #defines would pick.
// To extend: add a PFN_ typedef above and one X(...) line to a list (or a new
// list, then add it to COLDSNAP_CUDA_ALL). Stream/memcpy functions have
// "_ptsz"/"_ptds" per-thread-stream variants; pick the symbol deliberately.

// Required: without these the driver counts as unusable.
#define COLDSNAP_CUDA_CORE(X)                     \
  X(cuInit, "cuInit")                             \
  X(cuDriverGetVersion, "cuDriverGetVersion")     \
  X(cuDeviceGetCount, "cuDeviceGetCount")         \
  X(cuDeviceGet, "cuDeviceGet")                   \
  X(cuDeviceGetName, "cuDeviceGetName")           \
  X(cuDeviceGetAttribute, "cuDeviceGetAttribute") \
  X(cuDeviceTotalMem, "cuDeviceTotalMem_v2")      \
  X(cuDeviceGetPCIBusId, "cuDeviceGetPCIBusId")

// Optional: nullptr when missing; code checks has(...) before calling.
#define COLDSNAP_CUDA_OPTIONAL(X)             \
  X(cuGetErrorName, "cuGetErrorName")         \
  X(cuGetErrorString, "cuGetErrorString")     \
  X(cuDeviceGetUuid_v2, "cuDeviceGetUuid_v2") \
  X(cuDeviceGetUuid, "cuDeviceGetUuid")         \
  X(cuIpcCloseMemHandle, "cuIpcCloseMemHandle") \
  X(cuCtxGetLimit, "cuCtxGetLimit")             \
  X(cuCtxSetLimit, "cuCtxSetLimit")

#define COLDSNAP_CUDA_CHECKPOINT(X)                                   \
  X(cuCheckpointProcessLock, "cuCheckpointProcessLock")             \
  X(cuCheckpointProcessCheckpoint, "cuCheckpointProcessCheckpoint") \
  X(cuCheckpointProcessRestore, "cuCheckpointProcessRestore")       \
  X(cuCheckpointProcessUnlock, "cuCheckpointProcessUnlock")         \
  X(cuCheckpointProcessGetState, "cuCheckpointProcessGetState")

#define COLDSNAP_CUDA_VMM(X)                          \
  X(cuMemAddressReserve, "cuMemAddressReserve")     \
  X(cuMemCreate, "cuMemCreate")                     \
  X(cuMemMap, "cuMemMap")                           \
  X(cuMemSetAccess, "cuMemSetAccess")               \
  X(cuMemUnmap, "cuMemUnmap")                       \
  X(cuMemRelease, "cuMemRelease")                   \
  X(cuMemAddressFree, "cuMemAddressFree")           \
  X(cuMemGetAllocationGranularity, "cuMemGetAllocationGranularity") \
  X(cuMemExportToShareableHandle, "cuMemExportToShareableHandle")   \
  X(cuMemImportFromShareableHandle, "cuMemImportFromShareableHandle")

// Legacy-default-stream (non _ptds/_ptsz) symbols: every copy goes to an explicit stream anyway.
#define COLDSNAP_CUDA_COPY(X)                                 \
  X(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain")     \
  X(cuCtxGetCurrent, "cuCtxGetCurrent")                       \
  X(cuCtxSetCurrent, "cuCtxSetCurrent")                       \
  X(cuMemsetD8, "cuMemsetD8_v2")                              \
  X(cuMemcpyHtoD, "cuMemcpyHtoD_v2")                          \
  X(cuMemcpyDtoH, "cuMemcpyDtoH_v2")                          \
  X(cuMemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2")                \
  X(cuStreamCreate, "cuStreamCreate")                         \
  X(cuStreamDestroy, "cuStreamDestroy_v2")                    \
  X(cuStreamSynchronize, "cuStreamSynchronize")               \
  X(cuEventCreate, "cuEventCreate")                           \
  X(cuEventRecord, "cuEventRecord")                           \
  X(cuEventSynchronize, "cuEventSynchronize")                 \
  X(cuEventDestroy, "cuEventDestroy_v2")                      \
  X(cuMemHostAlloc, "cuMemHostAlloc")                         \
  X(cuMemFreeHost, "cuMemFreeHost")                           \
  X(cuMemHostRegister, "cuMemHostRegister_v2")                \
  X(cuMemHostUnregister, "cuMemHostUnregister")               \
  X(cuMemGetInfo, "cuMemGetInfo_v2")

#define COLDSNAP_CUDA_ALL(X)  \
  COLDSNAP_CUDA_CORE(X)       \
  COLDSNAP_CUDA_OPTIONAL(X)   \
  COLDSNAP_CUDA_CHECKPOINT(X) \
  COLDSNAP_CUDA_VMM(X)        \
  COLDSNAP_CUDA_COPY(X)

// Thrown by everything below that can fail; becomes coldsnap._C.CudaError.
// code is the CUresult, or nullopt when no driver call failed (no library,
// missing symbol).
class CudaError : public std::runtime_error {
 public:
  explicit CudaError(const std::string& msg, std::optional<CUresult> code = std::nullopt)
      : std::runtime_error(msg), code_(code) {}
  std::optional<CUresult> code() const { return code_; }

 private:
  std::optional<CUresult> code_;
};

struct DriverApi {
  void* handle = nullptr;  // dlopen handle; deliberately never dlclose()d
  std::string library;     // path of the loaded object, "" if not loaded
  std::string error;       // why unusable; "" when all core symbols resolved

#define COLDSNAP_CUDA_MEMBER(member, symbol) PFN_##member member = nullptr;
  COLDSNAP_CUDA_ALL(COLDSNAP_CUDA_MEMBER)
#undef COLDSNAP_CUDA_MEMBER

  bool usable() const { return error.empty(); }
  // api.has(api.cuMemCreate, api.cuMemMap): all given entry points resolved.
  template <class... Fn>
  static bool has(Fn... fns) {
    return ((fns != nullptr) && ...);
  }
  bool has_checkpoint_api() const;
  bool has_vmm_api() const;
  bool has_copy_api() const;
  std::vector<std::string> missing_symbols() const;  // for diagnostics

  // "CUDA_ERROR_NO_DEVICE" via cuGetErrorName, else "CUresult(100)".
  std::string error_name(CUresult r) const;
  // Throws CudaError("<what> failed: <name>", r) unless r == CUDA_SUCCESS.
  void check(CUresult r, const char* what) const {
    if (r != CUDA_SUCCESS) throw CudaError(std::string(what) + " failed: " + error_name(r), r);
  }
};

// The process-wide table: loaded on first use (thread-safe), never throws.
const DriverApi& driver();
// driver() + one cuInit(0) per process (std::call_once; the result, failure
// included, is cached). Throws CudaError if either is unusable.
const DriverApi& initialized_driver();
// cuDriverGetVersion (no cuInit needed); throws CudaError without a driver.
int driver_version();
// initialized_driver() with the VMM and copy entry points present, and the
// device's primary context (retained once, never released) current on the
// calling thread. Every thread that touches device memory calls this first.
const DriverApi& use_device(int device);

// ---- Probe: plain C++ result, converted to a dict by the bindings ----------
struct DeviceInfo {
  int ordinal = 0;
  std::string name;
  std::string uuid;                // "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" or ""
  std::string compute_capability;  // "9.0"
  std::size_t total_memory_bytes = 0;
  std::string pci_bus_id;  // "0000:19:00.0"
};

struct ProbeResult {
  bool available = false;
  std::string reason;   // "" when available
  std::string library;  // "" when not loaded
  int driver_version = 0;  // CUDA API version the driver supports, e.g. 13000; 0 if unknown
  std::vector<DeviceInfo> devices;
  bool checkpoint_api = false;
  bool vmm_api = false;
};

// Never throws (except std::bad_alloc); every failure ends up in .reason.
ProbeResult probe();

}  // namespace coldsnap::cuda

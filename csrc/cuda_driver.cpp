// dlopen/dlsym loader for libcuda.so.1 and the device probe built on it.
#include "cuda_driver.h"

#include <dlfcn.h>
#include <link.h>  // struct link_map, for dlinfo(RTLD_DI_LINKMAP)

#include <cstdio>
#include <mutex>

namespace coldsnap::cuda {
namespace {

constexpr const char* kLibName = "libcuda.so.1";  // the driver's ABI soname

std::string dl_error(const char* fallback) {
  const char* e = dlerror();
  return e ? e : fallback;
}

DriverApi load() {
  DriverApi api;
  dlerror();  // clear any stale error
  // RTLD_LOCAL keeps cu* out of the global namespace. If libcuda is already in
  // the process (e.g. torch loaded it), dlopen returns that same instance.
  api.handle = dlopen(kLibName, RTLD_NOW | RTLD_LOCAL);
  if (!api.handle) {
    api.error = std::string(kLibName) + " not found: " + dl_error("dlopen failed");
    return api;
  }

  // POSIX guarantees void* -> function pointer round-trips for dlsym results.
#define COLDSNAP_CUDA_RESOLVE(member, symbol) \
  api.member = reinterpret_cast<PFN_##member>(dlsym(api.handle, symbol));
  COLDSNAP_CUDA_ALL(COLDSNAP_CUDA_RESOLVE)
#undef COLDSNAP_CUDA_RESOLVE
  dlerror();  // optional symbols may be missing; that is not an error

  // Path actually loaded: the link map knows it; dladdr() is the fallback.
  link_map* lm = nullptr;
  if (dlinfo(api.handle, RTLD_DI_LINKMAP, &lm) == 0 && lm && lm->l_name && *lm->l_name) {
    api.library = lm->l_name;
  } else if (Dl_info info{}; api.cuInit && dladdr(reinterpret_cast<void*>(api.cuInit), &info) &&
                             info.dli_fname) {
    api.library = info.dli_fname;
  } else {
    api.library = kLibName;
  }

  std::string missing;
#define COLDSNAP_CUDA_REQUIRE(member, symbol) \
  if (!api.member) missing += (missing.empty() ? "" : ", ") + std::string(symbol);
  COLDSNAP_CUDA_CORE(COLDSNAP_CUDA_REQUIRE)
#undef COLDSNAP_CUDA_REQUIRE
  if (!missing.empty()) api.error = api.library + " lacks required symbols: " + missing;
  return api;
}

// 16 raw bytes -> "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" (nvidia-smi style).
std::string format_uuid(const CUuuid& u) {
  unsigned char b[16];
  for (int i = 0; i < 16; ++i) b[i] = static_cast<unsigned char>(u.bytes[i]);
  char s[64];
  std::snprintf(s, sizeof s,
                "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
                b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13],
                b[14], b[15]);
  return s;
}

DeviceInfo query_device(const DriverApi& api, int ordinal) {
  DeviceInfo d;
  d.ordinal = ordinal;
  CUdevice dev = 0;
  api.check(api.cuDeviceGet(&dev, ordinal), "cuDeviceGet");

  char buf[256] = {};
  api.check(api.cuDeviceGetName(buf, static_cast<int>(sizeof buf) - 1, dev), "cuDeviceGetName");
  d.name = buf;

  int major = 0, minor = 0;
  api.check(api.cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev),
            "cuDeviceGetAttribute(COMPUTE_CAPABILITY_MAJOR)");
  api.check(api.cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev),
            "cuDeviceGetAttribute(COMPUTE_CAPABILITY_MINOR)");
  d.compute_capability = std::to_string(major) + "." + std::to_string(minor);

  api.check(api.cuDeviceTotalMem(&d.total_memory_bytes, dev), "cuDeviceTotalMem_v2");

  char pci[64] = {};
  api.check(api.cuDeviceGetPCIBusId(pci, static_cast<int>(sizeof pci) - 1, dev),
            "cuDeviceGetPCIBusId");
  d.pci_bus_id = pci;

  // _v2 (CUDA 11.4+) is what cuda.h maps cuDeviceGetUuid to; under MIG it
  // returns the MIG instance's UUID rather than the parent GPU's.
  CUuuid u{};
  if (api.cuDeviceGetUuid_v2) {
    api.check(api.cuDeviceGetUuid_v2(&u, dev), "cuDeviceGetUuid_v2");
    d.uuid = format_uuid(u);
  } else if (api.cuDeviceGetUuid) {
    api.check(api.cuDeviceGetUuid(&u, dev), "cuDeviceGetUuid");
    d.uuid = format_uuid(u);
  }
  return d;
}

}  // namespace

bool DriverApi::has_checkpoint_api() const {
#define COLDSNAP_CUDA_AND(member, symbol) &&member != nullptr
  return handle != nullptr COLDSNAP_CUDA_CHECKPOINT(COLDSNAP_CUDA_AND);
}

bool DriverApi::has_vmm_api() const {
  return handle != nullptr COLDSNAP_CUDA_VMM(COLDSNAP_CUDA_AND);
}

bool DriverApi::has_copy_api() const {
  return handle != nullptr COLDSNAP_CUDA_COPY(COLDSNAP_CUDA_AND);
#undef COLDSNAP_CUDA_AND
}

std::vector<std::string> DriverApi::missing_symbols() const {
  std::vector<std::string> out;
  if (!handle) return out;
#define COLDSNAP_CUDA_MISSING(member, symbol) \
  if (!member) out.emplace_back(symbol);
  COLDSNAP_CUDA_ALL(COLDSNAP_CUDA_MISSING)
#undef COLDSNAP_CUDA_MISSING
  return out;
}

std::string DriverApi::error_name(CUresult r) const {
  const char* name = nullptr;
  if (cuGetErrorName && cuGetErrorName(r, &name) == CUDA_SUCCESS && name) return name;
  return "CUresult(" + std::to_string(r) + ")";
}

const DriverApi& driver() {
  static const DriverApi api = load();  // C++11 magic static: loaded once, thread-safe
  return api;
}

const DriverApi& initialized_driver() {
  const DriverApi& api = driver();
  if (!api.usable()) throw CudaError(api.error);
  // cuInit's failure is sticky inside the driver too, so caching it is honest.
  static std::once_flag once;
  static CUresult init_rc = CUDA_SUCCESS;
  std::call_once(once, [&api] { init_rc = api.cuInit(0); });
  api.check(init_rc, "cuInit");
  return api;
}

int driver_version() {
  const DriverApi& api = driver();
  if (!api.usable()) throw CudaError(api.error);
  int v = 0;
  api.check(api.cuDriverGetVersion(&v), "cuDriverGetVersion");
  return v;
}

const DriverApi& use_device(int device) {
  const DriverApi& api = initialized_driver();
  if (!api.has_vmm_api() || !api.has_copy_api()) {
    std::string missing;
    for (const auto& m : api.missing_symbols()) missing += " " + m;
    throw CudaError(api.library + " lacks entry points coldsnap needs:" + missing);
  }
  // The primary context is the one torch uses, so regions and torch tensors share it.
  static std::mutex mutex;
  static std::vector<CUcontext> contexts;
  CUcontext ctx = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (device < 0) throw CudaError("invalid device ordinal " + std::to_string(device));
    if (static_cast<std::size_t>(device) >= contexts.size()) contexts.resize(device + 1, nullptr);
    if (!contexts[device]) {
      CUdevice dev = 0;
      api.check(api.cuDeviceGet(&dev, device), "cuDeviceGet");
      api.check(api.cuDevicePrimaryCtxRetain(&contexts[device], dev), "cuDevicePrimaryCtxRetain");
    }
    ctx = contexts[device];
  }
  CUcontext current = nullptr;
  api.check(api.cuCtxGetCurrent(&current), "cuCtxGetCurrent");
  if (current != ctx) api.check(api.cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
  return api;
}

ProbeResult probe() {
  ProbeResult out;
  try {
    const DriverApi& api = driver();
    out.library = api.library;
    out.checkpoint_api = api.has_checkpoint_api();
    out.vmm_api = api.has_vmm_api();
    // Works before (and even without a successful) cuInit; 0 if unavailable.
    if (api.cuDriverGetVersion && api.cuDriverGetVersion(&out.driver_version) != CUDA_SUCCESS)
      out.driver_version = 0;

    initialized_driver();  // throws with the reason: no library / symbols / cuInit error
    int count = 0;
    api.check(api.cuDeviceGetCount(&count), "cuDeviceGetCount");
    for (int i = 0; i < count; ++i) out.devices.push_back(query_device(api, i));
    out.available = true;
  } catch (const std::exception& e) {
    // A failure mid-enumeration keeps the devices already fully queried.
    out.available = false;
    out.reason = e.what();
  }
  return out;
}

}  // namespace coldsnap::cuda

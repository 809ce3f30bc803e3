// dlopen/dlsym bridge to NCCL: unique ids, communicator init/finalize/destroy/abort, all-reduce.
#include "nccl_bridge.h"

#include <dlfcn.h>
#include <link.h>

#include <cstring>
#include <map>
#include <mutex>

#include "cuda_driver.h"

namespace coldsnap::nccl {
namespace {

using PFN_ncclGetVersion = ncclResult_t (*)(int*);
using PFN_ncclGetErrorString = const char* (*)(ncclResult_t);
using PFN_ncclGetLastError = const char* (*)(ncclComm_t);
using PFN_ncclGetUniqueId = ncclResult_t (*)(ncclUniqueId*);
using PFN_ncclCommInitRank = ncclResult_t (*)(ncclComm_t*, int, ncclUniqueId, int);
using PFN_ncclCommFinalize = ncclResult_t (*)(ncclComm_t);
using PFN_ncclCommDestroy = ncclResult_t (*)(ncclComm_t);
using PFN_ncclCommAbort = ncclResult_t (*)(ncclComm_t);
using PFN_ncclCommGetAsyncError = ncclResult_t (*)(ncclComm_t, ncclResult_t*);
using PFN_ncclAllReduce = ncclResult_t (*)(const void*, void*, std::size_t, int, int, ncclComm_t, void*);

struct Api {
  void* handle = nullptr;
  std::string library;
  int version = 0;
  PFN_ncclGetVersion getVersion = nullptr;
  PFN_ncclGetErrorString getErrorString = nullptr;
  PFN_ncclGetLastError getLastError = nullptr;  // 2.13+
  PFN_ncclGetUniqueId getUniqueId = nullptr;
  PFN_ncclCommInitRank commInitRank = nullptr;
  PFN_ncclCommFinalize commFinalize = nullptr;
  PFN_ncclCommDestroy commDestroy = nullptr;
  PFN_ncclCommAbort commAbort = nullptr;
  PFN_ncclCommGetAsyncError commGetAsyncError = nullptr;
  PFN_ncclAllReduce allReduce = nullptr;

  std::string describe(ncclResult_t r, ncclComm_t comm = nullptr) const {
    static const char* names[] = {"ncclSuccess",       "ncclUnhandledCudaError", "ncclSystemError",
                                  "ncclInternalError", "ncclInvalidArgument",    "ncclInvalidUsage",
                                  "ncclRemoteError",   "ncclInProgress"};
    std::string text = (r >= 0 && r < 8) ? names[r] : "ncclResult(" + std::to_string(r) + ")";
    if (getErrorString) text += std::string(" (") + getErrorString(r) + ")";
    if (getLastError) {
      const char* last = getLastError(comm);
      if (last && *last) text += std::string(": ") + last;
    }
    return text;
  }
  void check(ncclResult_t r, const char* what, ncclComm_t comm = nullptr) const {
    if (r != ncclSuccess) throw NcclError(std::string(what) + " failed: " + describe(r, comm), r);
  }
};

std::mutex g_mutex;
Api g_api;  // loaded once; the handle is never dlclose()d

const Api& api() {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (!g_api.handle) throw NcclError("NCCL is not loaded (call nccl_load first)");
  return g_api;
}

template <class Fn>
Fn resolve(void* handle, const char* symbol, bool required, std::string& missing) {
  auto fn = reinterpret_cast<Fn>(dlsym(handle, symbol));
  if (!fn && required) missing += (missing.empty() ? "" : ", ") + std::string(symbol);
  return fn;
}

ncclComm_t as_comm(std::uintptr_t comm) {
  if (!comm) throw NcclError("not a communicator (0)");
  return reinterpret_cast<ncclComm_t>(comm);
}

int parse_dtype(const std::string& name) {
  static const std::map<std::string, int> codes = {{"int8", 0},    {"uint8", 1},   {"int32", 2},
                                                   {"uint32", 3},  {"int64", 4},   {"uint64", 5},
                                                   {"float16", 6}, {"float32", 7}, {"float64", 8},
                                                   {"bfloat16", 9}};
  auto it = codes.find(name);
  if (it == codes.end()) throw std::invalid_argument("NCCL has no data type " + name);
  return it->second;
}

int parse_op(const std::string& name) {
  static const std::map<std::string, int> codes = {{"sum", 0}, {"prod", 1}, {"max", 2}, {"min", 3}};
  auto it = codes.find(name);
  if (it == codes.end()) throw std::invalid_argument("NCCL has no reduction " + name);
  return it->second;
}

}  // namespace

std::string version_string(int code) {
  int major = code >= 10000 ? code / 10000 : code / 1000;
  int minor = code >= 10000 ? (code / 100) % 100 : (code / 100) % 10;
  int patch = code % 100;
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(patch);
}

LoadInfo load(const std::string& library) {
  std::lock_guard<std::mutex> lock(g_mutex);
  const std::string name = library.empty() ? "libnccl.so.2" : library;
  if (g_api.handle) {
    if (!library.empty() && library != g_api.library && name != "libnccl.so.2") {
      void* other = dlopen(name.c_str(), RTLD_NOW | RTLD_NOLOAD);
      bool same = other == g_api.handle;
      if (other) dlclose(other);
      if (!same) throw NcclError("NCCL is already loaded from " + g_api.library + ", not " + name);
    }
    return {g_api.library, g_api.version};
  }
  dlerror();
  // RTLD_NOLOAD first: the engine's torch normally loaded NCCL already; this returns that instance.
  void* handle = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
  if (!handle) handle = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!handle) {
    const char* e = dlerror();
    throw NcclError(name + " cannot be loaded: " + (e ? e : "dlopen failed"));
  }
  Api api;
  api.handle = handle;
  std::string missing;
  api.getVersion = resolve<PFN_ncclGetVersion>(handle, "ncclGetVersion", true, missing);
  api.getErrorString = resolve<PFN_ncclGetErrorString>(handle, "ncclGetErrorString", true, missing);
  api.getLastError = resolve<PFN_ncclGetLastError>(handle, "ncclGetLastError", false, missing);
  api.getUniqueId = resolve<PFN_ncclGetUniqueId>(handle, "ncclGetUniqueId", true, missing);
  api.commInitRank = resolve<PFN_ncclCommInitRank>(handle, "ncclCommInitRank", true, missing);
  api.commFinalize = resolve<PFN_ncclCommFinalize>(handle, "ncclCommFinalize", true, missing);
  api.commDestroy = resolve<PFN_ncclCommDestroy>(handle, "ncclCommDestroy", true, missing);
  api.commAbort = resolve<PFN_ncclCommAbort>(handle, "ncclCommAbort", true, missing);
  api.commGetAsyncError = resolve<PFN_ncclCommGetAsyncError>(handle, "ncclCommGetAsyncError", true, missing);
  api.allReduce = resolve<PFN_ncclAllReduce>(handle, "ncclAllReduce", true, missing);
  link_map* lm = nullptr;
  api.library = (dlinfo(handle, RTLD_DI_LINKMAP, &lm) == 0 && lm && lm->l_name && *lm->l_name) ? lm->l_name : name;
  if (!missing.empty()) {
    dlclose(handle);
    throw NcclError(api.library + " lacks NCCL entry points: " + missing);
  }
  api.check(api.getVersion(&api.version), "ncclGetVersion");
  if (api.version < kMinimumVersion) {
    dlclose(handle);
    throw NcclError(api.library + " is NCCL " + version_string(api.version) + "; coldsnap needs " +
                    version_string(kMinimumVersion) + " or newer");
  }
  g_api = api;
  return {g_api.library, g_api.version};
}

std::string unique_id() {
  const Api& a = api();
  ncclUniqueId id{};
  a.check(a.getUniqueId(&id), "ncclGetUniqueId");
  return std::string(id.internal, sizeof id.internal);
}

std::uintptr_t comm_init(const std::string& id, int world, int rank, int device) {
  const Api& a = api();
  if (id.size() != sizeof(ncclUniqueId)) {
    throw std::invalid_argument("an NCCL unique id is 128 bytes, not " + std::to_string(id.size()));
  }
  if (world < 1 || rank < 0 || rank >= world) {
    throw std::invalid_argument("rank " + std::to_string(rank) + " is not in a world of " + std::to_string(world));
  }
  // NCCL picks the device from the calling thread's current context (cudaGetDevice): make the
  // device's primary context — the one torch uses — current, as an agent thread has none.
  cuda::use_device(device);
  ncclUniqueId unique{};
  std::memcpy(unique.internal, id.data(), sizeof unique.internal);
  ncclComm_t comm = nullptr;
  a.check(a.commInitRank(&comm, world, unique, rank), "ncclCommInitRank");
  return reinterpret_cast<std::uintptr_t>(comm);
}

void comm_finalize(std::uintptr_t comm) {
  const Api& a = api();
  ncclComm_t c = as_comm(comm);
  a.check(a.commFinalize(c), "ncclCommFinalize", c);
  // Blocking communicators finish inside the call; a non-blocking one reports InProgress until done.
  ncclResult_t state = ncclInProgress;
  while (state == ncclInProgress) a.check(a.commGetAsyncError(c, &state), "ncclCommGetAsyncError", c);
  a.check(state, "ncclCommFinalize (async)", c);
}

void comm_destroy(std::uintptr_t comm) {
  const Api& a = api();
  a.check(a.commDestroy(as_comm(comm)), "ncclCommDestroy");
}

void comm_abort(std::uintptr_t comm) {
  const Api& a = api();
  a.check(a.commAbort(as_comm(comm)), "ncclCommAbort");
}

std::string comm_async_error(std::uintptr_t comm) {
  const Api& a = api();
  ncclComm_t c = as_comm(comm);
  ncclResult_t state = ncclSuccess;
  a.check(a.commGetAsyncError(c, &state), "ncclCommGetAsyncError", c);
  return state == ncclSuccess || state == ncclInProgress ? "" : a.describe(state, c);
}

void all_reduce(std::uintptr_t comm, std::uintptr_t send, std::uintptr_t recv, std::uint64_t count,
                const std::string& dtype, const std::string& op, std::uintptr_t stream) {
  const Api& a = api();
  ncclComm_t c = as_comm(comm);
  a.check(a.allReduce(reinterpret_cast<const void*>(send), reinterpret_cast<void*>(recv), count, parse_dtype(dtype),
                      parse_op(op), c, reinterpret_cast<void*>(stream)),
          "ncclAllReduce", c);
}

}  // namespace coldsnap::nccl

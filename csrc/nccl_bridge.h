// Run-time loader for NCCL (libnccl.so.2) and the communicator calls coldsnap needs.
//
// As with libcuda, nothing links NCCL and nccl.h is never included: the handful of types below are
// mirrored from nccl.h (stable ABI since NCCL 2.x) and each entry point is resolved with dlsym() from
// the library the caller names — the one the engine's torch already loaded, so both share one NCCL.
// Every failure is a NcclError carrying the ncclResult_t; nothing here ends the process.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>

namespace coldsnap::nccl {

using ncclResult_t = int;  // enum; 0 == ncclSuccess
using ncclComm_t = struct ncclComm*;
struct ncclUniqueId {
  char internal[128];  // NCCL_UNIQUE_ID_BYTES
};
static_assert(sizeof(ncclUniqueId) == 128, "ncclUniqueId layout");

constexpr ncclResult_t ncclSuccess = 0;
constexpr ncclResult_t ncclInProgress = 7;

// The oldest NCCL whose communicator teardown (ncclCommFinalize + ncclCommDestroy) we rely on.
constexpr int kMinimumVersion = 21400;  // 2.14.0

class NcclError : public std::runtime_error {
 public:
  explicit NcclError(const std::string& msg, std::optional<ncclResult_t> code = std::nullopt)
      : std::runtime_error(msg), code_(code) {}
  std::optional<ncclResult_t> code() const { return code_; }

 private:
  std::optional<ncclResult_t> code_;
};

struct LoadInfo {
  std::string library;  // path actually loaded
  int version = 0;      // ncclGetVersion code, e.g. 22703
};

// dlopen `library` ("" → "libnccl.so.2") once per process and resolve the entry points; later calls
// with another path are refused (one NCCL per process). Throws NcclError (missing library or
// symbol, version below kMinimumVersion).
LoadInfo load(const std::string& library);
// "2.27.3" from 22703 (and the pre-2.9 scheme 2708 → "2.7.8").
std::string version_string(int code);

std::string unique_id();  // 128 raw bytes (ncclGetUniqueId)
// ncclCommInitRank on `device` (its primary context made current first, as torch's is).
std::uintptr_t comm_init(const std::string& id, int world, int rank, int device);
void comm_finalize(std::uintptr_t comm);  // flush outstanding work (collective across ranks)
void comm_destroy(std::uintptr_t comm);
void comm_abort(std::uintptr_t comm);     // local, never blocks on peers
std::string comm_async_error(std::uintptr_t comm);  // "" when none
// dtype: float16 | bfloat16 | float32 | float64 | int32 | int64 | uint8 | int8; op: sum | max | min | prod.
void all_reduce(std::uintptr_t comm, std::uintptr_t send, std::uintptr_t recv, std::uint64_t count,
                const std::string& dtype, const std::string& op, std::uintptr_t stream);

}  // namespace coldsnap::nccl

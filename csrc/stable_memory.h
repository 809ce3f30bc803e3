// Stable regions: one virtual address range per tag, reserved once, whose physical backing can be
// released and mapped again at the same address (what survives a process snapshot is the address
// reservation, not the bytes). Two backends with the same behaviour:
//   cuda: cuMemAddressReserve + cuMemCreate/cuMemMap/cuMemSetAccess per chunk (VMM);
//   host: mmap(PROT_NONE, MAP_NORESERVE) reservation + MAP_FIXED read-write chunks; unmapping maps
//         PROT_NONE again, which drops the pages (CRIU then dumps no bytes for the range).
// Physical memory is mapped chunk by chunk as allocations reach it, up to the reserved size.
#pragma once

#include <cstdint>
#include <map>
#include <stdexcept>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "cuda_driver.h"

namespace coldsnap::memory {

enum class Backend { Host, Cuda };

class RegionError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class StableRegion {
 public:
  // Reserves `size` bytes (rounded up to the chunk size). `fixed_address` != 0 demands exactly that
  // address (fails if it is taken). `chunk_bytes` is rounded up to the backend's granularity.
  // `shareable` (cuda): chunks are created exportable as POSIX file descriptors (export_chunks).
  StableRegion(std::string tag, Backend backend, int device, std::uint64_t size,
               std::uint64_t chunk_bytes, std::uint64_t fixed_address, bool shareable = false);
  ~StableRegion();
  StableRegion(const StableRegion&) = delete;
  StableRegion& operator=(const StableRegion&) = delete;

  const std::string& tag() const { return tag_; }
  Backend backend() const { return backend_; }
  int device() const { return device_; }
  std::uint64_t base() const { return base_; }
  std::uint64_t size() const { return size_; }
  std::uint64_t chunk_bytes() const { return chunk_; }
  std::uint64_t granularity() const { return granularity_; }
  std::uint64_t mapped_bytes() const;  // physically backed prefix [0, mapped_bytes)
  bool released() const { return base_ == 0; }

  // Physical backing of [0, end) (rounded up to chunks). Idempotent.
  void map(std::uint64_t end);
  // Map again what was mapped before the last unmap() (the high-water mark).
  void remap();
  // Drop all physical memory, keep the address range. Bytes are lost.
  void unmap();
  void zero(std::uint64_t offset, std::uint64_t length);
  // Give the address range back (the region is unusable afterwards).
  void release();

  // Cross-process hand-over of physical memory (cuda). export_chunks: one POSIX file descriptor per
  // mapped chunk, in address order; the caller owns and closes them (needs shareable). adopt_chunks:
  // map chunks another process exported, with this region's chunk size, right after what is mapped
  // here; all or nothing. The memory lives until every process holding it has unmapped it.
  std::vector<int> export_chunks() const;
  void adopt_chunks(const std::vector<int>& fds);

  // Sub-allocation inside the region (first fit, coalescing free list). Maps as needed.
  // Returns the offset; throws RegionError when the region is exhausted.
  std::uint64_t allocate(std::uint64_t length, std::uint64_t alignment);
  void deallocate(std::uint64_t offset);
  std::vector<std::pair<std::uint64_t, std::uint64_t>> allocations() const;
  std::uint64_t high_water() const { return high_water_; }

 private:
  void map_chunks_locked(std::uint64_t end);
  void set_access_locked(std::size_t first_chunk);  // cuda: read-write access from first_chunk on
  void give_back_locked(std::size_t first_chunk);   // cuda: unmap + release chunks from first_chunk on
  void unmap_locked();
  void check_live() const;

  std::string tag_;
  Backend backend_;
  int device_;
  bool shareable_ = false;
  std::uint64_t base_ = 0;
  std::uint64_t size_ = 0;
  std::uint64_t chunk_ = 0;
  std::uint64_t granularity_ = 0;
  std::vector<std::uint64_t> handles_;  // one per mapped chunk (cuda: CUmemGenericAllocationHandle)
  std::uint64_t high_water_ = 0;        // mapped bytes before the last unmap
  std::map<std::uint64_t, std::uint64_t> free_;  // offset -> length
  std::map<std::uint64_t, std::uint64_t> used_;  // offset -> length
  mutable std::mutex mutex_;
};

// Process-wide table the torch allocator hooks consult.
int register_region(StableRegion* region);  // returns id
void unregister_region(StableRegion* region);
void set_active_region(int id);  // -1: none
int active_region();
// The last error a C hook could not throw; "" when none. Clears it.
std::string take_allocator_error();

}  // namespace coldsnap::memory

// C ABI for torch.cuda.memory.CUDAPluggableAllocator (same signatures vLLM's CuMemAllocator uses).
extern "C" {
__attribute__((visibility("default"))) void* coldsnap_region_malloc(long size, int device, void* stream);
__attribute__((visibility("default"))) void coldsnap_region_free(void* ptr, long size, int device, void* stream);
}

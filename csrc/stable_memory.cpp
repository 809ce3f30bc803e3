#include "stable_memory.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <algorithm>
#include <cstdint>
#include <cstring>

namespace coldsnap::memory {
namespace {

using cuda::CUdeviceptr;
using cuda::CUmemAccessDesc;
using cuda::CUmemAllocationProp;
using cuda::CUmemGenericAllocationHandle;

std::uint64_t round_up(std::uint64_t v, std::uint64_t a) { return (v + a - 1) / a * a; }

std::string errno_text(const char* what) {
  return std::string(what) + ": " + std::strerror(errno);
}

CUmemAllocationProp device_prop(int device, bool shareable = false) {
  CUmemAllocationProp prop{};
  prop.type = cuda::CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = cuda::CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  if (shareable) prop.requestedHandleTypes = cuda::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return prop;
}

}  // namespace

StableRegion::StableRegion(std::string tag, Backend backend, int device, std::uint64_t size,
                           std::uint64_t chunk_bytes, std::uint64_t fixed_address, bool shareable)
    : tag_(std::move(tag)), backend_(backend), device_(device), shareable_(shareable && backend == Backend::Cuda) {
  if (size == 0) throw RegionError("region '" + tag_ + "': size must be > 0");
  if (backend_ == Backend::Host) {
    granularity_ = static_cast<std::uint64_t>(sysconf(_SC_PAGESIZE));
  } else {
    const auto& api = cuda::use_device(device_);
    CUmemAllocationProp prop = device_prop(device_);
    std::size_t g = 0;
    api.check(api.cuMemGetAllocationGranularity(&g, &prop, cuda::CU_MEM_ALLOC_GRANULARITY_MINIMUM),
              "cuMemGetAllocationGranularity");
    granularity_ = g;
  }
  chunk_ = round_up(chunk_bytes ? chunk_bytes : granularity_, granularity_);
  size_ = round_up(size, chunk_);
  if (fixed_address % granularity_) throw RegionError("region '" + tag_ + "': fixed address not aligned");

  if (backend_ == Backend::Host) {
    int flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;
    if (fixed_address) flags |= MAP_FIXED_NOREPLACE;
    void* p = mmap(reinterpret_cast<void*>(fixed_address), size_, PROT_NONE, flags, -1, 0);
    if (p == MAP_FAILED && errno == EEXIST) throw RegionError("region '" + tag_ + "': fixed address is taken");
    if (p == MAP_FAILED) throw RegionError("region '" + tag_ + "': " + errno_text("mmap reserve"));
    if (fixed_address && reinterpret_cast<std::uint64_t>(p) != fixed_address) {
      munmap(p, size_);  // kernels before 4.17 ignore MAP_FIXED_NOREPLACE and treat it as a hint
      throw RegionError("region '" + tag_ + "': fixed address is taken");
    }
    base_ = reinterpret_cast<std::uint64_t>(p);
  } else {
    const auto& api = cuda::use_device(device_);
    CUdeviceptr p = 0;
    api.check(api.cuMemAddressReserve(&p, size_, granularity_, fixed_address, 0), "cuMemAddressReserve");
    if (fixed_address && p != fixed_address) {
      api.cuMemAddressFree(p, size_);
      throw RegionError("region '" + tag_ + "': fixed device address is taken");
    }
    base_ = p;
  }
  free_[0] = size_;
}

StableRegion::~StableRegion() {
  // The allocator hooks must never see a destroyed region: a region dropped without release() would
  // otherwise stay in their table as a dangling pointer.
  try {
    unregister_region(this);
    release();
  } catch (...) {
    // Destructors must not throw; the address range leaks, which is harmless at exit.
  }
}

void StableRegion::check_live() const {
  if (base_ == 0) throw RegionError("region '" + tag_ + "' was released");
}

std::uint64_t StableRegion::mapped_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return handles_.size() * chunk_;
}

void StableRegion::map_chunks_locked(std::uint64_t end) {
  check_live();
  if (end > size_) {
    throw RegionError("region '" + tag_ + "': mapping " + std::to_string(end) + " bytes exceeds its " +
                      std::to_string(size_));
  }
  const std::uint64_t want = round_up(end, chunk_) / chunk_;
  const std::size_t first_new = handles_.size();
  // CUDA chunks get their access in one call after the loop (each call updates the GPU's page
  // tables: 16 GiB in 64 MiB chunks would be 256 calls); a failure gives back every chunk this call
  // mapped, so no chunk is ever left mapped without access.
  try {
    while (handles_.size() < want) {
      const std::uint64_t offset = handles_.size() * chunk_;
      if (backend_ == Backend::Host) {
        void* p = mmap(reinterpret_cast<void*>(base_ + offset), chunk_, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
        if (p == MAP_FAILED) throw RegionError("region '" + tag_ + "': " + errno_text("mmap map"));
        handles_.push_back(0);
      } else {
        const auto& api = cuda::use_device(device_);
        CUmemAllocationProp prop = device_prop(device_, shareable_);
        CUmemGenericAllocationHandle h = 0;
        api.check(api.cuMemCreate(&h, chunk_, &prop, 0), "cuMemCreate");
        cuda::CUresult rc = api.cuMemMap(base_ + offset, chunk_, 0, h, 0);
        if (rc != cuda::CUDA_SUCCESS) {
          api.cuMemRelease(h);
          api.check(rc, "cuMemMap");
        }
        handles_.push_back(h);
      }
    }
    if (backend_ == Backend::Cuda) set_access_locked(first_new);
  } catch (...) {
    give_back_locked(first_new);
    throw;
  }
  if (handles_.size() * chunk_ > high_water_) high_water_ = handles_.size() * chunk_;
}

void StableRegion::set_access_locked(std::size_t first_chunk) {
  if (handles_.size() <= first_chunk) return;
  const auto& api = cuda::use_device(device_);
  CUmemAccessDesc access{};
  access.location.type = cuda::CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device_;
  access.flags = cuda::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  api.check(api.cuMemSetAccess(base_ + first_chunk * chunk_, (handles_.size() - first_chunk) * chunk_, &access, 1),
            "cuMemSetAccess");
}

void StableRegion::give_back_locked(std::size_t first_chunk) {
  if (backend_ != Backend::Cuda) return;  // host chunks are usable as mapped; unmap() drops them
  const auto& api = cuda::use_device(device_);
  for (std::size_t i = first_chunk; i < handles_.size(); ++i) {
    api.cuMemUnmap(base_ + i * chunk_, chunk_);
    api.cuMemRelease(handles_[i]);
  }
  handles_.resize(std::min(handles_.size(), first_chunk));
}

std::vector<int> StableRegion::export_chunks() const {
  std::lock_guard<std::mutex> lock(mutex_);
  check_live();
  if (!shareable_) throw RegionError("region '" + tag_ + "': not created shareable (cuda, shareable=True)");
  const auto& api = cuda::use_device(device_);
  std::vector<int> fds;
  fds.reserve(handles_.size());
  for (const auto h : handles_) {
    int fd = -1;
    const cuda::CUresult rc = api.cuMemExportToShareableHandle(&fd, h, cuda::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    if (rc != cuda::CUDA_SUCCESS) {
      for (int open_fd : fds) close(open_fd);
      api.check(rc, "cuMemExportToShareableHandle");
    }
    fds.push_back(fd);
  }
  return fds;
}

void StableRegion::adopt_chunks(const std::vector<int>& fds) {
  std::lock_guard<std::mutex> lock(mutex_);
  check_live();
  if (backend_ != Backend::Cuda) throw RegionError("region '" + tag_ + "': only cuda regions adopt exported chunks");
  if ((handles_.size() + fds.size()) * chunk_ > size_) {
    throw RegionError("region '" + tag_ + "': " + std::to_string(fds.size()) + " adopted chunks of " +
                      std::to_string(chunk_) + " bytes exceed its " + std::to_string(size_));
  }
  const std::size_t first_new = handles_.size();
  const auto& api = cuda::use_device(device_);
  try {
    for (const int fd : fds) {
      CUmemGenericAllocationHandle h = 0;
      api.check(api.cuMemImportFromShareableHandle(&h, reinterpret_cast<void*>(static_cast<std::intptr_t>(fd)),
                                                   cuda::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                "cuMemImportFromShareableHandle");
      // A chunk of another size fails here (the mapping must cover the whole allocation).
      const cuda::CUresult rc = api.cuMemMap(base_ + handles_.size() * chunk_, chunk_, 0, h, 0);
      if (rc != cuda::CUDA_SUCCESS) {
        api.cuMemRelease(h);
        api.check(rc, "cuMemMap (adopted chunk)");
      }
      handles_.push_back(h);
    }
    set_access_locked(first_new);
  } catch (...) {
    give_back_locked(first_new);
    throw;
  }
  if (handles_.size() * chunk_ > high_water_) high_water_ = handles_.size() * chunk_;
}

void StableRegion::map(std::uint64_t end) {
  std::lock_guard<std::mutex> lock(mutex_);
  map_chunks_locked(end);
}

void StableRegion::remap() {
  std::lock_guard<std::mutex> lock(mutex_);
  map_chunks_locked(high_water_);
}

void StableRegion::unmap_locked() {
  if (handles_.empty()) return;
  const std::uint64_t mapped = handles_.size() * chunk_;
  if (backend_ == Backend::Host) {
    // PROT_NONE again over the same range: the pages are freed, the reservation stays.
    void* p = mmap(reinterpret_cast<void*>(base_), mapped, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
    if (p == MAP_FAILED) throw RegionError("region '" + tag_ + "': " + errno_text("mmap unmap"));
    handles_.clear();
    return;
  }
  const auto& api = cuda::use_device(device_);
  while (!handles_.empty()) {
    const std::uint64_t offset = (handles_.size() - 1) * chunk_;
    api.check(api.cuMemUnmap(base_ + offset, chunk_), "cuMemUnmap");
    api.check(api.cuMemRelease(handles_.back()), "cuMemRelease");
    handles_.pop_back();
  }
}

void StableRegion::unmap() {
  std::lock_guard<std::mutex> lock(mutex_);
  check_live();
  unmap_locked();
}

void StableRegion::zero(std::uint64_t offset, std::uint64_t length) {
  std::lock_guard<std::mutex> lock(mutex_);
  check_live();
  if (offset + length > handles_.size() * chunk_ || offset + length < offset) {
    throw RegionError("region '" + tag_ + "': zero range is outside the mapped bytes");
  }
  if (length == 0) return;
  if (backend_ == Backend::Host) {
    // Whole pages are dropped instead of written: private anonymous memory reads back as zeros after
    // MADV_DONTNEED, and the pages stay out of the resident set (zeroing a 1 GiB KV cache with
    // memset took 0.5-0.9 s and made all of it resident). Only the unaligned edges are written.
    const std::uint64_t page = static_cast<std::uint64_t>(sysconf(_SC_PAGESIZE));
    const std::uint64_t begin = base_ + offset, end = begin + length;
    const std::uint64_t inner_begin = round_up(begin, page), inner_end = end / page * page;
    if (inner_begin < inner_end &&
        madvise(reinterpret_cast<void*>(inner_begin), inner_end - inner_begin, MADV_DONTNEED) == 0) {
      std::memset(reinterpret_cast<void*>(begin), 0, inner_begin - begin);
      std::memset(reinterpret_cast<void*>(inner_end), 0, end - inner_end);
    } else {
      std::memset(reinterpret_cast<void*>(begin), 0, length);
    }
  } else {
    const auto& api = cuda::use_device(device_);
    api.check(api.cuMemsetD8(base_ + offset, 0, length), "cuMemsetD8");
  }
}

void StableRegion::release() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (base_ == 0) return;
  unmap_locked();
  if (backend_ == Backend::Host) {
    munmap(reinterpret_cast<void*>(base_), size_);
  } else {
    const auto& api = cuda::use_device(device_);
    api.check(api.cuMemAddressFree(base_, size_), "cuMemAddressFree");
  }
  base_ = 0;
}

std::uint64_t StableRegion::allocate(std::uint64_t length, std::uint64_t alignment) {
  std::lock_guard<std::mutex> lock(mutex_);
  check_live();
  if (length == 0) length = 1;
  if (alignment == 0 || (alignment & (alignment - 1))) throw RegionError("alignment must be a power of two");
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    const std::uint64_t start = round_up(it->first, alignment);
    const std::uint64_t end = it->first + it->second;
    if (start + length > end) continue;
    map_chunks_locked(start + length);  // may throw: nothing changed yet
    const std::uint64_t hole_start = it->first;
    free_.erase(it);
    if (start > hole_start) free_[hole_start] = start - hole_start;
    if (start + length < end) free_[start + length] = end - (start + length);
    used_[start] = length;
    return start;
  }
  std::uint64_t used = 0;
  for (const auto& [off, len] : used_) used += len;
  throw RegionError("region '" + tag_ + "' is exhausted: asked for " + std::to_string(length) +
                    " bytes, " + std::to_string(size_ - used) + " of " + std::to_string(size_) +
                    " free (fragmented or too small)");
}

void StableRegion::deallocate(std::uint64_t offset) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = used_.find(offset);
  if (it == used_.end()) throw RegionError("region '" + tag_ + "': no allocation at offset " + std::to_string(offset));
  std::uint64_t start = it->first, length = it->second;
  used_.erase(it);
  auto next = free_.lower_bound(start);
  if (next != free_.end() && next->first == start + length) {  // merge with the hole after
    length += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {  // merge with the hole before
    auto prev = std::prev(next);
    if (prev->first + prev->second == start) {
      prev->second += length;
      return;
    }
  }
  free_[start] = length;
}

std::vector<std::pair<std::uint64_t, std::uint64_t>> StableRegion::allocations() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return {used_.begin(), used_.end()};
}

// ---- process-wide table for the allocator hooks ---------------------------
namespace {
std::mutex table_mutex;
std::vector<StableRegion*> table;  // id -> region (nullptr once unregistered)
int active_id = -1;
std::string last_error;

void store_error(const std::string& message) {
  std::lock_guard<std::mutex> lock(table_mutex);
  last_error = message;
}
}  // namespace

int register_region(StableRegion* region) {
  std::lock_guard<std::mutex> lock(table_mutex);
  table.push_back(region);
  return static_cast<int>(table.size()) - 1;
}

void unregister_region(StableRegion* region) {
  std::lock_guard<std::mutex> lock(table_mutex);
  for (std::size_t i = 0; i < table.size(); ++i) {
    if (table[i] == region) {
      table[i] = nullptr;
      if (active_id == static_cast<int>(i)) active_id = -1;
    }
  }
}

void set_active_region(int id) {
  std::lock_guard<std::mutex> lock(table_mutex);
  if (id >= static_cast<int>(table.size()) || (id >= 0 && table[id] == nullptr)) {
    throw RegionError("no registered region with id " + std::to_string(id));
  }
  active_id = id;
}

int active_region() {
  std::lock_guard<std::mutex> lock(table_mutex);
  return active_id;
}

std::string take_allocator_error() {
  std::lock_guard<std::mutex> lock(table_mutex);
  std::string out;
  out.swap(last_error);
  return out;
}

}  // namespace coldsnap::memory

using coldsnap::memory::StableRegion;

// torch calls these from inside its caching allocator: they must not throw, so failures are stored
// for Python (coldsnap.memory.region() raises them) and reported to torch as nullptr (an OOM there).
extern "C" void* coldsnap_region_malloc(long size, int device, void* /*stream*/) {
  StableRegion* region = nullptr;
  {
    std::lock_guard<std::mutex> lock(coldsnap::memory::table_mutex);
    if (coldsnap::memory::active_id >= 0) region = coldsnap::memory::table[coldsnap::memory::active_id];
  }
  try {
    if (!region) throw coldsnap::memory::RegionError("no active coldsnap region for this allocation");
    if (region->device() != device) {
      throw coldsnap::memory::RegionError("region '" + region->tag() + "' lives on device " +
                                          std::to_string(region->device()) + ", torch asked for device " +
                                          std::to_string(device));
    }
    // torch asks for whole segments (2 MiB multiples for large blocks) and needs 512-byte alignment.
    const std::uint64_t offset = region->allocate(static_cast<std::uint64_t>(size), 512);
    return reinterpret_cast<void*>(region->base() + offset);
  } catch (const std::exception& e) {
    coldsnap::memory::store_error(e.what());
    return nullptr;
  }
}

extern "C" void coldsnap_region_free(void* ptr, long /*size*/, int /*device*/, void* /*stream*/) {
  const auto address = reinterpret_cast<std::uint64_t>(ptr);
  std::lock_guard<std::mutex> lock(coldsnap::memory::table_mutex);
  for (StableRegion* region : coldsnap::memory::table) {
    if (region && !region->released() && address >= region->base() && address < region->base() + region->size()) {
      try {
        region->deallocate(address - region->base());
      } catch (const std::exception& e) {
        coldsnap::memory::last_error = e.what();
      }
      return;
    }
  }
  coldsnap::memory::last_error = "free of an address outside every coldsnap region";
}

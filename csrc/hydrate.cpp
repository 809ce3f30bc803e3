#include "hydrate.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>

#include "cuda_driver.h"

namespace coldsnap::hydrate {
namespace {

constexpr std::uint64_t kAlign = 4096;  // O_DIRECT alignment of offsets, lengths and buffers
constexpr std::uint64_t kMinChunk = 256 << 10;

std::string hex(std::uint64_t v) {
  char b[24];
  std::snprintf(b, sizeof b, "0x%llx", static_cast<unsigned long long>(v));
  return b;
}

std::uint64_t round_down(std::uint64_t v) { return v / kAlign * kAlign; }
std::uint64_t round_up(std::uint64_t v) { return (v + kAlign - 1) / kAlign * kAlign; }

// Pinned staging memory survives between runs: allocating it costs far more than a warm copy. A run
// leases the cached buffer; a run that finds it leased (another rank's hydration in this process, say)
// gets a buffer of its own, freed when it ends, so two runs never share staging slots.
struct PinnedPool {
  std::mutex mutex;
  void* ptr = nullptr;
  std::uint64_t size = 0;
  int device = -1;
  bool leased = false;
  bool release_when_returned = false;
} pinned_pool;

void free_pinned(void* ptr, int device) {
  if (ptr) {
    const auto& api = cuda::use_device(device);
    api.cuMemFreeHost(ptr);
  }
}

void free_pinned_locked() {
  free_pinned(pinned_pool.ptr, pinned_pool.device);
  pinned_pool.ptr = nullptr;
  pinned_pool.size = 0;
}

// The staging buffer of one run; returns the pooled buffer to the pool, frees a private one.
class PinnedLease {
 public:
  PinnedLease() = default;
  PinnedLease(const PinnedLease&) = delete;
  PinnedLease& operator=(const PinnedLease&) = delete;
  ~PinnedLease() { reset(); }

  char* acquire(std::uint64_t size, int device) {
    {
      std::lock_guard<std::mutex> lock(pinned_pool.mutex);
      if (!pinned_pool.leased) {
        if (!pinned_pool.ptr || pinned_pool.size < size) {
          free_pinned_locked();
          const auto& api = cuda::use_device(device);
          void* p = nullptr;
          api.check(api.cuMemHostAlloc(&p, size, cuda::CU_MEMHOSTALLOC_PORTABLE), "cuMemHostAlloc");
          pinned_pool.ptr = p;
          pinned_pool.size = size;
          pinned_pool.device = device;
        }
        pinned_pool.leased = true;
        pooled_ = true;
        ptr_ = pinned_pool.ptr;
        return static_cast<char*>(ptr_);
      }
    }
    const auto& api = cuda::use_device(device);
    api.check(api.cuMemHostAlloc(&ptr_, size, cuda::CU_MEMHOSTALLOC_PORTABLE), "cuMemHostAlloc");
    device_ = device;
    return static_cast<char*>(ptr_);
  }

  void reset() {
    if (!ptr_) return;
    if (pooled_) {
      std::lock_guard<std::mutex> lock(pinned_pool.mutex);
      pinned_pool.leased = false;
      if (pinned_pool.release_when_returned) {
        pinned_pool.release_when_returned = false;
        free_pinned_locked();
      }
    } else {
      free_pinned(ptr_, device_);
    }
    ptr_ = nullptr;
    pooled_ = false;
  }

 private:
  void* ptr_ = nullptr;
  int device_ = 0;
  bool pooled_ = false;
};

struct Unit {
  std::uint64_t file_offset, length, dst;
};

class File {
 public:
  File(const std::string& path, bool want_direct) : path_(path) {
    buffered_ = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (buffered_ < 0) throw HydrationError("cannot open " + path + ": " + std::strerror(errno));
    struct stat st {};
    if (fstat(buffered_, &st) != 0) throw HydrationError("cannot stat " + path + ": " + std::strerror(errno));
    size_ = static_cast<std::uint64_t>(st.st_size);
    // tmpfs and some FUSE file systems refuse O_DIRECT (EINVAL): fall back to buffered reads.
    if (want_direct) direct_ = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
  }
  ~File() {
    if (buffered_ >= 0) close(buffered_);
    if (direct_ >= 0) close(direct_);
  }
  std::uint64_t size() const { return size_; }
  bool direct() const { return direct_ >= 0; }
  void drop_direct() {
    if (direct_ >= 0) close(direct_);
    direct_ = -1;
  }

  // Fraction of the given byte ranges that sit in the page cache now (mincore on a mapping that is
  // never touched, so measuring does not change it).
  double cached_fraction(const std::vector<CopyItem>& items) const {
    if (size_ == 0 || items.empty()) return 0;
    void* map = mmap(nullptr, size_, PROT_READ, MAP_SHARED, buffered_, 0);
    if (map == MAP_FAILED) return 0;
    const std::uint64_t page = static_cast<std::uint64_t>(sysconf(_SC_PAGESIZE));
    std::vector<unsigned char> resident((size_ + page - 1) / page);
    double cached = 0, total = 0;
    if (mincore(map, size_, resident.data()) == 0) {
      for (const auto& it : items) {
        for (std::uint64_t p = it.file_offset / page; p * page < it.file_offset + it.length; ++p) {
          cached += resident[p] & 1;
          total += 1;
        }
      }
    }
    munmap(map, size_);
    return total > 0 ? cached / total : 0;
  }

  // Reads [offset, offset+length) into buf. With O_DIRECT, reads the 4 KiB-aligned window around it
  // (buf must hold length + 2*4 KiB) and returns where the requested bytes start inside buf.
  char* read(char* buf, std::uint64_t offset, std::uint64_t length, bool use_direct) const {
    if (!use_direct || direct_ < 0) {
      read_at_least(buffered_, buf, offset, length, length);
      return buf;
    }
    const std::uint64_t start = round_down(offset);
    const std::uint64_t end = round_up(offset + length);
    read_at_least(direct_, buf, start, end - start, offset + length - start);
    return buf + (offset - start);
  }

  void read_into(char* dst, std::uint64_t offset, std::uint64_t length) const {
    const bool aligned = direct_ >= 0 && reinterpret_cast<std::uint64_t>(dst) % kAlign == 0 &&
                         offset % kAlign == 0 && length % kAlign == 0;
    read_at_least(aligned ? direct_ : buffered_, dst, offset, length, length);
  }

  void readahead(std::uint64_t offset, std::uint64_t length) const {
    if (::readahead(buffered_, static_cast<off64_t>(offset), length) != 0) {
      throw HydrationError("readahead " + path_ + ": " + std::strerror(errno));
    }
  }

 private:
  // pread until `need` bytes are in (a short read at end of file is fine past `need`).
  void read_at_least(int fd, char* buf, std::uint64_t offset, std::uint64_t length, std::uint64_t need) const {
    std::uint64_t got = 0;
    while (got < need) {
      const ssize_t n = pread(fd, buf + got, length - got, static_cast<off_t>(offset + got));
      if (n < 0) {
        if (errno == EINTR) continue;
        throw HydrationError("read " + path_ + " at " + std::to_string(offset + got) + ": " + std::strerror(errno));
      }
      if (n == 0) {
        throw HydrationError(path_ + " ends at " + std::to_string(offset + got) + ", but an extent needs " +
                             std::to_string(offset + need) + " (truncated file?)");
      }
      got += static_cast<std::uint64_t>(n);
    }
  }

  std::string path_;
  int buffered_ = -1;
  int direct_ = -1;
  std::uint64_t size_ = 0;
};

// Shared state of one run; the first error wins and stops everyone.
struct RunState {
  std::atomic<std::size_t> next{0};
  std::atomic<std::uint64_t> done{0};
  std::atomic<bool> stop{false};
  std::atomic<int> finished{0};
  std::mutex mutex;
  std::condition_variable cv;
  std::string error;

  void fail(const std::string& message) {
    std::lock_guard<std::mutex> lock(mutex);
    if (error.empty()) error = message;
    stop = true;
  }
};

void worker(int index, const File& file, const std::vector<Unit>& units, const Options& options, bool use_direct,
            char* staging, std::uint64_t slots, std::uint64_t slot_bytes, RunState& state) {
  try {
    if (options.target == Target::Cuda) {
      const auto& api = cuda::use_device(options.device);
      cuda::CUstream stream = nullptr;
      api.check(api.cuStreamCreate(&stream, cuda::CU_STREAM_NON_BLOCKING), "cuStreamCreate");
      std::vector<cuda::CUevent> events(slots, nullptr);
      std::vector<bool> pending(slots, false);
      struct Cleanup {
        const cuda::DriverApi& api;
        cuda::CUstream stream;
        std::vector<cuda::CUevent>& events;
        ~Cleanup() {
          api.cuStreamSynchronize(stream);  // never free events or reuse buffers under a live copy
          for (auto e : events)
            if (e) api.cuEventDestroy(e);
          api.cuStreamDestroy(stream);
        }
      } cleanup{api, stream, events};
      for (auto& e : events) api.check(api.cuEventCreate(&e, cuda::CU_EVENT_DISABLE_TIMING), "cuEventCreate");
      char* mine = staging + static_cast<std::uint64_t>(index) * slots * slot_bytes;
      std::uint64_t turn = 0;
      for (std::size_t i = state.next++; i < units.size() && !state.stop; i = state.next++) {
        const Unit& u = units[i];
        const std::uint64_t slot = turn++ % slots;
        if (pending[slot]) api.check(api.cuEventSynchronize(events[slot]), "cuEventSynchronize");
        char* src = file.read(mine + slot * slot_bytes, u.file_offset, u.length, use_direct);
        api.check(api.cuMemcpyHtoDAsync(u.dst, src, u.length, stream), "cuMemcpyHtoDAsync");
        api.check(api.cuEventRecord(events[slot], stream), "cuEventRecord");
        pending[slot] = true;
        state.done += u.length;
      }
      api.check(api.cuStreamSynchronize(stream), "cuStreamSynchronize");
    } else {
      char* mine = staging ? staging + static_cast<std::uint64_t>(index) * slot_bytes : nullptr;
      for (std::size_t i = state.next++; i < units.size() && !state.stop; i = state.next++) {
        const Unit& u = units[i];
        switch (options.target) {
          case Target::Host: file.read_into(reinterpret_cast<char*>(u.dst), u.file_offset, u.length); break;
          case Target::Prefetch: file.readahead(u.file_offset, u.length); break;
          default: file.read(mine, u.file_offset, u.length, use_direct); break;
        }
        state.done += u.length;
      }
    }
  } catch (const std::exception& e) {
    state.fail(e.what());
  }
  {
    std::lock_guard<std::mutex> lock(state.mutex);
    ++state.finished;
  }
  state.cv.notify_all();
}

}  // namespace

void release_pinned() {
  std::lock_guard<std::mutex> lock(pinned_pool.mutex);
  if (pinned_pool.leased) {
    pinned_pool.release_when_returned = true;  // a run still copies through it
  } else {
    free_pinned_locked();
  }
}

std::uint64_t pinned_bytes() {
  std::lock_guard<std::mutex> lock(pinned_pool.mutex);
  return pinned_pool.size;
}

Stats run(const std::string& path, const std::vector<CopyItem>& items, const Options& options,
          const std::function<bool(std::uint64_t, std::uint64_t)>& poll) {
  if (options.threads < 1) throw HydrationError("threads must be >= 1");
  if (options.chunk_bytes < kMinChunk || options.direct_chunk_bytes < kMinChunk) {
    throw HydrationError("chunk sizes must be >= 256 KiB");
  }
  const bool writes = options.target == Target::Cuda || options.target == Target::Host;
  File file(path, options.direct != Direct::Never && options.target != Target::Prefetch);

  // Every check before the first byte moves: a bad plan writes nothing.
  std::uint64_t total = 0;
  for (std::size_t i = 0; i < items.size(); ++i) {
    const CopyItem& it = items[i];
    if (it.file_offset + it.length < it.file_offset || it.file_offset + it.length > file.size()) {
      throw HydrationError("extent " + std::to_string(i) + " (file bytes " + std::to_string(it.file_offset) + "+" +
                           std::to_string(it.length) + ") lies past the end of " + path + " (" +
                           std::to_string(file.size()) + " bytes; truncated?)");
    }
    if (writes) {
      const bool inside = std::any_of(options.allowed.begin(), options.allowed.end(), [&](const auto& r) {
        return it.dst >= r.first && it.dst + it.length <= r.second && it.dst + it.length >= it.dst;
      });
      if (!inside) {
        throw HydrationError("extent " + std::to_string(i) + " would write " + std::to_string(it.length) +
                             " bytes at " + hex(it.dst) + ", outside every mapped region it may target");
      }
    }
    total += it.length;
  }

  Stats stats;
  if (options.direct == Direct::Auto && file.direct()) {
    stats.cached_fraction = file.cached_fraction(items);
    if (stats.cached_fraction >= 0.5) file.drop_direct();
  }

  // Chunk the work; the pinned ring bounds the chunk size for the GPU path.
  int threads = options.threads;
  const bool direct = file.direct();
  const std::uint64_t ring_bytes = direct ? options.direct_ring_bytes : options.ring_bytes;
  std::uint64_t chunk = round_down(direct ? options.direct_chunk_bytes : options.chunk_bytes);
  std::uint64_t slots = 1;
  const bool staged = options.target == Target::Cuda || options.target == Target::Discard;
  if (staged) {
    slots = options.target == Target::Cuda ? 2 : 1;
    const std::uint64_t per_thread = ring_bytes / static_cast<std::uint64_t>(threads);
    if (per_thread < slots * (kMinChunk + 2 * kAlign)) {
      throw HydrationError("ring_bytes " + std::to_string(ring_bytes) + " is too small for " +
                           std::to_string(threads) + " threads");
    }
    chunk = std::min(chunk, round_down(per_thread / slots - 2 * kAlign));
    slots = std::max<std::uint64_t>(slots, per_thread / (chunk + 2 * kAlign));
    slots = std::min<std::uint64_t>(slots, 8);  // deeper rings stop paying once copies keep up
  }
  std::vector<Unit> units;
  for (const auto& it : items) {
    for (std::uint64_t off = 0; off < it.length; off += chunk) {
      units.push_back({it.file_offset + off, std::min(chunk, it.length - off), it.dst + off});
    }
  }
  threads = static_cast<int>(std::max<std::size_t>(1, std::min<std::size_t>(threads, units.size())));
  const std::uint64_t slot_bytes = chunk + 2 * kAlign;

  stats.threads = threads;
  stats.chunk_bytes = chunk;
  stats.items = items.size();
  stats.direct = file.direct();
  char* staging = nullptr;
  std::unique_ptr<char, decltype(&std::free)> discard_buffers(nullptr, &std::free);
  PinnedLease pinned;  // declared before the workers: outlives every use of the staging slots
  if (options.target == Target::Cuda) {
    staging = pinned.acquire(static_cast<std::uint64_t>(threads) * slots * slot_bytes, options.device);
    stats.pinned_bytes = static_cast<std::uint64_t>(threads) * slots * slot_bytes;
  } else if (options.target == Target::Discard) {
    void* p = nullptr;
    if (posix_memalign(&p, kAlign, static_cast<std::uint64_t>(threads) * slot_bytes) != 0) {
      throw HydrationError("cannot allocate read buffers");
    }
    discard_buffers.reset(static_cast<char*>(p));
    staging = discard_buffers.get();
  }

  RunState state;
  const auto started = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  // Every worker is joined however this frame is left (a joinable std::thread destroyed by an unwind
  // calls std::terminate), e.g. when starting the next worker throws.
  struct JoinEveryWorker {
    std::vector<std::thread>& pool;
    RunState& state;
    ~JoinEveryWorker() {
      state.stop = true;  // the workers still running finish their current unit and return
      for (auto& t : pool) {
        if (t.joinable()) t.join();
      }
    }
  } join_every_worker{pool, state};
  pool.reserve(threads);
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back(worker, t, std::cref(file), std::cref(units), std::cref(options), file.direct(), staging,
                      slots, slot_bytes, std::ref(state));
  }
  std::string poll_error;
  {
    std::unique_lock<std::mutex> lock(state.mutex);
    while (state.finished < threads) {
      state.cv.wait_for(lock, std::chrono::milliseconds(50));
      if (!poll) continue;
      lock.unlock();
      bool keep_going = true;
      try {
        keep_going = poll(state.done.load(), total);
      } catch (const std::exception& e) {
        poll_error = e.what();
        keep_going = false;
      }
      if (!keep_going) state.fail(poll_error.empty() ? "cancelled by the progress callback" : poll_error);
      lock.lock();
    }
  }
  for (auto& t : pool) t.join();
  stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  stats.bytes = state.done.load();
  if (!state.error.empty()) throw HydrationError(state.error);
  if (poll) poll(stats.bytes, total);
  return stats;
}

}  // namespace coldsnap::hydrate

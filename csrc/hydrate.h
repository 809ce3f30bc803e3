// The hydration engine: file extents -> memory at given addresses, as fast as the page cache or the
// disk allows. N reader threads pread (O_DIRECT when asked and possible, buffered otherwise) into a
// bounded pinned ring; each thread copies its chunks to the GPU on its own stream while it reads the
// next. A host target is read straight into place; `prefetch` only warms the page cache; `discard`
// reads and drops (the raw read bandwidth, for benchmarks).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

namespace coldsnap::hydrate {

enum class Target { Cuda, Host, Prefetch, Discard };
enum class Direct { Auto, Always, Never };

struct CopyItem {
  std::uint64_t file_offset;
  std::uint64_t length;
  std::uint64_t dst;  // address (device or host); ignored for prefetch/discard
};

struct Options {
  Target target = Target::Cuda;
  int device = 0;
  int threads = 8;
  // Cached reads are CPU copies: small chunks in a ring that fits the last-level cache are fastest.
  std::uint64_t chunk_bytes = 2ull << 20;
  std::uint64_t ring_bytes = 96ull << 20;  // bound on pinned memory (cuda) / bounce buffers (discard)
  // O_DIRECT reads go to the disk: large requests keep its queue full. Used whenever O_DIRECT is.
  std::uint64_t direct_chunk_bytes = 16ull << 20;
  std::uint64_t direct_ring_bytes = 512ull << 20;
  // O_DIRECT skips the page cache: right for a cold file, wrong for a cached one (it would read the
  // disk again). Auto measures the file's residency (mincore) and reads buffered when most is cached.
  Direct direct = Direct::Auto;
  // Destinations must lie inside one of these [lo, hi) ranges; checked before anything is read.
  std::vector<std::pair<std::uint64_t, std::uint64_t>> allowed;
};

struct Stats {
  std::uint64_t bytes = 0;
  std::uint64_t items = 0;
  double seconds = 0;
  int threads = 0;
  std::uint64_t chunk_bytes = 0;
  std::uint64_t pinned_bytes = 0;
  bool direct = false;            // whether O_DIRECT was actually used
  double cached_fraction = -1;    // page-cache residency of the extents before the run (-1: not measured)
};

class HydrationError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Runs to completion or throws HydrationError / CudaError. `poll` is called on the calling thread about
// every 50 ms with (bytes done, total); returning false cancels the run (it then throws).
Stats run(const std::string& path, const std::vector<CopyItem>& items, const Options& options,
          const std::function<bool(std::uint64_t, std::uint64_t)>& poll);

// Pinned memory is kept between runs (allocating 1 GiB of it costs ~0.2 s); free it before a process
// snapshot, since CRIU would otherwise dump it.
void release_pinned();
std::uint64_t pinned_bytes();

}  // namespace coldsnap::hydrate

// pybind11 bindings: coldsnap._C
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "cuda_driver.h"
#include "hydrate.h"
#include "nccl_bridge.h"
#include "stable_memory.h"

namespace py = pybind11;
namespace cu = coldsnap::cuda;
namespace mem = coldsnap::memory;
namespace hy = coldsnap::hydrate;
namespace nc = coldsnap::nccl;

namespace {

bool interpreter_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

// The GIL released for a long native call made from a Python thread that may be a daemon thread.
// Python ends a thread that takes the GIL while the interpreter shuts down with pthread_exit, whose
// forced unwind cannot pass the noexcept destructor of pybind11's gil_scoped_release: std::terminate,
// "terminate called without an active exception", exit 134 (what issue 13 saw from a `coldsnap restore`
// that failed early; reproduced by a daemon thread still hydrating at exit, tests/unit/test_hydrate_host.py).
// The process is exiting then: park this thread instead of taking the GIL, and let the exit end it.
class GilReleasedUnlessFinalizing {
 public:
  GilReleasedUnlessFinalizing() : state_(PyEval_SaveThread()) {}
  GilReleasedUnlessFinalizing(const GilReleasedUnlessFinalizing&) = delete;
  GilReleasedUnlessFinalizing& operator=(const GilReleasedUnlessFinalizing&) = delete;
  ~GilReleasedUnlessFinalizing() {
    while (interpreter_finalizing()) std::this_thread::sleep_for(std::chrono::seconds(1));
    PyEval_RestoreThread(state_);
  }

 private:
  PyThreadState* state_;
};

// The Python type of each C++ error with a result code. Owned by pybind11's register_exception
// storage, which lives until interpreter shutdown, so a borrowed pointer is fine.
template <class Error>
PyObject* g_error_type = nullptr;

// Error(RuntimeError) in Python with .code: the library's result code (an int), or None when no call
// of the library failed (library or symbol missing). The translator is registered after
// register_exception's own, so it is tried first: same type and message, plus the instance's .code.
template <class Error>
void register_coded_error(py::module_& m, const char* name) {
  auto& type = py::register_exception<Error>(m, name, PyExc_RuntimeError);
  type.attr("code") = py::none();  // class-level default
  g_error_type<Error> = type.ptr();
  py::register_exception_translator([](std::exception_ptr p) {
    if (!p) return;
    try {
      std::rethrow_exception(p);
    } catch (const Error& e) {
      PyObject* error_type = g_error_type<Error>;
      try {
        py::object inst = py::handle(error_type)(e.what());
        if (e.code()) inst.attr("code") = *e.code();
        PyErr_SetObject(error_type, inst.ptr());
      } catch (py::error_already_set&) {  // building the instance failed: plain message
        PyErr_SetString(error_type, e.what());
      }
    }  // anything else propagates to the next translator
  });
}

py::dict device_to_dict(const cu::DeviceInfo& d) {
  py::dict o;
  o["ordinal"] = d.ordinal;
  o["name"] = d.name;
  o["uuid"] = d.uuid;
  o["compute_capability"] = d.compute_capability;
  o["total_memory_bytes"] = d.total_memory_bytes;
  o["pci_bus_id"] = d.pci_bus_id;
  return o;
}

py::dict cuda_probe() {
  cu::ProbeResult r;
  {
    // cuInit on a multi-GPU host can take a while; let other threads run.
    py::gil_scoped_release nogil;
    r = cu::probe();
  }
  py::list devices;
  for (const auto& d : r.devices) devices.append(device_to_dict(d));
  py::dict o;
  o["available"] = r.available;
  o["reason"] = r.reason;
  o["library"] = r.library;
  o["driver_version"] = r.driver_version;
  o["devices"] = devices;
  o["checkpoint_api"] = r.checkpoint_api;
  o["vmm_api"] = r.vmm_api;
  return o;
}

py::dict build_info() {
  py::dict o;
#if defined(__clang__)
  o["compiler"] = "clang " __clang_version__;
#elif defined(__GNUC__)
  o["compiler"] = "gcc " __VERSION__;
#else
  o["compiler"] = "unknown";
#endif
  o["cxx_standard"] = static_cast<long>(__cplusplus);
  o["pybind11_version"] = std::to_string(PYBIND11_VERSION_MAJOR) + "." +
                          std::to_string(PYBIND11_VERSION_MINOR) + "." +
                          std::to_string(PYBIND11_VERSION_PATCH);
  o["python_headers"] = PY_VERSION;        // the Python the extension was compiled against
  o["built"] = __DATE__ " " __TIME__;  // when module.cpp was compiled
  o["cuda_loading"] = "dlopen";
  o["cuda_library"] = "libcuda.so.1";
  return o;
}

hy::Target parse_target(const std::string& name) {
  if (name == "cuda") return hy::Target::Cuda;
  if (name == "host") return hy::Target::Host;
  if (name == "prefetch") return hy::Target::Prefetch;
  if (name == "discard") return hy::Target::Discard;
  throw std::invalid_argument("target must be cuda, host, prefetch or discard, not " + name);
}

py::dict hydrate(const std::string& path, const std::vector<std::tuple<std::uint64_t, std::uint64_t, std::uint64_t>>& items,
                 const std::string& target, int device, int threads, std::uint64_t chunk_bytes,
                 std::uint64_t ring_bytes, py::object direct,
                 const std::vector<std::pair<std::uint64_t, std::uint64_t>>& allowed, py::object progress,
                 std::uint64_t direct_chunk_bytes, std::uint64_t direct_ring_bytes) {
  std::vector<hy::CopyItem> plan;
  plan.reserve(items.size());
  for (const auto& [offset, length, dst] : items) plan.push_back({offset, length, dst});
  hy::Options options;
  options.target = parse_target(target);
  options.device = device;
  options.threads = threads;
  options.chunk_bytes = chunk_bytes;
  options.ring_bytes = ring_bytes;
  options.direct = direct.is_none() ? hy::Direct::Auto : (direct.cast<bool>() ? hy::Direct::Always : hy::Direct::Never);
  options.allowed = allowed;
  options.direct_chunk_bytes = direct_chunk_bytes;
  options.direct_ring_bytes = direct_ring_bytes;
  // The callback runs on this thread with the GIL re-acquired; its exception is re-raised as itself.
  std::unique_ptr<py::error_already_set> callback_error;
  std::function<bool(std::uint64_t, std::uint64_t)> poll;
  if (!progress.is_none()) {
    poll = [&](std::uint64_t done, std::uint64_t total) {
      if (interpreter_finalizing()) return false;  // stop the workers; taking the GIL now ends the thread
      py::gil_scoped_acquire gil;
      try {
        py::object keep = progress(done, total);
        return keep.is_none() || keep.cast<bool>();
      } catch (py::error_already_set& e) {
        if (!callback_error) callback_error = std::make_unique<py::error_already_set>(std::move(e));
        return false;
      }
    };
  }
  hy::Stats stats;
  try {
    GilReleasedUnlessFinalizing nogil;
    stats = hy::run(path, plan, options, poll);
  } catch (const hy::HydrationError&) {
    if (callback_error) throw std::move(*callback_error);
    throw;
  }
  py::dict o;
  o["bytes"] = stats.bytes;
  o["items"] = stats.items;
  o["seconds"] = stats.seconds;
  o["threads"] = stats.threads;
  o["chunk_bytes"] = stats.chunk_bytes;
  o["pinned_bytes"] = stats.pinned_bytes;
  o["direct"] = stats.direct;
  o["cached_fraction"] = stats.cached_fraction;
  return o;
}

cu::CUuuid parse_uuid(const std::string& text) {
  // "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" (nvidia-smi / cuda_probe style) -> 16 bytes
  std::string hex;
  for (char c : text.substr(text.rfind("GPU-", 0) == 0 ? 4 : 0)) {
    if (c != '-') hex += c;
  }
  if (hex.size() != 32) throw std::invalid_argument("not a GPU UUID: " + text);
  cu::CUuuid out{};
  for (int i = 0; i < 16; ++i) out.bytes[i] = static_cast<char>(std::stoi(hex.substr(2 * i, 2), nullptr, 16));
  return out;
}

// The CUDA checkpoint driver API, one process at a time (the Python side sequences a tree).
void checkpoint_call(const std::string& op, int pid, unsigned int timeout_ms,
                     const std::vector<std::pair<std::string, std::string>>& gpu_pairs) {
  const auto& api = cu::initialized_driver();
  if (!api.has_checkpoint_api()) throw cu::CudaError(api.library + " has no CUDA checkpoint API (driver 550+ needed)");
  if (op == "lock") {
    cu::CUcheckpointLockArgs args{};
    args.timeoutMs = timeout_ms;
    api.check(api.cuCheckpointProcessLock(pid, &args), "cuCheckpointProcessLock");
  } else if (op == "checkpoint") {
    api.check(api.cuCheckpointProcessCheckpoint(pid, nullptr), "cuCheckpointProcessCheckpoint");
  } else if (op == "restore") {
    std::vector<cu::CUcheckpointGpuPair> pairs;
    for (const auto& [old_uuid, new_uuid] : gpu_pairs) pairs.push_back({parse_uuid(old_uuid), parse_uuid(new_uuid)});
    cu::CUcheckpointRestoreArgs args{};
    args.gpuPairs = pairs.empty() ? nullptr : pairs.data();
    args.gpuPairsCount = static_cast<unsigned int>(pairs.size());
    api.check(api.cuCheckpointProcessRestore(pid, pairs.empty() ? nullptr : &args), "cuCheckpointProcessRestore");
  } else if (op == "unlock") {
    api.check(api.cuCheckpointProcessUnlock(pid, nullptr), "cuCheckpointProcessUnlock");
  } else {
    throw std::invalid_argument("checkpoint op must be lock, checkpoint, restore or unlock");
  }
}

int checkpoint_state(int pid) {
  const auto& api = cu::initialized_driver();
  if (!api.has_checkpoint_api()) throw cu::CudaError(api.library + " has no CUDA checkpoint API (driver 550+ needed)");
  cu::CUprocessState state = 0;
  api.check(api.cuCheckpointProcessGetState(pid, &state), "cuCheckpointProcessGetState");
  return state;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "coldsnap native core (CUDA driver API loaded at run time via dlopen)";

  register_coded_error<cu::CudaError>(m, "CudaError");  // .code: the CUresult
  register_coded_error<nc::NcclError>(m, "NcclError");  // .code: the ncclResult_t

  m.def(
      "nccl_load",
      [](const std::string& library) {
        nc::LoadInfo info = nc::load(library);
        py::dict o;
        o["library"] = info.library;
        o["version_code"] = info.version;
        o["version"] = nc::version_string(info.version);
        return o;
      },
      py::arg("library") = "",
      "dlopen NCCL (\"\": libnccl.so.2) once per process; returns {library, version, version_code}. "
      "Raises NcclError for a missing library or symbol, or an NCCL older than 2.14.");
  m.attr("NCCL_MINIMUM_VERSION") = nc::version_string(nc::kMinimumVersion);
  m.def(
      "nccl_unique_id", [] { return py::bytes(nc::unique_id()); },
      "ncclGetUniqueId: 128 bytes (this process becomes the rendezvous root until every rank joined).");
  m.def(
      "nccl_comm_init",
      [](const py::bytes& id, int world, int rank, int device) {
        std::string raw = id;
        py::gil_scoped_release nogil;
        return nc::comm_init(raw, world, rank, device);
      },
      py::arg("unique_id"), py::arg("world"), py::arg("rank"), py::arg("device"),
      "ncclCommInitRank on device (blocks until every rank joined); returns the communicator handle.");
  m.def("nccl_comm_finalize", &nc::comm_finalize, py::arg("comm"), py::call_guard<py::gil_scoped_release>(),
        "ncclCommFinalize: flush the communicator's work (every rank calls it).");
  m.def("nccl_comm_destroy", &nc::comm_destroy, py::arg("comm"), py::call_guard<py::gil_scoped_release>());
  m.def("nccl_comm_abort", &nc::comm_abort, py::arg("comm"), py::call_guard<py::gil_scoped_release>(),
        "ncclCommAbort: free the communicator without waiting for peers (after a failure).");
  m.def("nccl_comm_async_error", &nc::comm_async_error, py::arg("comm"),
        "The communicator's asynchronous error (\"\" when none).");
  m.def("nccl_all_reduce", &nc::all_reduce, py::arg("comm"), py::arg("send"), py::arg("recv"), py::arg("count"),
        py::arg("dtype"), py::arg("op"), py::arg("stream"), py::call_guard<py::gil_scoped_release>(),
        "ncclAllReduce of count elements (addresses and stream as integers; in place when send == recv).");

  m.def("cuda_probe", &cuda_probe,
        "Probe the CUDA driver; never raises. Returns a dict (see _C.pyi: CudaProbe).");
  m.def(
      "driver_version", [] { return cu::driver_version(); },
      "CUDA API version supported by the driver (e.g. 13000). Raises CudaError without a "
      "driver.");
  m.def("build_info", &build_info, "How this extension was built.");

  py::register_exception<mem::RegionError>(m, "RegionError", PyExc_RuntimeError);
  py::register_exception<hy::HydrationError>(m, "HydrationError", PyExc_RuntimeError);

  py::class_<mem::StableRegion>(m, "StableRegion",
                                "A reserved virtual address range whose physical memory can be dropped and "
                                "mapped again at the same address.")
      .def(py::init([](const std::string& tag, const std::string& backend, int device, std::uint64_t size,
                       std::uint64_t chunk_bytes, std::uint64_t fixed_address, bool shareable) {
             if (backend != "host" && backend != "cuda") throw std::invalid_argument("backend must be host or cuda");
             py::gil_scoped_release nogil;
             return new mem::StableRegion(tag, backend == "host" ? mem::Backend::Host : mem::Backend::Cuda, device,
                                          size, chunk_bytes, fixed_address, shareable);
           }),
           py::arg("tag"), py::arg("backend"), py::arg("device"), py::arg("size"), py::arg("chunk_bytes"),
           py::arg("fixed_address") = 0, py::arg("shareable") = false)
      .def_property_readonly("tag", &mem::StableRegion::tag)
      .def_property_readonly("backend", [](const mem::StableRegion& r) {
        return r.backend() == mem::Backend::Host ? "host" : "cuda";
      })
      .def_property_readonly("device", &mem::StableRegion::device)
      .def_property_readonly("base", &mem::StableRegion::base)
      .def_property_readonly("size", &mem::StableRegion::size)
      .def_property_readonly("chunk_bytes", &mem::StableRegion::chunk_bytes)
      .def_property_readonly("granularity", &mem::StableRegion::granularity)
      .def_property_readonly("mapped_bytes", &mem::StableRegion::mapped_bytes)
      .def_property_readonly("high_water", &mem::StableRegion::high_water)
      .def_property_readonly("released", &mem::StableRegion::released)
      .def("map", &mem::StableRegion::map, py::arg("end"), py::call_guard<py::gil_scoped_release>())
      .def("remap", &mem::StableRegion::remap, py::call_guard<py::gil_scoped_release>())
      .def("unmap", &mem::StableRegion::unmap, py::call_guard<py::gil_scoped_release>())
      .def("zero", &mem::StableRegion::zero, py::arg("offset"), py::arg("length"),
           py::call_guard<py::gil_scoped_release>())
      .def("release", &mem::StableRegion::release, py::call_guard<py::gil_scoped_release>())
      .def("allocate", &mem::StableRegion::allocate, py::arg("length"), py::arg("alignment"))
      .def("deallocate", &mem::StableRegion::deallocate, py::arg("offset"))
      .def("allocations", &mem::StableRegion::allocations)
      .def("export_chunks", &mem::StableRegion::export_chunks, py::call_guard<py::gil_scoped_release>(),
           "POSIX fds of the mapped chunks, in address order; the caller closes them (shareable cuda regions).")
      .def("adopt_chunks", &mem::StableRegion::adopt_chunks, py::arg("fds"), py::call_guard<py::gil_scoped_release>(),
           "Map chunks another process exported after what is mapped here (all or nothing); fds stay open.");

  m.def("register_region", &mem::register_region, py::arg("region"),
        "Make a region reachable by the torch allocator hooks; returns its id.");
  m.def("unregister_region", &mem::unregister_region, py::arg("region"));
  m.def("set_active_region", &mem::set_active_region, py::arg("id"),
        "Region the next torch allocations through coldsnap_region_malloc land in (-1: none).");
  m.def("active_region", &mem::active_region);
  m.def("take_allocator_error", &mem::take_allocator_error,
        "The last error the allocator hooks could not raise (\"\" when none); clears it.");
  m.attr("ALLOCATOR_MALLOC") = "coldsnap_region_malloc";
  m.attr("ALLOCATOR_FREE") = "coldsnap_region_free";

  m.def("hydrate", &hydrate, py::arg("path"), py::arg("items"), py::arg("target"), py::arg("device") = 0,
        py::arg("threads") = 8, py::arg("chunk_bytes") = 2ull << 20, py::arg("ring_bytes") = 96ull << 20,
        py::arg("direct") = py::none(), py::arg("allowed") = std::vector<std::pair<std::uint64_t, std::uint64_t>>{},
        py::arg("progress") = py::none(), py::arg("direct_chunk_bytes") = 16ull << 20,
        py::arg("direct_ring_bytes") = 512ull << 20,
        "Copy file extents (file_offset, length, dst_address) to memory; see csrc/hydrate.h.");
  m.def("release_pinned", &hy::release_pinned, "Free the cached pinned staging ring.");
  m.def("checkpoint_call", &checkpoint_call, py::arg("op"), py::arg("pid"), py::arg("timeout_ms") = 0,
        py::arg("gpu_pairs") = std::vector<std::pair<std::string, std::string>>{},
        py::call_guard<py::gil_scoped_release>(),
        "cuCheckpointProcess{Lock,Checkpoint,Restore,Unlock} on one pid; raises CudaError with the CUresult name.");
  m.def("checkpoint_state", &checkpoint_state, py::arg("pid"), py::call_guard<py::gil_scoped_release>(),
        "cuCheckpointProcessGetState: 0 running, 1 locked, 2 checkpointed, 3 failed.");
  m.def("pinned_bytes", &hy::pinned_bytes, "Bytes of pinned staging memory currently cached.");
  m.def(
      "copy_device_to_host",
      [](std::uint64_t dst, std::uint64_t src, std::uint64_t length, int device) {
        const auto& api = cu::use_device(device);
        api.check(api.cuMemcpyDtoH(reinterpret_cast<void*>(dst), src, length), "cuMemcpyDtoH");
      },
      py::arg("dst"), py::arg("src"), py::arg("length"), py::arg("device"), py::call_guard<py::gil_scoped_release>(),
      "Synchronous device -> host copy (dst is a host address).");
  m.def(
      "copy_host_to_device",
      [](std::uint64_t dst, std::uint64_t src, std::uint64_t length, int device) {
        const auto& api = cu::use_device(device);
        api.check(api.cuMemcpyHtoD(dst, reinterpret_cast<const void*>(src), length), "cuMemcpyHtoD");
      },
      py::arg("dst"), py::arg("src"), py::arg("length"), py::arg("device"), py::call_guard<py::gil_scoped_release>(),
      "Synchronous host -> device copy (src is a host address).");
  m.def(
      "map_file_pinned",
      [](const std::string& path, int device) {
        // The whole file mapped read-only from the page cache and registered with the driver: copies
        // out of it are DMA reads of those pages (no staging copy through a ring).
        const auto& api = cu::use_device(device);
        int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
        if (fd < 0) throw cu::CudaError(path + ": " + std::strerror(errno));
        struct stat st {};
        if (::fstat(fd, &st) != 0 || st.st_size == 0) {
          ::close(fd);
          throw cu::CudaError(path + ": cannot map an empty or unreadable file");
        }
        auto length = static_cast<std::size_t>(st.st_size);
        void* address = ::mmap(nullptr, length, PROT_READ, MAP_SHARED | MAP_POPULATE, fd, 0);
        ::close(fd);
        if (address == MAP_FAILED) throw cu::CudaError(path + ": mmap: " + std::strerror(errno));
        cu::CUresult result = api.cuMemHostRegister(address, length, cu::CU_MEMHOSTREGISTER_PORTABLE | cu::CU_MEMHOSTREGISTER_READ_ONLY);
        if (result != 0) {
          ::munmap(address, length);
          api.check(result, "cuMemHostRegister");
        }
        return std::make_tuple(reinterpret_cast<std::uint64_t>(address), static_cast<std::uint64_t>(length));
      },
      py::arg("path"), py::arg("device"), py::call_guard<py::gil_scoped_release>(),
      "Map a file read-only and register it as pinned host memory; returns (address, length).");
  m.def(
      "unmap_file_pinned",
      [](std::uint64_t address, std::uint64_t length, int device) {
        const auto& api = cu::use_device(device);
        cu::CUresult result = api.cuMemHostUnregister(reinterpret_cast<void*>(address));
        ::munmap(reinterpret_cast<void*>(address), length);
        api.check(result, "cuMemHostUnregister");
      },
      py::arg("address"), py::arg("length"), py::arg("device"), py::call_guard<py::gil_scoped_release>(),
      "Unregister and unmap what map_file_pinned mapped.");
  m.def(
      "copy_pinned_to_device",
      [](const std::vector<std::tuple<std::uint64_t, std::uint64_t, std::uint64_t>>& items, int device) {
        // (source address, length, destination): all queued on one stream, then one wait. From
        // registered memory each copy is a DMA at the link's rate; one stream already saturates it.
        const auto& api = cu::use_device(device);
        cu::CUstream stream = nullptr;
        api.check(api.cuStreamCreate(&stream, cu::CU_STREAM_NON_BLOCKING), "cuStreamCreate");
        cu::CUresult result = 0;
        for (const auto& [src, length, dst] : items) {
          result = api.cuMemcpyHtoDAsync(dst, reinterpret_cast<const void*>(src), length, stream);
          if (result != 0) break;
        }
        cu::CUresult synced = api.cuStreamSynchronize(stream);
        api.cuStreamDestroy(stream);
        api.check(result, "cuMemcpyHtoDAsync");
        api.check(synced, "cuStreamSynchronize");
      },
      py::arg("items"), py::arg("device"), py::call_guard<py::gil_scoped_release>(),
      "Copy (source, length, destination) extents from pinned host memory to the device, then wait.");
  m.def(
      "device_memory",
      [](int device) {
        const auto& api = cu::use_device(device);
        std::size_t free_bytes = 0, total_bytes = 0;
        api.check(api.cuMemGetInfo(&free_bytes, &total_bytes), "cuMemGetInfo");
        return std::make_tuple(static_cast<std::uint64_t>(free_bytes), static_cast<std::uint64_t>(total_bytes));
      },
      py::arg("device"), py::call_guard<py::gil_scoped_release>(),
      "(free, total) bytes of the device's memory, every process's use counted (cuMemGetInfo).");
  m.def(
      "context_limit",
      [](int device, int limit) {
        const auto& api = cu::use_device(device);
        if (api.cuCtxGetLimit == nullptr) throw cu::CudaError(api.library + " has no cuCtxGetLimit");
        std::size_t value = 0;
        api.check(api.cuCtxGetLimit(&value, limit), "cuCtxGetLimit");
        return static_cast<std::uint64_t>(value);
      },
      py::arg("device"), py::arg("limit"), py::call_guard<py::gil_scoped_release>(),
      "cuCtxGetLimit of the device's primary context (0 stack, 1 printf FIFO, 2 malloc heap).");
  m.def(
      "set_context_limit",
      [](int device, int limit, std::uint64_t value) {
        const auto& api = cu::use_device(device);
        if (api.cuCtxSetLimit == nullptr) throw cu::CudaError(api.library + " has no cuCtxSetLimit");
        api.check(api.cuCtxSetLimit(limit, static_cast<std::size_t>(value)), "cuCtxSetLimit");
      },
      py::arg("device"), py::arg("limit"), py::arg("value"), py::call_guard<py::gil_scoped_release>(),
      "cuCtxSetLimit on the device's primary context (waits for the work queued before it).");
  m.def(
      "close_ipc_mapping",
      [](std::uint64_t address, int device) {
        const auto& api = cu::use_device(device);
        if (api.cuIpcCloseMemHandle == nullptr) throw cu::CudaError(api.library + " has no cuIpcCloseMemHandle");
        api.check(api.cuIpcCloseMemHandle(address), "cuIpcCloseMemHandle");
      },
      py::arg("address"), py::arg("device"), py::call_guard<py::gil_scoped_release>(),
      "Unmap a peer allocation that cudaIpcOpenMemHandle / cuIpcOpenMemHandle mapped at address.");
}

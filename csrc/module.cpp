// pybind11 bindings: coldsnap._C
#include <pybind11/pybind11.h>

#include <string>

#include "cuda_driver.h"

namespace py = pybind11;
namespace cu = coldsnap::cuda;

namespace {

// The CudaError type object. Owned by pybind11's register_exception storage,
// which lives until interpreter shutdown, so a borrowed pointer is fine.
PyObject* g_cuda_error = nullptr;

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

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "coldsnap native core (CUDA driver API loaded at run time via dlopen)";

  // CudaError(RuntimeError) with .code: the CUresult (int) or None when no
  // driver call failed (library missing, symbol missing).
  auto& exc = py::register_exception<cu::CudaError>(m, "CudaError", PyExc_RuntimeError);
  exc.attr("code") = py::none();  // class-level default
  g_cuda_error = exc.ptr();
  // Registered after register_exception's own translator, so tried first:
  // same type and message, plus the instance's .code.
  py::register_exception_translator([](std::exception_ptr p) {
    if (!p) return;
    try {
      std::rethrow_exception(p);
    } catch (const cu::CudaError& e) {
      try {
        py::object inst = py::handle(g_cuda_error)(e.what());
        if (e.code()) inst.attr("code") = *e.code();
        PyErr_SetObject(g_cuda_error, inst.ptr());
      } catch (py::error_already_set&) {  // building the instance failed: plain message
        PyErr_SetString(g_cuda_error, e.what());
      }
    }  // anything else propagates to the next translator
  });

  m.def("cuda_probe", &cuda_probe,
        "Probe the CUDA driver; never raises. Returns a dict (see _C.pyi: CudaProbe).");
  m.def(
      "driver_version", [] { return cu::driver_version(); },
      "CUDA API version supported by the driver (e.g. 13000). Raises CudaError without a "
      "driver.");
  m.def("build_info", &build_info, "How this extension was built.");
}

"""GPU memory as NVIDIA's management library (NVML, ``libnvidia-ml.so.1``) reports it: each GPU's free
bytes, and what each process uses on each GPU — without creating a CUDA context (which would itself take
hundreds of MiB of the GPU and ~0.15 s). Loaded with ctypes on first use; :class:`NvmlError` when the
library or a call fails.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass

__all__ = ["DeviceMemory", "NvmlError", "device_memory", "process_memory"]

_SUCCESS, _INSUFFICIENT_SIZE = 0, 7
_NOT_AVAILABLE = 2**64 - 1  # NVML_VALUE_NOT_AVAILABLE: a process's use it cannot tell (some virtualized GPUs)
_lock = threading.Lock()
_library: ctypes.CDLL | None = None


class NvmlError(RuntimeError):
    """NVML is missing, or a call failed."""


class _ProcessInfo(ctypes.Structure):  # nvmlProcessInfo_t (v2/v3 layout)
    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong), ("gpuInstanceId", ctypes.c_uint),
                ("computeInstanceId", ctypes.c_uint)]


class _Memory(ctypes.Structure):  # nvmlMemory_t
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


def _nvml() -> ctypes.CDLL:
    global _library
    with _lock:
        if _library is None:
            try:
                library = ctypes.CDLL("libnvidia-ml.so.1")
            except OSError as exc:
                raise NvmlError(f"NVML is not available: {exc}") from None
            _check(library, "nvmlInit_v2")
            _library = library
        return _library


def _check(library: ctypes.CDLL, name: str, *args: object) -> int:
    code = getattr(library, name)(*args)
    if code not in (_SUCCESS, _INSUFFICIENT_SIZE):
        describe = library.nvmlErrorString
        describe.restype = ctypes.c_char_p
        raise NvmlError(f"{name}: {describe(code).decode(errors='replace')} ({code})")
    return int(code)


def _devices(library: ctypes.CDLL) -> list[tuple[str, ctypes.c_void_p]]:
    count = ctypes.c_uint()
    _check(library, "nvmlDeviceGetCount_v2", ctypes.byref(count))
    devices = []
    for index in range(count.value):
        handle = ctypes.c_void_p()
        _check(library, "nvmlDeviceGetHandleByIndex_v2", index, ctypes.byref(handle))
        uuid = ctypes.create_string_buffer(96)
        _check(library, "nvmlDeviceGetUUID", handle, uuid, len(uuid))
        devices.append((uuid.value.decode(), handle))
    return devices


@dataclass(frozen=True)
class DeviceMemory:
    total: int
    free: int


def device_memory() -> dict[str, DeviceMemory]:
    """Every GPU of the host by UUID: its total and free bytes now."""
    library = _nvml()
    found = {}
    for uuid, handle in _devices(library):
        memory = _Memory()
        _check(library, "nvmlDeviceGetMemoryInfo", handle, ctypes.byref(memory))
        found[uuid] = DeviceMemory(total=memory.total, free=memory.free)
    return found


def process_memory(pids: set[int]) -> dict[str, dict[int, int]]:
    """GPU UUID → pid → bytes that process uses on it (contexts, allocations, graph pools), for ``pids``
    (as this pid namespace sees them); GPUs none of them uses are left out."""
    library = _nvml()
    found: dict[str, dict[int, int]] = {}
    for uuid, handle in _devices(library):
        count = ctypes.c_uint(0)
        infos = (_ProcessInfo * 0)()
        while True:  # the list can grow between the two calls
            if _check(library, "nvmlDeviceGetComputeRunningProcesses_v3", handle, ctypes.byref(count), infos) == _SUCCESS:
                break
            infos = (_ProcessInfo * (count.value + 4))()
            count = ctypes.c_uint(len(infos))
        used = {info.pid: int(info.usedGpuMemory) for info in infos[:count.value]
                if info.pid in pids and info.usedGpuMemory != _NOT_AVAILABLE}
        if used:
            found[uuid] = used
    return found

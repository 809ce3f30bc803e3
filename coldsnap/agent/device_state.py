"""What the CUDA checkpoint will copy of a GPU process beside its model memory, measured per part, and the
one part the agent can shrink without changing what the process computes: the context's local memory.

The driver reserves local memory (thread stacks, register spills) for every thread that can be resident
on the device: the per-thread stack limit × the device's resident threads (132 SMs × 2048 threads on an
H100/H200: 264 MiB per KiB of stack). It grows the limit on its own when a kernel needs more and never
shrinks it, so a serving engine carries the largest stack any of its kernels ever asked for, and the CUDA
checkpoint copies that reservation into the process image and back at every restore, although no byte of
it outlives a kernel. :class:`LocalMemoryTrim` lowers the limit just before the checkpoint (the reservation
is freed at once) and sets the captured value back at resume, before any kernel runs again, so every
graph and kernel meets the limit it was captured with.

``COLDSNAP_TRIM_LOCAL_MEMORY=0`` leaves the limit alone (the benchmarks' A/B)."""

from __future__ import annotations

import logging
import sys
from typing import Any, Iterable
from coldsnap.settings import SETTINGS

__all__ = ["LocalMemoryTrim", "TRIM_ENV", "TRIMMED_STACK_BYTES", "cuda_devices_in_use", "cuda_torch", "device_used_bytes",
           "torch_pool_bytes"]

log = logging.getLogger(__name__)

TRIM_ENV = "COLDSNAP_TRIM_LOCAL_MEMORY"
STACK_LIMIT = 0  # CU_LIMIT_STACK_SIZE
TRIMMED_STACK_BYTES = 16
"""The stack limit while the process is checkpointed: small, not 0 (cuCtxSetLimit's floor varies by driver)."""


def cuda_torch() -> Any:
    """The engine's torch when it has initialized CUDA in this process, else None (never imported here)."""
    torch = sys.modules.get("torch")
    return torch if torch is not None and torch.cuda.is_initialized() else None


def cuda_devices_in_use(region_devices: list[int]) -> list[int]:
    """The devices this process holds a CUDA context on: its model memory's and those torch's allocator
    reserved memory on (torch only when the engine imported it and initialized CUDA)."""
    devices = set(region_devices)
    torch = cuda_torch()
    if torch is not None:
        devices.update(d for d in range(torch.cuda.device_count()) if torch.cuda.memory_reserved(d) > 0)
    return sorted(devices)


def device_used_bytes(devices: list[int]) -> int:
    """Device memory in use on ``devices``, every process's (cuMemGetInfo); 0 without CUDA devices."""
    if not devices:
        return 0
    from coldsnap.native import native

    C = native()
    return sum(total - free for free, total in (C.device_memory(d) for d in devices))


def torch_pool_bytes(regions: Iterable[tuple[int, int]] = ()) -> dict[str, int]:
    """torch's caching allocator by kind of pool, summed over the devices: ``graph_pool_reserved`` and
    ``graph_pool_allocated`` (CUDA-graph private pools, kept while their graphs live: the free part is the
    graphs' scratch), ``other_reserved`` and ``other_allocated`` (the default pool: live tensors), and
    ``in_regions_reserved``: the segments, of either kind, that lie in one of ``regions`` (``(base, size)``
    of coldsnap's regions, which a snapshot unmaps). Empty without CUDA torch."""
    torch = cuda_torch()
    if torch is None:
        return {}
    spans = list(regions)
    out = {"graph_pool_reserved": 0, "graph_pool_allocated": 0, "other_reserved": 0, "other_allocated": 0,
           "in_regions_reserved": 0}
    for segment in torch.cuda.memory_snapshot():
        pool = segment.get("segment_pool_id", (0, 0))
        kind = "graph_pool" if tuple(pool) != (0, 0) else "other"
        size = int(segment.get("total_size", 0))
        out[f"{kind}_reserved"] += size
        out[f"{kind}_allocated"] += int(segment.get("allocated_size", 0))
        address = int(segment.get("address", -1))
        if any(base <= address < base + length for base, length in spans):
            out["in_regions_reserved"] += size
    return out


class LocalMemoryTrim:
    """Lower the context's stack limit before a checkpoint (:meth:`lower`) and set it back (:meth:`restore`)."""

    def __init__(self, native: Any = None):
        self._native = native
        self.captured: dict[int, int] = {}
        """device → the stack limit it had when :meth:`lower` ran (what :meth:`restore` sets back)."""

    def _C(self) -> Any:
        if self._native is None:
            from coldsnap.native import native

            self._native = native()
        return self._native

    def lower(self, devices: list[int]) -> dict[str, int]:
        """Lower every device's stack limit to :data:`TRIMMED_STACK_BYTES`; what it measured: the limit it
        found (``stack_bytes``, the largest over the devices) and the device memory that freed
        (``local_memory_freed_bytes``). A driver that refuses leaves that device as it was (one warning)."""
        if not SETTINGS.flag(TRIM_ENV) or not devices:
            return {}
        C = self._C()
        measured = {"stack_bytes": 0, "local_memory_freed_bytes": 0}
        for device in devices:
            try:
                stack = C.context_limit(device, STACK_LIMIT)
                if stack <= TRIMMED_STACK_BYTES:
                    continue
                free_before, _ = C.device_memory(device)
                C.set_context_limit(device, STACK_LIMIT, TRIMMED_STACK_BYTES)
                self.captured[device] = stack
                free_after, _ = C.device_memory(device)
            except C.CudaError as exc:
                log.warning("coldsnap: device %d's local memory left as it is: %s", device, exc)
                continue
            measured["stack_bytes"] = max(measured["stack_bytes"], stack)
            measured["local_memory_freed_bytes"] += max(free_after - free_before, 0)
        return measured

    def restore(self) -> None:
        """Set every lowered device's stack limit back to the captured value (idempotent), so the first
        kernels after a restore find the reservation they were captured with instead of growing it at their
        launch (the driver does that too: a graph replayed under a lowered limit ran right on the H100).
        Raises the driver's error; a device not yet set back stays owed to the next call."""
        for device, stack in list(self.captured.items()):
            self._C().set_context_limit(device, STACK_LIMIT, stack)
            del self.captured[device]

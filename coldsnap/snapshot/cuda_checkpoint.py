"""CUDA checkpoint of every GPU process of a tree, through the driver API (``coldsnap._C``).

Per process the driver walks RUNNING → LOCKED (lock) → CHECKPOINTED (checkpoint: device memory copied
to host, GPU handles released) and back (restore, then unlock). This module tracks each pid's state,
runs the processes of a tree in parallel, and undoes a partial checkpoint: if any process cannot be
locked or checkpointed, every process it already moved is restored and unlocked again, so a failed
capture leaves a running server, not a frozen one.

Device memory is copied to host at only ~2 GB/s by the driver, which is why the agent releases weights
and KV before this runs: what remains is the CUDA context, graphs and small runtime buffers.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from coldsnap.native import NativeUnavailable, native, probe_cuda

__all__ = [
    "CudaCheckpointError",
    "CheckpointDriver",
    "NativeCheckpointDriver",
    "TreeCheckpoint",
    "gpu_processes",
    "cached_probe_cuda",
    "cuda_devices",
    "start_cuda_in_background",
    "STATES",
]

STATES = {0: "running", 1: "locked", 2: "checkpointed", 3: "failed"}


class CudaCheckpointError(RuntimeError):
    """A CUDA checkpoint step failed for one process; ``rolled_back`` says whether the tree was put back,
    ``cuda_code`` is the driver's CUresult (None when no driver call failed)."""

    def __init__(self, op: str, pid: int, reason: str, rolled_back: bool = False, cuda_code: int | None = None):
        self.op, self.pid, self.reason, self.rolled_back, self.cuda_code = op, pid, reason, rolled_back, cuda_code
        suffix = "; the other processes were put back to running" if rolled_back else ""
        super().__init__(f"cuda checkpoint {op} of pid {pid} failed: {reason}{suffix}")


class CheckpointDriver(Protocol):
    """The four driver calls and the state query, per pid (raising on failure)."""

    def call(self, op: str, pid: int, timeout_ms: int = 0, gpu_pairs: list[tuple[str, str]] | None = None) -> None: ...

    def state(self, pid: int) -> str: ...


class NativeCheckpointDriver:
    """The real one: cuCheckpointProcess* through ``coldsnap._C`` (libcuda loaded at run time)."""

    def call(self, op: str, pid: int, timeout_ms: int = 0, gpu_pairs: list[tuple[str, str]] | None = None) -> None:
        C = native()
        try:
            C.checkpoint_call(op, pid, timeout_ms, gpu_pairs or [])
        except C.CudaError as exc:
            raise CudaCheckpointError(op, pid, str(exc), cuda_code=exc.code) from None

    def state(self, pid: int) -> str:
        C = native()
        try:
            return STATES.get(C.checkpoint_state(pid), "unknown")
        except C.CudaError as exc:
            raise CudaCheckpointError("state", pid, str(exc), cuda_code=exc.code) from None


PROBE_CACHE = "cuda-probe.json"


def cached_probe_cuda(cache_dir: Path | None) -> dict:
    """:func:`coldsnap.native.probe_cuda`, kept in ``cache_dir`` (a restore's state root) while the boot,
    the NVIDIA driver and the GPUs asked for (``CUDA_VISIBLE_DEVICES``, ``CUDA_DEVICE_ORDER``) are the
    same: initializing CUDA for the probe took ~0.15 s of every restore's admission. Only a probe that
    found GPUs is kept. The launcher still initializes CUDA for the checkpoint API, beside CRIU
    (:func:`start_cuda_in_background`)."""
    from coldsnap.host import keep_boot_fact, kept_boot_fact, nvidia_kernel_driver

    driver = nvidia_kernel_driver()
    key = [driver, os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get("CUDA_DEVICE_ORDER"), os.geteuid()]
    cache_dir = cache_dir if driver else None  # no driver: nothing worth keeping
    kept = kept_boot_fact(cache_dir, PROBE_CACHE, key)
    if isinstance(kept, dict):
        return kept
    probe = probe_cuda()
    if probe.get("available") and probe.get("devices"):
        keep_boot_fact(cache_dir, PROBE_CACHE, key, probe)
    return probe


def start_cuda_in_background() -> threading.Thread:
    """Initialize CUDA in this process on a thread (~0.15 s of driver start-up), so the checkpoint API is
    ready when the restored tree is; the CUDA restore's own calls wait for it inside the driver."""
    thread = threading.Thread(target=probe_cuda, name="coldsnap-cuda-init", daemon=True)
    thread.start()
    return thread


def cuda_devices(cache_dir: Path | None = None) -> list[dict]:
    """The GPUs this process sees (``coldsnap._C.cuda_probe``; through :func:`cached_probe_cuda` with a
    ``cache_dir``), [] without a driver."""
    probe = cached_probe_cuda(cache_dir) if cache_dir is not None else probe_cuda()
    return list(probe["devices"]) if probe["available"] else []


def gpu_processes(pids: list[int]) -> list[int]:
    """The pids that hold an NVIDIA device open (the ones the driver must checkpoint)."""
    found = []
    for pid in pids:
        try:
            targets = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:
            continue
        if any(t.startswith("/dev/nvidia") for t in targets):
            found.append(pid)
    return found


@dataclass
class TreeCheckpoint:
    """Checkpoint and restore a set of GPU processes together."""

    driver: CheckpointDriver = field(default_factory=NativeCheckpointDriver)
    lock_timeout_ms: int = 60_000
    states: dict[int, str] = field(default_factory=dict)
    """Where each pid is, as far as this object moved it."""

    def _each(self, op: str, pids: list[int], **kwargs: object) -> dict[int, tuple[str, int | None]]:
        """Run ``op`` on every pid in parallel; returns {pid: (error, CUresult or None)} for the ones that failed."""
        def run(pid: int) -> tuple[str, int | None] | None:
            try:
                self.driver.call(op, pid, **kwargs)  # type: ignore[arg-type]
                return None
            except (CudaCheckpointError, NativeUnavailable, OSError) as exc:
                return getattr(exc, "reason", str(exc)), getattr(exc, "cuda_code", None)

        with ThreadPoolExecutor(max_workers=max(1, len(pids))) as pool:
            results = dict(zip(pids, pool.map(run, pids)))
        return {pid: error for pid, error in results.items() if error is not None}

    def checkpoint(self, pids: list[int]) -> None:
        """Lock then checkpoint every pid; on any failure put all of them back to running and raise."""
        failed = self._each("lock", pids, timeout_ms=self.lock_timeout_ms)
        for pid in pids:
            self.states[pid] = "running" if pid in failed else "locked"
        if not failed:
            failed = self._each("checkpoint", pids)
            for pid in pids:
                if pid not in failed:
                    self.states[pid] = "checkpointed"
            op = "checkpoint"
        else:
            op = "lock"
        if failed:
            pid, (reason, code) = next(iter(failed.items()))
            self._roll_back(pids)
            raise CudaCheckpointError(op, pid, reason, rolled_back=True, cuda_code=code)

    def _roll_back(self, pids: list[int]) -> None:
        checkpointed = [p for p in pids if self.states.get(p) == "checkpointed"]
        for pid in checkpointed:
            try:
                self.driver.call("restore", pid)
                self.states[pid] = "locked"
            except CudaCheckpointError:
                self.states[pid] = "failed"
        for pid in [p for p in pids if self.states.get(p) == "locked"]:
            try:
                self.driver.call("unlock", pid)
                self.states[pid] = "running"
            except CudaCheckpointError:
                self.states[pid] = "failed"

    def restore(self, pids: list[int], gpu_pairs: list[tuple[str, str]] | None = None) -> None:
        """Restore (remapping GPUs by UUID pairs) then unlock every pid. No rollback: the caller kills the tree."""
        for op, kwargs in (("restore", {"gpu_pairs": gpu_pairs or []}), ("unlock", {})):
            failed = self._each(op, pids, **kwargs)
            for pid in pids:
                if pid in failed:
                    self.states[pid] = "failed"
                else:
                    self.states[pid] = "locked" if op == "restore" else "running"
            if failed:
                pid, (reason, code) = next(iter(failed.items()))
                raise CudaCheckpointError(op, pid, reason, cuda_code=code)

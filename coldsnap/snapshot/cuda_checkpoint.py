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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

from coldsnap.native import NativeUnavailable, native, probe_cuda

__all__ = [
    "CudaCheckpointError",
    "CheckpointDriver",
    "NativeCheckpointDriver",
    "TreeCheckpoint",
    "gpu_processes",
    "cuda_devices",
    "STATES",
]

STATES = {0: "running", 1: "locked", 2: "checkpointed", 3: "failed"}


class CudaCheckpointError(RuntimeError):
    """A CUDA checkpoint step failed for one process; ``rolled_back`` says whether the tree was put back."""

    def __init__(self, op: str, pid: int, reason: str, rolled_back: bool = False):
        self.op, self.pid, self.reason, self.rolled_back = op, pid, reason, rolled_back
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
            raise CudaCheckpointError(op, pid, str(exc)) from None

    def state(self, pid: int) -> str:
        C = native()
        try:
            return STATES.get(C.checkpoint_state(pid), "unknown")
        except C.CudaError as exc:
            raise CudaCheckpointError("state", pid, str(exc)) from None


def cuda_devices() -> list[dict]:
    """The GPUs this process sees (``coldsnap._C.cuda_probe``), [] without a driver."""
    probe = probe_cuda()
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

    def _each(self, op: str, pids: list[int], **kwargs: object) -> dict[int, str]:
        """Run ``op`` on every pid in parallel; returns {pid: error} for the ones that failed."""
        def run(pid: int) -> str | None:
            try:
                self.driver.call(op, pid, **kwargs)  # type: ignore[arg-type]
                return None
            except (CudaCheckpointError, NativeUnavailable, OSError) as exc:
                return getattr(exc, "reason", str(exc))

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
            pid, reason = next(iter(failed.items()))
            self._roll_back(pids)
            raise CudaCheckpointError(op, pid, reason, rolled_back=True)

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
                pid, reason = next(iter(failed.items()))
                raise CudaCheckpointError(op, pid, reason)

"""Dynamically enabled x86 register state (AMX tiles) across a process snapshot.

Linux hands out AMX tile state (XTILEDATA) only to processes that asked for it with
``arch_prctl(ARCH_REQ_XCOMP_PERM)``; oneDNN (torch's CPU kernels, vLLM's CPU build) asks on first use.
The permission is process state CRIU 4.2 does not restore, so a restored process that runs an AMX
kernel again dies of SIGILL. The agent records the permissions before the snapshot and asks for them
again at resume, before anything runs. No-op elsewhere than x86-64 Linux.
"""

from __future__ import annotations

import ctypes
import platform

__all__ = ["dynamic_permissions", "request_permissions"]

SYS_ARCH_PRCTL = 158  # x86-64
ARCH_GET_XCOMP_PERM = 0x1022
ARCH_REQ_XCOMP_PERM = 0x1023
DYNAMIC_FEATURES = (18,)  # XTILEDATA: the only dynamically enabled feature so far

_libc = ctypes.CDLL(None, use_errno=True) if platform.system() == "Linux" else None


def _supported_libc() -> ctypes.CDLL | None:
    """libc where ``arch_prctl`` has the xstate permission calls (Linux on x86-64), else None."""
    return _libc if platform.machine() in ("x86_64", "AMD64") else None


def dynamic_permissions() -> int:
    """This process's permitted dynamic xstate features (a bit mask; 0 when unknown)."""
    libc = _supported_libc()
    if libc is None:
        return 0
    mask = ctypes.c_uint64(0)
    if libc.syscall(SYS_ARCH_PRCTL, ARCH_GET_XCOMP_PERM, ctypes.byref(mask)) != 0:
        return 0
    return int(mask.value) & sum(1 << bit for bit in DYNAMIC_FEATURES)


def request_permissions(mask: int) -> list[int]:
    """Ask again for every dynamic feature in ``mask``; returns the features the kernel refused."""
    libc = _supported_libc()
    if libc is None:
        return []
    refused = []
    for bit in DYNAMIC_FEATURES:
        if mask & (1 << bit) and libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, bit) != 0:
            refused.append(bit)
    return refused

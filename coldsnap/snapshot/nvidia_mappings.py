"""NVIDIA userspace-driver state in a process tree: what an n580 template must not hold.

A template restored under another NVIDIA driver must carry nothing of the captured one: no mapping of
``libcuda``, ``libnvidia-*`` (the userspace driver libraries, tied to the kernel driver's version) or a
``/dev/nvidia*`` device, and no open ``/dev/nvidia*`` file. Read from ``/proc/PID/maps`` and
``/proc/PID/fd``; a process that vanished meanwhile is skipped.
"""

from __future__ import annotations

import os
import re

__all__ = ["nvidia_userspace_state", "NVIDIA_PATH"]

NVIDIA_PATH = re.compile(r"(^/dev/nvidia)|(/libcuda(debugger)?\.so)|(/libnvidia-[^/]*\.so)|(/libnvcuvid\.so)")
"""Paths that belong to the NVIDIA driver (not the CUDA toolkit's libraries, which any host can load)."""


def nvidia_userspace_state(pids: list[int]) -> list[str]:
    """``"PID: path"`` for every NVIDIA driver mapping or open device in ``pids`` (empty: none)."""
    found: list[str] = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as maps:
                paths = {line.split(None, 5)[5].strip() for line in maps if len(line.split(None, 5)) == 6}
            fds = os.listdir(f"/proc/{pid}/fd")
        except (FileNotFoundError, ProcessLookupError):
            continue
        for fd in fds:
            try:
                paths.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:  # closed meanwhile
                continue
        found.extend(f"{pid}: {path}" for path in paths if NVIDIA_PATH.search(path))
    return sorted(set(found))

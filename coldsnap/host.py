"""Facts about this host that capture, restore admission and ``coldsnap doctor`` all read.

Reading them is cheap and side-effect free (no CUDA initialization here: that is
:func:`coldsnap.native.probe_cuda`). ``doctor`` reports them; activation records them at capture and
compares them at restore.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from coldsnap.atomic import write_atomic
from coldsnap.settings import SETTINGS

__all__ = ["PF_EXITING", "STATE_DIR_ENV", "boot_id", "keep_boot_fact", "kept_boot_fact", "nvidia_kernel_driver", "host_facts",
           "live_start_ticks", "pid_alive", "process_start_ticks", "stat_fields", "state_root"]

PF_EXITING = 0x4  # include/linux/sched.h: the task is in do_exit()
STATE_DIR_ENV = "COLDSNAP_STATE_DIR"

_NVIDIA_PROC = Path("/proc/driver/nvidia/version")


def nvidia_kernel_driver(proc_file: Path = _NVIDIA_PROC) -> str | None:
    """The NVIDIA kernel module version (``580.159.04``), or ``None`` without the driver."""
    try:
        text = proc_file.read_text()
    except OSError:
        return None
    match = re.search(r"Kernel Module(?: for [^ ]+)?\s+([0-9]+(?:\.[0-9]+)+)", text)
    return match.group(1) if match else None


def state_root() -> Path:
    """Where coldsnap keeps what restores write on this host (:mod:`coldsnap.activation.state` says what):
    ``COLDSNAP_STATE_DIR``, else ``$XDG_RUNTIME_DIR/coldsnap``, else ``/run/coldsnap`` (root), else
    ``/tmp/coldsnap-<uid>``."""
    chosen = SETTINGS.text(STATE_DIR_ENV) or (
        str(Path(os.environ["XDG_RUNTIME_DIR"]) / "coldsnap") if os.environ.get("XDG_RUNTIME_DIR") else "")
    if chosen:
        return Path(chosen)
    return Path("/run/coldsnap") if os.geteuid() == 0 else Path(f"/tmp/coldsnap-{os.getuid()}")


def boot_id() -> str:
    """This boot's random id (``/proc/sys/kernel/random/boot_id``; "" when unreadable): facts cached
    under it (a ``criu check`` verdict, the GPUs) hold until the next reboot."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def kept_boot_fact(cache_dir: Path | None, name: str, key: list[Any]) -> Any:
    """The value :func:`keep_boot_fact` kept as ``cache_dir/name`` for ``key`` in this boot, else None."""
    boot = boot_id()
    if cache_dir is None or not boot:
        return None
    try:
        kept = json.loads((cache_dir / name).read_text())
    except (OSError, ValueError):
        return None
    return kept.get("value") if isinstance(kept, dict) and kept.get("key") == [boot, *key] else None


def keep_boot_fact(cache_dir: Path | None, name: str, key: list[Any], value: Any) -> None:
    """Keep ``value`` (JSON) as ``cache_dir/name``, valid for ``key`` until the next reboot; best effort
    (a read-only or missing directory keeps nothing: each caller then asks afresh)."""
    boot = boot_id()
    if cache_dir is None or not boot:
        return
    try:
        write_atomic(cache_dir / name, json.dumps({"key": [boot, *key], "value": value}).encode())
    except (OSError, TypeError, ValueError):
        pass


def host_facts() -> dict[str, str | bool]:
    """Kernel release, CPU architecture and whether this process is root (CRIU needs it)."""
    system = os.uname()  # (what the platform module reads, without importing it: a restore's entry imports this)
    return {"kernel": system.release, "arch": system.machine, "root": os.geteuid() == 0}


def stat_fields(pid: int | str = "self") -> list[bytes]:
    """A process's ``/proc/<pid>/stat`` fields after its name: proc(5)'s fields 3 on (state, ppid, pgrp,
    session, tty_nr, tpgid, flags, ...; field N is index N - 3). The name may hold spaces and ')', so it is
    cut at the last ')'. OSError when the process is gone."""
    with open(f"/proc/{pid}/stat", "rb") as handle:
        return handle.read().rsplit(b")", 1)[1].split()


def process_start_ticks() -> int:
    """This process's start time in clock ticks since boot (/proc/self/stat, field 22): CRIU restores a
    process as a new kernel task, so it differs after a restore."""
    return int(stat_fields()[19])


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (one of another user's counts; a zombie too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def live_start_ticks(pid: int) -> int | None:
    """The start time of ``pid`` (clock ticks since boot, field 22) while it lives; None once it is gone,
    a zombie or exiting (SIGKILLed). Together with the pid it names one process: a reused pid differs."""
    try:
        fields = stat_fields(pid)
        if fields[0] in (b"Z", b"X") or int(fields[6]) & PF_EXITING:
            return None
        return int(fields[19])
    except (OSError, IndexError, ValueError):
        return None

"""Tests find and kill the processes they started by a recorded process group id, never by matching
command lines (a command-line pattern also matches other runs' processes, and misses processes that
renamed themselves).

Every tree a test cares about leads its own process group, so its pid is its pgid:

- ``coldsnap capture`` starts the engine with ``start_new_session=True``; its pid is the capture
  receipt's ``capture.launch`` span attribute ``pid`` (failed receipts carry the span too, once the
  launch step ran) and the capsule's ``metadata.root_pid``;
- ``coldsnap restore`` (and ``warm``) restores the tree in pid namespaces of its own (one per replica),
  where it has its captured pids, sessions and process groups; on this host its processes are the
  members of :func:`replica_members` (their innermost process group is the capsule's ``root_pid``), its
  root's host pid is the receipt's (:func:`restored_pid`);
- cold starts in tests are ``subprocess.Popen(..., start_new_session=True)``: their pid.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from coldsnap.host import PF_EXITING, stat_fields
from coldsnap.snapshot import process_tree

__all__ = ["group_members", "kill_group", "wait_group_gone", "launched_pid", "capsule_root_pid",
           "restore_killed_at", "replica_members", "kill_replicas", "wait_replicas_gone"]

def group_members(pgid: int) -> list[int]:
    """The live processes whose process group is ``pgid``, sorted; threads excluded.

    Not live: zombies, and processes already exiting (``PF_EXITING``: SIGKILLed, never to run user code
    again), which a test must not mistake for a survivor.
    """
    assert isinstance(pgid, int) and pgid > 1, f"not a recorded process group id: {pgid!r}"  # never vacuously []
    return process_tree.group_members(pgid, exiting=False)


def wait_group_gone(pgid: int, timeout: float) -> list[int]:
    """Wait up to ``timeout`` s for ``pgid`` to have no live members; the members left (``[]``: gone)."""
    deadline = time.monotonic() + timeout
    while (members := group_members(pgid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return members


def kill_group(pgid: int, timeout: float = 10) -> list[int]:
    """SIGKILL process group ``pgid`` (nothing to do if it has no members) and wait up to ``timeout`` s
    until none is left; the members still alive then (``[]``). Never raises: it runs in cleanups."""
    socket_files = process_tree.bound_socket_files(group_members(pgid))
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return []
    try:
        return wait_group_gone(pgid, timeout)
    finally:
        process_tree.remove_socket_files(socket_files)  # (a SIGKILLed vLLM leaves its ZeroMQ ipc:// files)


def launched_pid(receipt: dict[str, Any]) -> int | None:
    """The engine pid a capture receipt (succeeded or failed) recorded at launch; None: nothing was launched."""
    for span in receipt["timing"]["spans"]:
        if span["name"] == "capture.launch" and "pid" in span.get("attributes", {}):
            return int(span["attributes"]["pid"])
    return None


def capsule_root_pid(artifact: str | os.PathLike[str], unit: str = "unit-0") -> int:
    """The captured tree's root pid (and so the pgid of every restore of it), from the unit's capsule."""
    return int(json.loads((Path(artifact) / "units" / unit / "capsule.json").read_text())["metadata"]["root_pid"])


def replica_members(artifact: str | os.PathLike[str], unit: str = "unit-0", exiting: bool = False) -> list[int]:
    """Host pids of the live processes restored from ``artifact`` (any of its replicas), sorted: those in a
    pid namespace other than this one whose process group there is the capsule's ``root_pid``. Zombies
    left out, and exiting processes too (as in :func:`group_members`) unless ``exiting``: one that is exiting
    still holds its files and sockets until it is a zombie."""
    captured = capsule_root_pid(artifact, unit)
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        pgids = fields.get("NSpgid", "").split()
        if len(pgids) < 2 or int(pgids[-1]) != captured:
            continue
        try:
            stat = stat_fields(entry)
        except OSError:
            continue
        if stat[0] not in (b"Z", b"X") and (exiting or not int(stat[6]) & PF_EXITING):
            members.append(int(entry))
    return sorted(members)


def kill_replicas(artifact: str | os.PathLike[str], timeout: float = 10) -> list[int]:
    """SIGKILL every process restored from ``artifact`` and wait up to ``timeout`` s until none is left;
    the ones still alive then (``[]``). Never raises: it runs in cleanups."""
    members = replica_members(artifact)
    socket_files = process_tree.bound_socket_files(members)
    for pid in members:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        return wait_replicas_gone(artifact, timeout)
    finally:
        process_tree.remove_socket_files(socket_files)


def wait_replicas_gone(artifact: str | os.PathLike[str], timeout: float) -> list[int]:
    """Wait up to ``timeout`` s for ``artifact`` to have no live restored process, an exiting one included (its
    serving port is free only once it is a zombie: a next test's restore of the same port once found it taken);
    those left (``[]``: gone)."""
    deadline = time.monotonic() + timeout
    while (members := replica_members(artifact, exiting=True)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [pid for pid in members if pid in replica_members(artifact)] if members else []


def restore_killed_at(artifact: str | os.PathLike[str], step: str, receipt: str | os.PathLike[str],
                      env: dict[str, str] | None = None, operation: str = "restore") -> subprocess.Popen[bytes]:
    """Run ``coldsnap restore`` of ``artifact`` and SIGKILL it as the span ``step`` starts (read from its
    live timing events); returns the reaped launcher (its returncode is -SIGKILL unless it ended first)."""
    launcher = subprocess.Popen([sys.executable, "-m", "coldsnap", operation, str(artifact), "--receipt-json", str(receipt),
                                 "--timing-events", "-"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    try:
        assert launcher.stdout is not None
        for line in launcher.stdout:
            event = json.loads(line)
            if event.get("event") == "span_start" and event.get("name") == step:
                launcher.kill()
                break
        launcher.wait(10)
    finally:
        launcher.kill()
        launcher.wait()
    return launcher

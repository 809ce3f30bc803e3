"""The serving port's lock: one holder per port, the loser told who holds it, released however the
holder ends."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from coldsnap.activation.operation_locks import LockHeld, PortLock, holder_of

PORT = 1  # the lock is a name, not a bind of the port: any number works, a privileged one collides with nothing


def test_a_second_lock_of_the_port_names_the_holder():
    with PortLock(PORT, "restore", "restore-a", "/artifacts/a"):
        with pytest.raises(LockHeld) as held:
            PortLock(PORT, "warm", "warm-b", "/artifacts/a").acquire()
        holder = held.value.holder
        assert (holder.pid, holder.operation, holder.operation_id, holder.artifact) == (
            os.getpid(), "restore", "restore-a", "/artifacts/a")
        assert "restore restore-a of /artifacts/a (pid" in str(held.value)
        with PortLock(PORT + 1, "restore", "restore-c", None):  # another port is another lock
            pass
    with PortLock(PORT, "warm", "warm-b", None):  # released: the next one takes it
        assert holder_of(PORT).operation_id == "warm-b"
    assert holder_of(PORT).pid is None


def test_the_standby_lock_is_one_per_artifact_and_not_a_port():
    from coldsnap.activation.operation_locks import OperationLock

    with OperationLock("standby-0123456789abcdef", "the warm standby of /a", "warm", "warm-1", "/a"):
        with pytest.raises(LockHeld, match=r"^the warm standby of /a is being set up by warm warm-1 of /a \(pid "):
            OperationLock("standby-0123456789abcdef", "the warm standby of /a", "wake", "wake-2", "/a").acquire()
        with PortLock(PORT, "restore", "restore-a", "/a"):  # a port's lock is another lock
            pass


def test_a_holder_gone_before_it_is_asked_leaves_the_lock_to_take(monkeypatch):
    """A racer whose bind failed while another held the lock, the holder gone when it is asked who holds it
    (pid unknown): the lock is free, so it is taken, not refused as held by no one (CI saw "(pid ?)")."""
    from coldsnap.activation import operation_locks

    other = PortLock(PORT, "restore", "restore-gone", None).acquire()
    asked = []

    def holder_lets_go(key: str, timeout: float = 1.0):
        asked.append(key)
        other.release()
        return operation_locks.LockHolder(pid=None)

    monkeypatch.setattr(operation_locks, "_holder", holder_lets_go)
    with PortLock(PORT, "restore", "restore-next", None) as lock:
        assert asked == [f"port-{PORT}"] and lock._socket is not None
    monkeypatch.undo()
    assert holder_of(PORT).pid is None


def test_a_killed_holder_leaves_no_lock():
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\n"
                               "from coldsnap.activation.operation_locks import PortLock\n"
                               f"PortLock({PORT}, 'restore', 'restore-k', None).acquire()\n"
                               "print('held', flush=True)\ntime.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        assert holder_of(PORT).pid == holder.pid
    finally:
        holder.kill()
        holder.wait()
    with PortLock(PORT, "restore", "restore-after", None):
        pass


def test_capture_onto_a_locked_port_launches_nothing(tmp_path):
    """(A port something listens on: tests/integration/test_capture_refusals.py.)"""
    from tests.helpers import coldsnap_receipt

    marker = tmp_path / "launched"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with PortLock(port, "restore", "restore-x", "/elsewhere"):
        done, receipt = coldsnap_receipt("capture", "--engine", "torch-lm", "--out", str(tmp_path / "a"), "--port",
                                         str(port), "--", sys.executable, "-c", f"open({str(marker)!r}, 'w')")
    assert done.returncode == 1 and receipt["error"]["code"] == "capture.port", done.stderr[-2000:]
    assert f"restore restore-x of /elsewhere (pid {os.getpid()})" in receipt["error"]["message"]
    assert not marker.exists() and not (tmp_path / "a").exists()

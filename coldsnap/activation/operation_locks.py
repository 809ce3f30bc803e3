"""One operation per serving port, and one warm standby per artifact, on a host: the locks that restore,
warm, wake and capture take at admission, before they touch anything that belongs to the port (its
replica state directory, its socket files, the port itself), and hold until they end. Warm and wake also
take their artifact's standby lock (warms onto different ports must not both record a standby).

A lock is an abstract unix socket, ``@coldsnap-port-<P>`` or ``@coldsnap-standby-<artifact id>``, bound
and listening in the operation's process: the kernel gives it to one process only, drops it when that
process exits however it exits (a ``kill -9`` leaves no stale lock and no file anywhere), and it is as
wide as what it guards — a network namespace's TCP ports and abstract socket names live in the same
namespace. A loser connects to it and
learns who holds it: the holder's pid from the kernel (``SO_PEERCRED``), its operation id and artifact
from one line the holder's thread answers with.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from coldsnap.operation import OperationContext

__all__ = ["OperationLock", "LockHeld", "LockHolder", "PortLock", "hold_port", "hold_standby", "holder_of", "lock_name"]


_TRIES = 5
"""Binds tried while each failure's holder is gone by the time it is asked (locks changing hands fast)."""

_held_here: dict[str, "OperationLock"] = {}
"""The locks this process holds, by key."""


def lock_name(key: str) -> bytes:
    return f"\0coldsnap-{key}".encode()


def _port_key(port: int) -> str:
    return f"port-{port}"


@dataclass(frozen=True)
class LockHolder:
    """Who holds a port's lock: the kernel's pid, and what the holder says it is doing (``None`` when it
    did not answer in time — a process busy in C code, or a lock taken by another coldsnap)."""

    pid: int | None
    operation: str | None = None
    operation_id: str | None = None
    artifact: str | None = None

    def describe(self) -> str:
        doing = f"{self.operation} {self.operation_id}" if self.operation and self.operation_id else "an operation"
        where = f" of {self.artifact}" if self.artifact else ""
        return f"{doing}{where} (pid {self.pid if self.pid is not None else '?'})"


class LockHeld(Exception):
    """A lock is held by another process."""

    def __init__(self, what: str, holder: LockHolder):
        self.holder = holder
        super().__init__(f"{what} is being set up by {holder.describe()}")


class OperationLock:
    """One lock (``key``: ``port-<P>``, ``standby-<artifact id>``), held from :meth:`acquire` until
    :meth:`release` (or this process's end). A loser is told the holder's operation, operation id and
    artifact; ``what`` names the locked thing in its error."""

    def __init__(self, key: str, what: str, operation: str, operation_id: str, artifact: str | None):
        self.key = key
        self.what = what
        self._answer = (json.dumps({"operation": operation, "operation_id": operation_id, "artifact": artifact})
                        + "\n").encode()
        self._socket: socket.socket | None = None
        self._thread: threading.Thread | None = None

    def acquire(self) -> "OperationLock":
        """Take the lock or raise :class:`LockHeld` naming the holder; never waits for it to let go. A holder gone
        between the failed bind and the question who holds it (a racer that lost too and let go) leaves
        the lock free: it is taken on another try, not reported as held by no one."""
        for attempt in range(_TRIES):
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            try:
                listener.bind(lock_name(self.key))
                break
            except OSError:
                listener.close()
            holder = _holder(self.key)
            if holder.pid is not None:
                raise LockHeld(self.what, holder)
            # Bound but not listening yet (the holder between its bind and listen: on a loaded host that can
            # outlast a few tight tries), or gone: a little later it answers, or the lock is free
            time.sleep(0.005 * 2 ** attempt)
        else:
            raise LockHeld(self.what, holder)
        listener.listen(8)
        self._socket = listener
        _held_here[self.key] = self
        self._thread = threading.Thread(target=self._answer_losers, name=f"coldsnap-lock-{self.key}", daemon=True)
        self._thread.start()
        return self

    def _answer_losers(self) -> None:
        listener = self._socket
        assert listener is not None
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:  # released: the listener was shut down
                return
            with connection:
                try:
                    connection.settimeout(1.0)
                    connection.sendall(self._answer)
                except OSError:
                    pass

    def release(self) -> None:
        listener, self._socket = self._socket, None
        if listener is None:
            return
        _held_here.pop(self.key, None)
        try:
            listener.shutdown(socket.SHUT_RDWR)  # wakes the thread's accept()
        except OSError:
            pass
        listener.close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> "OperationLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


class PortLock(OperationLock):
    """The lock of one serving port."""

    def __init__(self, port: int, operation: str, operation_id: str, artifact: str | None):
        super().__init__(_port_key(port), f"serving port {port}", operation, operation_id, artifact)
        self.port = port


def holder_of(port: int, timeout: float = 1.0) -> LockHolder:
    """Who holds ``port``'s lock, asked over the lock itself (a released lock: pid None)."""
    return _holder(_port_key(port), timeout)


def _holder(key: str, timeout: float = 1.0) -> LockHolder:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as probe:
        probe.settimeout(timeout)
        try:
            probe.connect(lock_name(key))
        except OSError:
            return LockHolder(pid=None)
        pid, _, _ = struct.unpack("3i", probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        answer = b""
        try:
            while not answer.endswith(b"\n") and len(answer) < 4096:
                chunk = probe.recv(4096)
                if not chunk:
                    break
                answer += chunk
            said = json.loads(answer)
        except (OSError, ValueError):
            return LockHolder(pid=pid)
    if not isinstance(said, dict):
        return LockHolder(pid=pid)
    return LockHolder(pid=pid, operation=_text(said.get("operation")), operation_id=_text(said.get("operation_id")),
                      artifact=_text(said.get("artifact")))


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None


def hold_port(context: "OperationContext", port: int, artifact: str | None, code: str = "admission.port") -> OperationLock:
    """Take ``port``'s lock for the rest of the operation (:meth:`OperationContext.hold`), or fail with
    ``code`` naming the holder: the loser of a race touches nothing."""
    request = context.request
    return _hold(context, PortLock(port, request.operation, request.operation_id, artifact), code)


def hold_standby(context: "OperationContext", artifact_id: str, artifact: str, code: str) -> OperationLock:
    """Take the lock of the artifact's warm standby (one per artifact) for the rest of the operation."""
    request = context.request
    return _hold(context, OperationLock(f"standby-{artifact_id}", f"the warm standby of {artifact}", request.operation,
                                        request.operation_id, artifact), code)


def _hold(context: "OperationContext", lock: OperationLock, code: str) -> OperationLock:
    from coldsnap.operation import OperationFailed

    if lock.key in _held_here:  # this process holds it already: a capture's check restore of its own capsule
        return _held_here[lock.key]
    try:
        return context.hold(lock)
    except LockHeld as exc:
        raise OperationFailed(code, f"{exc}; nothing was started (retry once it has ended)") from None

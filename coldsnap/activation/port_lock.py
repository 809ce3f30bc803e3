"""One operation per serving port on a host: the lock that restore, warm, wake and capture take at
admission, before they touch anything that belongs to the port (its replica state directory, its socket
files, the port itself), and hold until they end.

The lock is an abstract unix socket, ``@coldsnap-port-<P>``, bound and listening in the operation's
process: the kernel gives it to one process only, drops it when that process exits however it exits (a
``kill -9`` leaves no stale lock and no file anywhere), and it is as wide as what it guards — a network
namespace's TCP ports and abstract socket names live in the same namespace. A loser connects to it and
learns who holds it: the holder's pid from the kernel (``SO_PEERCRED``), its operation id and artifact
from one line the holder's thread answers with.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from coldsnap.operation import OperationContext

__all__ = ["PortHeld", "PortHolder", "PortLock", "hold_port", "holder_of", "lock_name"]


_held_here: dict[int, "PortLock"] = {}
"""The ports this process holds the lock of."""


def lock_name(port: int) -> bytes:
    return f"\0coldsnap-port-{port}".encode()


@dataclass(frozen=True)
class PortHolder:
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


class PortHeld(Exception):
    """The port's lock is held by another process."""

    def __init__(self, port: int, holder: PortHolder):
        self.port = port
        self.holder = holder
        super().__init__(f"serving port {port} is being set up by {holder.describe()}")


class PortLock:
    """The lock of one serving port, held from :meth:`acquire` until :meth:`release` (or this process's
    end). ``about`` is what a loser is told: operation, operation id, artifact."""

    def __init__(self, port: int, operation: str, operation_id: str, artifact: str | None):
        self.port = port
        self._answer = (json.dumps({"operation": operation, "operation_id": operation_id, "artifact": artifact})
                        + "\n").encode()
        self._socket: socket.socket | None = None
        self._thread: threading.Thread | None = None

    def acquire(self) -> "PortLock":
        """Take the lock or raise :class:`PortHeld` naming the holder; never waits for it."""
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            listener.bind(lock_name(self.port))
        except OSError:
            listener.close()
            raise PortHeld(self.port, holder_of(self.port)) from None
        listener.listen(8)
        self._socket = listener
        _held_here[self.port] = self
        self._thread = threading.Thread(target=self._answer_losers, name=f"coldsnap-port-lock-{self.port}", daemon=True)
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
        _held_here.pop(self.port, None)
        try:
            listener.shutdown(socket.SHUT_RDWR)  # wakes the thread's accept()
        except OSError:
            pass
        listener.close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> "PortLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def holder_of(port: int, timeout: float = 1.0) -> PortHolder:
    """Who holds ``port``'s lock, asked over the lock itself (a released lock: pid None)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as probe:
        probe.settimeout(timeout)
        try:
            probe.connect(lock_name(port))
        except OSError:
            return PortHolder(pid=None)
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
            return PortHolder(pid=pid)
    if not isinstance(said, dict):
        return PortHolder(pid=pid)
    return PortHolder(pid=pid, operation=_text(said.get("operation")), operation_id=_text(said.get("operation_id")),
                      artifact=_text(said.get("artifact")))


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None


def hold_port(context: "OperationContext", port: int, artifact: str | None, code: str = "admission.port") -> PortLock:
    """Take ``port``'s lock for the rest of the operation (:meth:`OperationContext.hold`), or fail with
    ``code`` naming the holder: the loser of a race touches nothing."""
    from coldsnap.operation import OperationFailed

    request = context.request
    if port in _held_here:  # this process holds it already: a capture's check restore of its own capsule
        return _held_here[port]
    try:
        return context.hold(PortLock(port, request.operation, request.operation_id, artifact))
    except PortHeld as exc:
        raise OperationFailed(code, f"{exc}; nothing was started (retry once it has ended)") from None

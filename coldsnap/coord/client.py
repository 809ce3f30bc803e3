"""A participant's connection to the CSKV coordinator: a rank's, or a launch unit's launcher's (one
client per thread; its keepalive thread shares it under a lock)."""

from __future__ import annotations

import threading
import time
from typing import Any

import zmq
import zmq.utils.monitor

from coldsnap.coord.frames import MAX_VALUE_BYTES, Frame, FrameError, Kind, decode_frame, encode_frame

__all__ = ["CoordinatorClient", "CoordinatorError"]

# The coordinator must answer within the operation's own timeout plus this much.
_GRACE_S = 2.0
_HEARTBEAT_S = 0.25


class CoordinatorError(RuntimeError):
    """A barrier, put or get failed, or the coordinator is gone; the message says which and why."""

    failure_code = "agent.collectives"  # how the agent reports it to the launcher (coldsnap.agent.protocol)


class CoordinatorClient:
    """``role``: ``rank`` (an engine process) or ``unit`` (a launch unit's launcher, ``rank`` then its unit
    index). ``keepalive``: heartbeat from a thread of its own all the time, not only while waiting, so the
    coordinator notices within ``LOST_AFTER_S`` when this process dies during its own long steps (a unit's
    CRIU restore) and fails the activation for every other participant at once."""

    def __init__(self, endpoint: str, token: bytes, rank: int, connect_timeout: float = 10.0,
                 context: zmq.Context | None = None, role: str = "rank", keepalive: bool = False):
        self.endpoint = endpoint
        self.token = token
        self.rank = rank
        self.role = role
        self.address: str | None = None
        """This participant's address on the activation's network, where its peers reach it (the launcher's
        placement; ``None``: as it was at capture)."""
        self._send_seq = 0
        self._recv_seq = 0
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self.context = context or zmq.Context.instance()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        # A crashed host sends no FIN: ZMTP heartbeats notice a silent peer within a few seconds.
        self.socket.setsockopt(zmq.HEARTBEAT_IVL, 500)
        self.socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3000)
        self._monitor = self.socket.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._connected_once = False
        self._gone = False
        self.socket.connect(endpoint)
        hello: dict[str, Any] = {"role": role} if role != "rank" else {}
        if keepalive:
            hello["keepalive"] = True
        try:
            self._call(Kind.HELLO, hello, connect_timeout, what="connect")
        except BaseException:
            self._close_sockets()
            raise
        self._keepalive: threading.Thread | None = None
        if keepalive:
            self._keepalive = threading.Thread(target=self._beat, name="coldsnap-coordinator-keepalive", daemon=True)
            self._keepalive.start()

    def _beat(self) -> None:
        """While no call runs (a call heartbeats itself), one heartbeat every :data:`_HEARTBEAT_S`."""
        while not self._closed.wait(_HEARTBEAT_S):
            if self._lock.acquire(blocking=False):
                try:
                    if not self._closed.is_set():
                        self.socket.send(encode_frame(Frame(Kind.HEARTBEAT, self.rank, self._send_seq, {}), self.token))
                        self._send_seq += 1
                except zmq.ZMQError:
                    return
                finally:
                    self._lock.release()

    def _watch(self) -> None:
        """Raise once the coordinator's connection dropped after it had been up and nothing it sent
        before going is still unread (a coordinator that answered every rank's BYE closes at once:
        its last reply and the disconnect arrive together)."""
        while self._monitor.poll(0):
            event = zmq.utils.monitor.recv_monitor_message(self._monitor)
            if event["event"] == zmq.EVENT_CONNECTED:
                self._connected_once = True
            elif event["event"] == zmq.EVENT_DISCONNECTED and self._connected_once:
                self._gone = True
        if self._gone and not self.socket.poll(0):
            raise CoordinatorError(f"the coordinator at {self.endpoint} went away")

    def _call(self, kind: Kind, body: dict[str, Any], timeout: float, what: str) -> Frame:
        with self._lock:
            return self._call_locked(kind, body, timeout, what)

    def _call_locked(self, kind: Kind, body: dict[str, Any], timeout: float, what: str) -> Frame:
        frame = Frame(kind, self.rank, self._send_seq, body)
        self._send_seq += 1
        self.socket.send(encode_frame(frame, self.token))
        deadline = time.monotonic() + timeout + _GRACE_S
        next_heartbeat = time.monotonic() + _HEARTBEAT_S
        while True:
            self._watch()
            if time.monotonic() >= next_heartbeat:  # tell the coordinator this rank is alive and waiting
                self.socket.send(encode_frame(Frame(Kind.HEARTBEAT, self.rank, self._send_seq, {}), self.token))
                self._send_seq += 1
                next_heartbeat += _HEARTBEAT_S
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CoordinatorError(f"{what}: no answer from the coordinator at {self.endpoint} "
                                       f"within {timeout + _GRACE_S:.1f} s")
            if not self.socket.poll(min(50, int(remaining * 1000) + 1)):
                continue
            try:
                reply = decode_frame(self.socket.recv(), self.token)
            except FrameError:
                continue  # not from our coordinator: never acted on
            if reply.sequence != self._recv_seq:
                continue  # replayed or reordered
            self._recv_seq += 1
            if reply.kind == Kind.ERROR:
                raise CoordinatorError(f"{what}: {reply.body.get('reason', 'refused')}")
            return reply

    def barrier(self, name: str, timeout: float = 60.0) -> None:
        """Wait until every rank reached ``name``; raises with the missing ranks on timeout or loss."""
        self._call(Kind.BARRIER, {"name": name, "timeout_ms": int(timeout * 1000)}, timeout, what=f"barrier {name!r}")

    def put(self, key: str, value: str) -> None:
        if len(value.encode()) > MAX_VALUE_BYTES:
            raise CoordinatorError(f"put {key!r}: value of {len(value.encode())} bytes exceeds {MAX_VALUE_BYTES}")
        self._call(Kind.PUT, {"key": key, "value": value}, 10.0, what=f"put {key!r}")

    def get(self, key: str, timeout: float = 60.0) -> str:
        reply = self._call(Kind.GET, {"key": key, "timeout_ms": int(timeout * 1000)}, timeout, what=f"get {key!r}")
        return str(reply.body["value"])

    def abort(self, reason: str) -> None:
        """Fail the activation for every participant: their pending and later barriers and gets answer
        ``reason`` (prefixed with who aborted)."""
        self._call(Kind.ABORT, {"reason": reason[:4096]}, 5.0, what="abort")

    def close(self, completed: bool = True) -> None:
        """Say BYE when this participant's part of the activation is done, then disconnect."""
        try:
            if completed:
                self._call(Kind.BYE, {}, 5.0, what="bye")
        finally:
            self._closed.set()
            if self._keepalive is not None:
                self._keepalive.join()
            self._close_sockets()

    def _close_sockets(self) -> None:
        self._closed.set()
        self.socket.disable_monitor()
        self._monitor.close(0)
        self.socket.close(0)

    def __enter__(self) -> "CoordinatorClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(completed=exc[0] is None)

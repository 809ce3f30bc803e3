"""The CSKV coordinator: barriers and small key/value for the ranks of one activation.

A ZeroMQ ROUTER. Each rank connects a DEALER, says HELLO with its rank, and then asks for barriers,
puts and gets. Every frame is authenticated (frames.py); each connection's sequence numbers must run
from 0 without gaps, so replayed or reordered frames are dropped. A rank waiting on the coordinator
sends a heartbeat every 250 ms; one that falls silent for LOST_AFTER_S (killed mid-barrier) fails
that barrier for everyone at once, named; a rank that never arrives fails it at the barrier's
timeout, with the missing ranks named. The coordinator ends when every rank said BYE or its TTL runs out.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

from coldsnap.atomic import write_atomic
from coldsnap.coord.frames import MAX_VALUE_BYTES, Frame, FrameError, Kind, decode_frame, encode_frame

__all__ = ["Coordinator", "LOST_AFTER_S"]

LOST_AFTER_S = 1.5

log = logging.getLogger(__name__)


@dataclass
class _Peer:
    rank: int | None = None
    expect: int = 0  # next sequence number from the peer
    send: int = 0  # next sequence number to the peer


@dataclass
class _Barrier:
    deadline: float
    waiting: dict[int, bytes] = field(default_factory=dict)  # rank -> peer identity
    failed: str | None = None


class Coordinator:
    def __init__(self, listen: str, token: bytes, ranks: int, ttl: float, endpoint_file: Path | None = None,
                 context: zmq.Context | None = None):
        if ranks < 1:
            raise ValueError("ranks must be >= 1")
        if len(token) < 16:
            raise ValueError("the token must be at least 16 bytes")
        self.token = token
        self.ranks = ranks
        self.deadline = time.monotonic() + ttl
        self.context = context or zmq.Context.instance()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.MAXMSGSIZE, 1 << 20)  # libzmq drops the connection past this
        host, _, port = listen.rpartition(":")
        if port == "0":
            chosen = self.socket.bind_to_random_port(f"tcp://{host}")
            self.endpoint = f"tcp://{host}:{chosen}"
        else:
            self.endpoint = f"tcp://{listen}"
            self.socket.bind(self.endpoint)
        if endpoint_file is not None:
            write_atomic(endpoint_file, (json.dumps({"endpoint": self.endpoint, "pid": os.getpid()}) + "\n").encode())
        self.peers: dict[bytes, _Peer] = {}
        self.rank_peer: dict[int, bytes] = {}
        self.barriers: dict[str, _Barrier] = {}
        self.values: dict[str, str] = {}
        self.gets: list[tuple[str, float, bytes]] = []  # key, deadline, peer
        self.done: set[int] = set()
        self.last_seen: dict[int, float] = {}
        self._stop = False
        self._abort_reason: str | None = None
        self.rejected = 0

    # ---- replies ----------------------------------------------------------------------------------
    def _reply(self, identity: bytes, kind: Kind, **body: Any) -> None:
        peer = self.peers.get(identity)
        if peer is None:
            return
        frame = Frame(kind, peer.rank if peer.rank is not None else 0, peer.send, body)
        peer.send += 1
        try:
            self.socket.send_multipart([identity, encode_frame(frame, self.token)], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the peer is gone; its barriers fail through the disconnect notice

    def _fail_barrier(self, name: str, reason: str) -> None:
        barrier = self.barriers[name]
        barrier.failed = reason
        for identity in barrier.waiting.values():
            self._reply(identity, Kind.ERROR, reason=reason)
        barrier.waiting.clear()

    # ---- requests ---------------------------------------------------------------------------------
    def _handle(self, identity: bytes, frame: Frame) -> None:
        peer = self.peers[identity]
        if frame.kind == Kind.HELLO:
            rank = frame.rank
            if peer.rank is not None or not 0 <= rank < self.ranks:
                self._reply(identity, Kind.ERROR, reason=f"rank {rank} is not in 0..{self.ranks - 1} or this connection has one")
                return
            if rank in self.rank_peer:
                self._reply(identity, Kind.ERROR, reason=f"rank {rank} is already connected (duplicate rank id)")
                log.warning("coordinator: rejected a duplicate rank %d", rank)
                return
            peer.rank = rank
            self.rank_peer[rank] = identity
            self._reply(identity, Kind.OK, ranks=self.ranks)
            return
        if peer.rank is None or frame.rank != peer.rank:
            if frame.kind != Kind.HEARTBEAT:
                self._reply(identity, Kind.ERROR, reason="say HELLO with your rank first")
            return
        rank = peer.rank
        self.last_seen[rank] = time.monotonic()
        if frame.kind == Kind.HEARTBEAT:
            return  # liveness only; never answered
        if self._abort_reason is not None and frame.kind in (Kind.BARRIER, Kind.GET):
            self._reply(identity, Kind.ERROR, reason=self._abort_reason)
            return
        if frame.kind == Kind.BARRIER:
            name = str(frame.body.get("name", ""))
            timeout = int(frame.body.get("timeout_ms", 60_000)) / 1000
            barrier = self.barriers.setdefault(name, _Barrier(deadline=time.monotonic() + timeout))
            if barrier.failed:
                self._reply(identity, Kind.ERROR, reason=barrier.failed)
                return
            barrier.waiting[rank] = identity
            barrier.deadline = min(barrier.deadline, time.monotonic() + timeout)
            if len(barrier.waiting) == self.ranks:
                for waiter in barrier.waiting.values():
                    self._reply(waiter, Kind.OK, name=name)
                del self.barriers[name]  # a name can be reused for the next round
        elif frame.kind == Kind.PUT:
            key, value = str(frame.body.get("key", "")), frame.body.get("value")
            if not isinstance(value, str) or len(value.encode()) > MAX_VALUE_BYTES:
                self._reply(identity, Kind.ERROR, reason=f"value must be a string of at most {MAX_VALUE_BYTES} bytes")
                return
            self.values[key] = value
            self._reply(identity, Kind.OK, key=key)
            for pending in [g for g in self.gets if g[0] == key]:
                self.gets.remove(pending)
                self._reply(pending[2], Kind.VALUE, key=key, value=value)
        elif frame.kind == Kind.GET:
            key = str(frame.body.get("key", ""))
            if key in self.values:
                self._reply(identity, Kind.VALUE, key=key, value=self.values[key])
            else:
                self.gets.append((key, time.monotonic() + int(frame.body.get("timeout_ms", 60_000)) / 1000, identity))
        elif frame.kind == Kind.BYE:
            self.done.add(rank)
            self._reply(identity, Kind.OK)
        else:
            self._reply(identity, Kind.ERROR, reason=f"unexpected {frame.kind.name}")

    def _expire(self) -> None:
        now = time.monotonic()
        for name, barrier in list(self.barriers.items()):
            lost = sorted(r for r in barrier.waiting if now - self.last_seen.get(r, now) > LOST_AFTER_S)
            if not barrier.failed and lost:
                self._fail_barrier(name, f"barrier {name!r} failed: rank {lost} stopped responding "
                                         f"(no heartbeat for {LOST_AFTER_S} s)")
            elif not barrier.failed and barrier.waiting and now > barrier.deadline:
                missing = sorted(set(range(self.ranks)) - set(barrier.waiting))
                self._fail_barrier(name, f"barrier {name!r} timed out: missing ranks {missing}")
        for pending in [g for g in self.gets if now > g[1]]:
            self.gets.remove(pending)
            self._reply(pending[2], Kind.ERROR, reason=f"no value for key {pending[0]!r} in time")

    def abort(self, reason: str) -> None:
        """Fail every pending and later barrier and get with ``reason`` (from another thread): the
        launcher saw one rank fail, and the others must not wait for it until their timeouts."""
        self._abort_reason = reason

    def _apply_abort(self) -> None:
        reason = self._abort_reason
        if reason is None:
            return
        for name, barrier in list(self.barriers.items()):
            if not barrier.failed:
                self._fail_barrier(name, reason)
        for pending in list(self.gets):
            self.gets.remove(pending)
            self._reply(pending[2], Kind.ERROR, reason=reason)

    def stop(self) -> None:
        """Make :meth:`serve` return at its next tick (from another thread)."""
        self._stop = True

    def serve(self) -> str:
        """Run until every rank said BYE or the TTL ends; returns why it stopped."""
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        try:
            while True:
                if len(self.done) == self.ranks:
                    return "complete"
                if self._stop:
                    return "stopped"
                if time.monotonic() > self.deadline:
                    for identity in list(self.peers):
                        self._reply(identity, Kind.ERROR, reason="coordinator TTL expired")
                    return "ttl"
                if poller.poll(50):
                    parts = self.socket.recv_multipart(zmq.NOBLOCK)
                    if len(parts) != 2:
                        self.rejected += 1
                        continue
                    identity, data = parts
                    self._receive(identity, data)
                if self._abort_reason is not None:
                    self._apply_abort()
                self._expire()
        finally:
            self.socket.close(0)

    def _receive(self, identity: bytes, data: bytes) -> None:
        try:
            frame = decode_frame(data, self.token)
        except FrameError as exc:
            self.rejected += 1
            log.warning("coordinator: dropped a frame: %s", exc)
            return
        peer = self.peers.setdefault(identity, _Peer())
        if frame.sequence != peer.expect:
            self.rejected += 1
            log.warning("coordinator: dropped a frame with sequence %d (expected %d): replayed or reordered",
                        frame.sequence, peer.expect)
            return
        peer.expect += 1
        self._handle(identity, frame)

"""The CSKV coordinator: barriers and small key/value for the ranks of one activation.

A ZeroMQ ROUTER. Each participant connects a DEALER, says HELLO with its index, and then asks for
barriers, puts and gets. Participants are of two roles, each with barriers of its own: the *ranks*
(every engine process of the activation, ``ranks`` of them) and, for an activation of several launch
units, the *units* (each unit's launcher, ``units`` of them), which meet at the unit-level barriers of
a capture or restore (everything dumped, every tree restored, the canary matched) while their ranks
meet at theirs (NCCL teardown and rebuild). Every frame is authenticated (frames.py); each
connection's sequence numbers must run from 0 without gaps, so replayed or reordered frames are
dropped. A participant waiting on the coordinator sends a heartbeat every 250 ms, and one that said
HELLO with ``keepalive`` (a unit's launcher) sends them all the time: one that falls silent for
LOST_AFTER_S (killed) fails the activation for everyone at once, named; one that never arrives fails
a barrier at its timeout, with the missing ones named; any participant may ABORT the activation with
its reason (a unit whose admission failed), which every pending and later barrier and get then
answers. A rank's BYE frees its index (the same rank of a restored process joins again); the
coordinator ends when every unit said BYE (every rank, without units) or its TTL runs out.
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


ROLES = ("rank", "unit")
"""Who a participant is: an engine rank, or a launch unit's launcher."""

Member = tuple[str, int]
"""A participant: its role and its index in that role."""


@dataclass
class _Peer:
    member: Member | None = None
    expect: int = 0  # next sequence number from the peer
    send: int = 0  # next sequence number to the peer


@dataclass
class _Barrier:
    deadline: float
    waiting: dict[int, bytes] = field(default_factory=dict)  # index -> peer identity
    failed: str | None = None


def _plural(role: str) -> str:
    return f"{role}s"


class Coordinator:
    def __init__(self, listen: str, token: bytes, ranks: int, ttl: float, endpoint_file: Path | None = None,
                 context: zmq.Context | None = None, units: int = 0):
        if ranks < 1:
            raise ValueError("ranks must be >= 1")
        if units < 0:
            raise ValueError("units must be >= 0")
        if len(token) < 16:
            raise ValueError("the token must be at least 16 bytes")
        self.token = token
        self.ranks = ranks
        self.units = units
        self.sizes = {"rank": ranks, "unit": units}
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
        self.members: dict[Member, bytes] = {}  # connected participants -> peer identity
        self.barriers: dict[tuple[str, str], _Barrier] = {}  # (role, name)
        self.values: dict[str, str] = {}
        self.gets: list[tuple[str, float, bytes]] = []  # key, deadline, peer
        self.done: set[Member] = set()
        self.last_seen: dict[Member, float] = {}
        self.watched: set[Member] = set()  # said HELLO with keepalive and no BYE yet
        self._stop = False
        self._abort_reason: str | None = None
        self.rejected = 0

    # ---- replies ----------------------------------------------------------------------------------
    def _reply(self, identity: bytes, kind: Kind, **body: Any) -> None:
        peer = self.peers.get(identity)
        if peer is None:
            return
        frame = Frame(kind, peer.member[1] if peer.member is not None else 0, peer.send, body)
        peer.send += 1
        try:
            self.socket.send_multipart([identity, encode_frame(frame, self.token)], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the peer is gone; its barriers fail through the disconnect notice

    def _fail_barrier(self, key: tuple[str, str], reason: str) -> None:
        barrier = self.barriers[key]
        barrier.failed = reason
        for identity in barrier.waiting.values():
            self._reply(identity, Kind.ERROR, reason=reason)
        barrier.waiting.clear()

    # ---- requests ---------------------------------------------------------------------------------
    def _hello(self, identity: bytes, peer: _Peer, frame: Frame) -> None:
        role, index = str(frame.body.get("role", "rank")), frame.rank
        size = self.sizes.get(role, 0)
        if peer.member is not None or not 0 <= index < size:
            self._reply(identity, Kind.ERROR, reason=f"{role} {index} is not in 0..{size - 1} or this connection has one"
                        if size else f"this coordinator has no {_plural(role)} (started with --{_plural(role)} 0?)")
            return
        member = (role, index)
        if member in self.members:
            self._reply(identity, Kind.ERROR, reason=f"{role} {index} is already connected (duplicate {role} id)")
            log.warning("coordinator: rejected a duplicate %s %d", role, index)
            return
        peer.member = member
        self.members[member] = identity
        self.done.discard(member)  # a rank of a restored process joins again
        self.last_seen[member] = time.monotonic()
        if frame.body.get("keepalive"):
            self.watched.add(member)
        self._reply(identity, Kind.OK, ranks=self.ranks, units=self.units)

    def _handle(self, identity: bytes, frame: Frame) -> None:
        peer = self.peers[identity]
        if frame.kind == Kind.HELLO:
            self._hello(identity, peer, frame)
            return
        if peer.member is None or frame.rank != peer.member[1]:
            if frame.kind != Kind.HEARTBEAT:
                self._reply(identity, Kind.ERROR, reason="say HELLO with your rank first")
            return
        member = peer.member
        role, index = member
        self.last_seen[member] = time.monotonic()
        if frame.kind == Kind.HEARTBEAT:
            return  # liveness only; never answered
        if frame.kind == Kind.ABORT:
            if self._abort_reason is None:
                self._abort_reason = f"{role} {index} aborted the activation: {frame.body.get('reason', 'no reason given')}"
                log.warning("coordinator: %s", self._abort_reason)
            self._reply(identity, Kind.OK)
            return
        if self._abort_reason is not None and frame.kind in (Kind.BARRIER, Kind.GET):
            self._reply(identity, Kind.ERROR, reason=self._abort_reason)
            return
        if frame.kind == Kind.BARRIER:
            name = str(frame.body.get("name", ""))
            timeout = int(frame.body.get("timeout_ms", 60_000)) / 1000
            scope = (role, name)
            barrier = self.barriers.setdefault(scope, _Barrier(deadline=time.monotonic() + timeout))
            if barrier.failed:
                self._reply(identity, Kind.ERROR, reason=barrier.failed)
                return
            barrier.waiting[index] = identity
            barrier.deadline = min(barrier.deadline, time.monotonic() + timeout)
            if len(barrier.waiting) == self.sizes[role]:
                for waiter in barrier.waiting.values():
                    self._reply(waiter, Kind.OK, name=name)
                del self.barriers[scope]  # a name can be reused for the next round
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
            self.done.add(member)
            self.watched.discard(member)
            if role == "rank":  # its index is free for the same rank of a later (restored) process
                self.members.pop(member, None)
            self._reply(identity, Kind.OK)
        else:
            self._reply(identity, Kind.ERROR, reason=f"unexpected {frame.kind.name}")

    def _expire(self) -> None:
        now = time.monotonic()
        for scope, barrier in list(self.barriers.items()):
            role, name = scope
            lost = sorted(i for i in barrier.waiting if now - self.last_seen.get((role, i), now) > LOST_AFTER_S)
            if not barrier.failed and lost:
                self._fail_barrier(scope, f"barrier {name!r} failed: {role} {lost} stopped responding "
                                        f"(no heartbeat for {LOST_AFTER_S} s)")
            elif not barrier.failed and barrier.waiting and now > barrier.deadline:
                missing = sorted(set(range(self.sizes[role])) - set(barrier.waiting))
                self._fail_barrier(scope, f"barrier {name!r} timed out: missing {_plural(role)} {missing}")
        if self._abort_reason is None:
            silent = sorted(m for m in self.watched if now - self.last_seen.get(m, now) > LOST_AFTER_S)
            if silent:
                role, index = silent[0]
                self.abort(f"{role} {index} stopped responding (no heartbeat for {LOST_AFTER_S} s): its launcher "
                           "is gone or its host unreachable")
                log.warning("coordinator: %s", self._abort_reason)
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
        for scope, barrier in list(self.barriers.items()):
            if not barrier.failed:
                self._fail_barrier(scope, reason)
        for pending in list(self.gets):
            self.gets.remove(pending)
            self._reply(pending[2], Kind.ERROR, reason=reason)

    def complete(self) -> bool:
        """Every unit said BYE (every rank, in an activation without units)."""
        role = "unit" if self.units else "rank"
        return sum(1 for member in self.done if member[0] == role) == self.sizes[role]

    def stop(self) -> None:
        """Make :meth:`serve` return at its next tick (from another thread)."""
        self._stop = True

    def serve(self) -> str:
        """Run until every unit (rank) said BYE or the TTL ends; returns why it stopped."""
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        try:
            while True:
                if self.complete():
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

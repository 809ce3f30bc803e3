"""Every communicator of one rank, and the teardown/rebuild sequence around a process snapshot."""

from __future__ import annotations

from typing import Any, Callable, Protocol

from coldsnap.collective.base import Backend, CollectiveError, Communicator
from coldsnap.timing import timed

__all__ = ["DistributedState", "ManagedCommunicator", "RankCollectives", "Rendezvous", "between_barriers",
           "share_unique_id"]


class Rendezvous(Protocol):
    """What the sequence needs from the activation's coordinator (``CoordinatorClient``)."""

    def barrier(self, name: str, timeout: float = 60.0) -> None: ...

    def put(self, key: str, value: str) -> None: ...

    def get(self, key: str, timeout: float = 60.0) -> str: ...

    address: str | None
    """This rank's host's address on the activation's network now (``None``: as it was)."""


class DistributedState(Protocol):
    """What the agent tears down before a snapshot and rebuilds after it: :class:`RankCollectives`, or
    an engine's own (``coldsnap_vllm.distributed.VllmCollectives``)."""

    rank: int
    world: int

    def teardown(self, rendezvous: Rendezvous, seconds: dict[str, float]) -> None: ...

    def rebuild(self, rendezvous: Rendezvous, seconds: dict[str, float]) -> None: ...


class ManagedCommunicator:
    """The handle an engine keeps: its connection is replaced by a rebuild, the handle stays."""

    def __init__(self, name: str, backend: Backend, communicator: Communicator):
        self.name = name
        self.backend = backend
        self.current: Communicator | None = communicator
        self.generation = 0  # how many times it was rebuilt

    @property
    def rank(self) -> int:
        return self._live().rank

    @property
    def world(self) -> int:
        return self._live().world

    def _live(self) -> Communicator:
        if self.current is None:
            raise CollectiveError(f"communicator {self.name!r} is torn down (the process is being snapshotted)")
        return self.current

    def all_reduce(self, tensor: Any) -> None:
        self._live().all_reduce(tensor)


def between_barriers(rendezvous: Rendezvous, seconds: dict[str, float], step: str, barriers: tuple[str, str],
                     timeout: float, work: Callable[[], None]) -> None:
    """Barrier, ``work`` (its time as ``step``), barrier (both as ``step_barrier``)."""
    timed(seconds, f"{step}_barrier", lambda: rendezvous.barrier(barriers[0], timeout))
    timed(seconds, step, work)
    timed(seconds, f"{step}_barrier", lambda: rendezvous.barrier(barriers[1], timeout))


def share_unique_id(rendezvous: Rendezvous, key: str, leader: bool, create: Callable[[], bytes],
                    timeout: float) -> bytes:
    """The leader makes a communicator's unique id and publishes it under ``key``; the others get it."""
    if leader:
        unique_id = create()
        rendezvous.put(key, unique_id.hex())
        return unique_id
    return bytes.fromhex(rendezvous.get(key, timeout))


class RankCollectives:
    """The communicators of rank ``rank`` of ``world``, by name (torn down and rebuilt in name order,
    which is the same on every rank)."""

    def __init__(self, rank: int, world: int):
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in a world of {world}")
        self.rank = rank
        self.world = world
        self.communicators: dict[str, ManagedCommunicator] = {}

    def connect(self, name: str, backend: Backend, unique_id: bytes) -> ManagedCommunicator:
        """Join communicator ``name`` at first start (the engine exchanged ``unique_id`` its own way)."""
        if name in self.communicators:
            raise CollectiveError(f"communicator {name!r} exists already")
        managed = ManagedCommunicator(name, backend, backend.connect(unique_id, self.world, self.rank))
        self.communicators[name] = managed
        return managed

    @property
    def live(self) -> bool:
        return all(c.current is not None for c in self.communicators.values())

    def teardown(self, rendezvous: Rendezvous, seconds: dict[str, float], timeout: float = 120.0) -> None:
        """Close every communicator: a barrier first (no rank is still inside a collective), then the
        orderly close on every rank, then a barrier (none is half closed when the snapshot starts)."""
        def close_all() -> None:
            try:
                for name in sorted(self.communicators):
                    managed = self.communicators[name]
                    if managed.current is not None:
                        communicator, managed.current = managed.current, None
                        communicator.close()
            except BaseException:
                self.abort()
                raise

        between_barriers(rendezvous, seconds, "teardown", ("collectives.teardown", "collectives.torn_down"), timeout,
                          close_all)

    def rebuild(self, rendezvous: Rendezvous, seconds: dict[str, float], timeout: float = 300.0) -> None:
        """Create every communicator again: rank 0 makes each unique id and publishes it through the
        coordinator, every rank joins, and a last barrier acknowledges the whole group at once."""
        address = getattr(rendezvous, "address", None)

        def connect_all() -> None:
            try:
                for name in sorted(self.communicators):
                    managed = self.communicators[name]
                    if managed.current is not None:
                        raise CollectiveError(f"communicator {name!r} was not torn down")
                    if address is not None and self.rank == 0:  # restored on another host: listen at its address
                        managed.backend.relocate(address)
                    unique_id = share_unique_id(rendezvous, f"collective/{name}/{managed.generation + 1}/unique_id",
                                                self.rank == 0, managed.backend.create_unique_id, timeout)
                    managed.current = managed.backend.connect(unique_id, self.world, self.rank)
                    managed.generation += 1
            except BaseException:
                self.abort()
                raise

        between_barriers(rendezvous, seconds, "rebuild", ("collectives.rebuild", "collectives.rebuilt"), timeout,
                          connect_all)

    def abort(self) -> None:
        """Abort whatever is still connected (a failed step: the launcher discards this process)."""
        for managed in self.communicators.values():
            if managed.current is not None:
                communicator, managed.current = managed.current, None
                communicator.abort()

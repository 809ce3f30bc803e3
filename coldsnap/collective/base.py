"""What a communicator backend provides: unique ids, connect, all-reduce, orderly close and abort."""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["Backend", "CollectiveError", "Communicator"]


class CollectiveError(RuntimeError):
    """A communicator could not be created, used or closed; the message says which rank and why."""

    failure_code = "agent.collectives"  # how the agent reports it to the launcher (coldsnap.agent.protocol)


class Communicator(Protocol):
    rank: int
    world: int

    def all_reduce(self, tensor: Any) -> None:
        """Sum ``tensor`` over every rank, in place (asynchronously on the current stream for GPUs)."""

    def close(self) -> None:
        """Orderly teardown; every rank calls it after the last collective."""

    def abort(self) -> None:
        """Free local resources without waiting for peers (after a failure)."""


class Backend(Protocol):
    name: str

    def create_unique_id(self) -> bytes:
        """The rendezvous identity of a new communicator; made by rank 0, given to every rank."""

    def connect(self, unique_id: bytes, world: int, rank: int) -> Communicator:
        """Join the communicator ``unique_id`` as ``rank`` of ``world`` (blocks until all joined)."""

    def relocate(self, address: str) -> None:
        """Rank 0's process now runs on a host with ``address`` (restored elsewhere): the unique ids it
        makes from now on name that address (NCCL finds its own interfaces: nothing to do)."""

"""The activation's coordinator, for the length of one agent command (:func:`command_rendezvous`)."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterator

from coldsnap.agent.failures import CommandFailed
from coldsnap.agent.protocol import CoordinatorRef

if TYPE_CHECKING:
    from coldsnap.collective.group import Rendezvous

__all__ = ["command_rendezvous"]


@contextlib.contextmanager
def command_rendezvous(coordinator: CoordinatorRef | None, rank: int, world: int) -> Iterator["Rendezvous | None"]:
    """The activation's coordinator for one command (none for a single rank). Its own ZeroMQ context
    is terminated before the command returns: no connection to the launcher outlives it, so none is in
    the process when CRIU dumps it."""
    if world == 1:
        yield None
        return
    if not coordinator:
        raise CommandFailed("agent.command", f"rank {rank} of {world} needs the activation's coordinator in the command")
    import zmq

    from coldsnap.coord import CoordinatorClient

    context = zmq.Context()
    try:
        client = CoordinatorClient(coordinator.endpoint, bytes.fromhex(coordinator.token), rank, context=context)
        client.address = coordinator.address
        completed = False
        try:
            yield client
            completed = True
        finally:
            client.close(completed=completed)
    finally:
        context.term()

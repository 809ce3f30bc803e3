"""The launcher's side of a multi-rank unit: the activation's coordinator and one agent call per rank.

A tensor-parallel engine has one agent per rank (:func:`~coldsnap.agent.protocol.rank_control`). The
launcher sends every rank its command at once, since the ranks meet at coordinator barriers inside
it (drain, NCCL teardown and rebuild). When one rank fails, the coordinator is aborted with that
rank's reason, so the others fail within a tick instead of waiting for their barrier timeouts, and
the failure reported is the first one: the cause, not its echoes.
"""

from __future__ import annotations

import secrets
import threading
import time
from typing import Any, Callable, TypeVar

from coldsnap.agent.client import AgentError
from coldsnap.agent.protocol import CoordinatorRef

__all__ = ["ActivationCoordinator", "call_every_rank", "rank_prefix"]

T = TypeVar("T")

# A coordinator outlives no activation: long enough for a cold 16 GB hydration per rank, then gone.
COORDINATOR_TTL_S = 3600.0


def rank_prefix(rank: int) -> str:
    """How receipt attributes name a rank's own figures: bare for rank 0, ``rank<R>.`` for the others."""
    return "" if rank == 0 else f"rank{rank}."


class ActivationCoordinator:
    """A CSKV coordinator on loopback for the ranks of one unit, served from a thread of the launcher
    while one command runs on every rank (nothing for a single rank)."""

    def __init__(self, world: int, shared: Any = None):
        """``shared``: this unit's seat at the coordinator of an activation of several units
        (:class:`coldsnap.activation.units.UnitRendezvous`): the ranks join that one instead."""
        self.world = world
        self.shared = shared
        self.token = secrets.token_bytes(32)
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._context: Any = None

    def __enter__(self) -> "ActivationCoordinator":
        if self.world > 1 and self.shared is None:
            import zmq

            from coldsnap.coord import Coordinator

            self._context = zmq.Context()
            self._server = Coordinator("127.0.0.1:0", self.token, self.world, COORDINATOR_TTL_S, context=self._context)
            self._thread = threading.Thread(target=self._server.serve, name="coldsnap-coordinator", daemon=True)
            self._thread.start()
        return self

    def command_field(self) -> CoordinatorRef | None:
        """What an agent command carries so the rank can join (``None`` for one rank)."""
        if self.shared is not None:
            return self.shared.ref()
        if self._server is None:
            return None
        return CoordinatorRef(endpoint=self._server.endpoint, token=self.token.hex(), world=self.world)

    def abort(self, reason: str) -> None:
        if self.shared is not None:
            self.shared.abort(reason)
        if self._server is not None:
            self._server.abort(reason)

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.stop()
            if self._thread is not None:
                self._thread.join(timeout=10)
            self._context.term()
            self._server = None


def call_every_rank(calls: list[tuple[int, Callable[[], T]]], coordinator: ActivationCoordinator) -> list[T]:
    """Run each rank's call at once and return the results in the order given. The first failure
    aborts the coordinator and is raised once every call has ended, as ``AgentError("rank R: ...")``
    for an agent's refusal or an unreachable agent; anything else is raised as it is."""
    if len(calls) == 1:
        return [calls[0][1]()]
    results: dict[int, T] = {}
    failures: list[tuple[float, int, BaseException]] = []
    lock = threading.Lock()

    def run(rank: int, call: Callable[[], T]) -> None:
        try:
            results[rank] = call()
        except BaseException as exc:
            with lock:
                failures.append((time.monotonic(), rank, exc))
                if len(failures) == 1:
                    coordinator.abort(f"the activation was aborted: rank {rank} failed: {exc}")

    threads = [threading.Thread(target=run, args=(rank, call), name=f"coldsnap-rank-{rank}", daemon=True)
               for rank, call in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        _, rank, exc = min(failures, key=lambda f: f[0])
        if isinstance(exc, AgentError):
            raise AgentError(f"rank {rank}: {exc}", exc.failure) from exc
        if isinstance(exc, OSError):
            raise AgentError(f"rank {rank}: {exc}") from exc
        raise exc
    return [results[rank] for rank, _ in calls]

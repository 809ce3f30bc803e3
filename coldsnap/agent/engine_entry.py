"""The engine-facing entry point: :func:`attach` starts this process's agent under ``coldsnap capture``."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from coldsnap.agent.hooks import AgentHooks
from coldsnap.agent.memory import ModelMemory
from coldsnap.agent.protocol import CONTROL_ENV
from coldsnap.agent.server import AgentServer
from coldsnap.settings import SETTINGS

if TYPE_CHECKING:
    from coldsnap.collective.group import DistributedState

__all__ = ["attach", "start_agent"]


_agent: AgentServer | None = None


def attach(memory: ModelMemory, *, serving_lock: threading.Lock, port: int | None = None,
           hooks: AgentHooks | None = None, rank: int = 0, world: int = 1,
           collectives: "DistributedState | None" = None) -> AgentServer | None:
    """The engine-facing entry point, called once per process when its model memory (weights, KV cache,
    any graph region) is in place. Under ``coldsnap capture`` (:data:`CONTROL_ENV` in the environment) it
    starts this process's agent at its rank's control socket and returns it; otherwise it starts nothing
    and returns None, so an engine calls it unconditionally.

    ``serving_lock`` is held by the engine while it serves a request (``prepare`` drains by taking it);
    ``hooks`` add what only the engine knows (graphs, work before the regions are released);
    ``collectives`` are torn down at ``prepare`` and rebuilt at ``resume`` when ``world`` > 1."""
    control = SETTINGS.text(CONTROL_ENV)
    if not control:
        return None
    return start_agent(control, memory, serving_lock=serving_lock, port=port, hooks=hooks, rank=rank, world=world,
                       collectives=collectives)


def start_agent(control: str, memory: ModelMemory, *, serving_lock: threading.Lock, port: int | None = None,
                hooks: AgentHooks | None = None, rank: int = 0, world: int = 1,
                collectives: "DistributedState | None" = None) -> AgentServer:
    """Start this process's agent (once) over its model memory; rank ``rank`` of a tensor-parallel
    ``world`` listens at :func:`rank_control` of ``control``."""
    global _agent
    if _agent is None:
        _agent = AgentServer(control, memory, serving_lock, port, hooks, rank, world, collectives).start()
    return _agent

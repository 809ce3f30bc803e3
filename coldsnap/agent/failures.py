"""How the agent's failures cross the socket: :class:`CommandFailed` carries its code, :func:`failure_of` gives
any exception one."""

from __future__ import annotations

from coldsnap.agent.memory import ModelMemoryError
from coldsnap.agent.protocol import AgentFailure, FailureCode, ProtocolError

__all__ = ["CommandFailed", "failure_of"]


class CommandFailed(RuntimeError):
    """A command the agent refuses or cannot complete, with the code the launcher gets."""

    def __init__(self, code: FailureCode, message: str):
        super().__init__(message)
        self.code: FailureCode = code


def failure_of(exc: BaseException) -> AgentFailure:
    """How an exception crosses the socket: :class:`CommandFailed` with its code; model memory errors as
    ``agent.memory``; an exception whose class names a ``failure_code`` (an engine plugin's teardown
    error, the collectives' errors) with it; anything else as ``agent.internal``."""
    if isinstance(exc, CommandFailed):
        code: FailureCode = exc.code
    elif isinstance(exc, ModelMemoryError):
        code = "agent.memory"
    elif isinstance(exc, ProtocolError):
        code = "agent.command"
    else:
        code = getattr(type(exc), "failure_code", "agent.internal")
    return AgentFailure(code=code, type=type(exc).__name__, message=str(exc))

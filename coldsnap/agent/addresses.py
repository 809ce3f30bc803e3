"""Control socket names as addresses (standard library only: a restore's first step renames the captured
agents' sockets before pydantic, which :mod:`coldsnap.agent.protocol` builds its messages with, is imported)."""

from __future__ import annotations

__all__ = ["KEY_GATE_SUFFIX", "address", "key_gate_control"]


def address(control: str) -> str | bytes:
    """The socket address of a control name (``@name`` is Linux's abstract namespace: no file)."""
    return b"\0" + control[1:].encode() if control.startswith("@") else control


KEY_GATE_SUFFIX = ".http"


def key_gate_control(control: str) -> str:
    """The name the served HTTP process's key gate listens at (:mod:`coldsnap.agent.api_key`): rank 0's control
    name and a suffix, so a replica's restore renames it with the agents' (same id)."""
    return control + KEY_GATE_SUFFIX

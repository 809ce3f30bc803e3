"""Control socket names as addresses (standard library only: a restore's first step renames the captured
agents' sockets before pydantic, which :mod:`coldsnap.agent.protocol` builds its messages with, is imported)."""

from __future__ import annotations

__all__ = ["KEY_GATE_SUFFIX", "MOST_GATES", "address", "key_gate_control"]


def address(control: str) -> str | bytes:
    """The socket address of a control name (``@name`` is Linux's abstract namespace: no file)."""
    return b"\0" + control[1:].encode() if control.startswith("@") else control


KEY_GATE_SUFFIX = ".http"
MOST_GATES = 64
"""HTTP processes of one engine with a key gate each (vLLM's ``--api-server-count``)."""


def key_gate_control(control: str, index: int = 0) -> str:
    """The name the served HTTP process's key gate listens at (:mod:`coldsnap.agent.api_key`): rank 0's control
    name and a suffix (``.http``, then ``.http.1``, ``.http.2`` for further HTTP processes), so a replica's
    restore renames it with the agents' (same id)."""
    return control + KEY_GATE_SUFFIX + (f".{index}" if index else "")

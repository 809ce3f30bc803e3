"""Control socket names as addresses (standard library only: a restore's first step renames the captured
agents' sockets before pydantic, which :mod:`coldsnap.agent.protocol` builds its messages with, is imported)."""

from __future__ import annotations

__all__ = ["address"]


def address(control: str) -> str | bytes:
    """The socket address of a control name (``@name`` is Linux's abstract namespace: no file)."""
    return b"\0" + control[1:].encode() if control.startswith("@") else control

"""CSKV coordinator: authenticated barriers and small key/value for the ranks of one activation.

Short-lived and activation-scoped; it never carries bulk data (values are at most 64 KiB).
Requires pyzmq (the `coord` dependency of the engine extras).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from coldsnap.coord.client import CoordinatorClient, CoordinatorError
    from coldsnap.coord.frames import CSKV_VERSION, Frame, FrameError, Kind, decode_frame, encode_frame
    from coldsnap.coord.server import Coordinator

# Each name from its module on first use: a restore of one unit reads only frames' limits, and importing
# the client and server brings pyzmq and asyncio (~25 ms) onto its way to CRIU.
_HOME = {"CoordinatorClient": "client", "CoordinatorError": "client", "Coordinator": "server",
         **{name: "frames" for name in ("CSKV_VERSION", "Frame", "FrameError", "Kind", "decode_frame", "encode_frame")}}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"coldsnap.coord.{_HOME[name]}"), name)

__all__ = ["CSKV_VERSION", "Coordinator", "CoordinatorClient", "CoordinatorError", "Frame", "FrameError", "Kind",
           "decode_frame", "encode_frame"]

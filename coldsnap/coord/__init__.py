"""CSKV coordinator: authenticated barriers and small key/value for the ranks of one activation.

Short-lived and activation-scoped; it never carries bulk data (values are at most 64 KiB).
Requires pyzmq (the `coord` dependency of the engine extras).
"""

from coldsnap.coord.client import CoordinatorClient, CoordinatorError
from coldsnap.coord.frames import CSKV_VERSION, Frame, FrameError, Kind, decode_frame, encode_frame
from coldsnap.coord.server import Coordinator

__all__ = ["CSKV_VERSION", "Coordinator", "CoordinatorClient", "CoordinatorError", "Frame", "FrameError", "Kind",
           "decode_frame", "encode_frame"]

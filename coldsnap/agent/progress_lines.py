"""Progress of a long agent command, streamed to the launcher before its reply (:class:`ProgressLines`)."""

from __future__ import annotations

import socket
import time
from typing import Callable

from coldsnap.agent.protocol import ProgressLine, ProgressUpdate, encode

__all__ = ["ProgressLines"]


class ProgressLines:
    """Streams ``{"progress": ...}`` lines to the launcher before the reply (at most ~5 a second)."""

    def __init__(self, connection: socket.socket | None):
        self.connection = connection

    def phase(self, name: str) -> Callable[[int, int], None]:
        last = [0.0]

        def report(done: int, total: int) -> None:
            now = time.monotonic()
            if self.connection is None or (now - last[0] < 0.2 and done < total):
                return
            last[0] = now
            try:
                self.connection.sendall(encode(ProgressLine(progress=ProgressUpdate(phase=name, done=done, total=total))))
            except OSError:
                self.connection = None  # the launcher stopped listening; the work goes on

        return report

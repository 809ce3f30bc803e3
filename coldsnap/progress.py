"""Progress of long phases on stderr: a bar that redraws in place on a terminal, a few plain lines
(every quarter) when stderr is a file or a pipe, so logs stay readable."""

from __future__ import annotations

import sys
import time
from typing import IO

__all__ = ["ProgressBar", "PhaseProgress"]


class ProgressBar:
    def __init__(self, label: str, stream: IO[str] | None = None, width: int = 30):
        self.label = label
        self.stream = stream or sys.stderr
        self.width = width
        self.started = time.monotonic()
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._quarter = -1
        self._drawn = False

    def update(self, done: int, total: int) -> None:
        fraction = done / total if total else 1.0
        seconds = max(time.monotonic() - self.started, 1e-9)
        scale, unit = (1e9, "GB") if total >= 1e9 else (1e6, "MB")
        text = (f"{self.label} {fraction:6.1%} {done / scale:.2f}/{total / scale:.2f} {unit} "
                f"{done / seconds / 1e9:.2f} GB/s")
        if self.tty:
            filled = int(fraction * self.width)
            self.stream.write(f"\r{self.label} [{'#' * filled}{'.' * (self.width - filled)}] {text[len(self.label) + 1:]}")
            self._drawn = True
        elif int(fraction * 4) > self._quarter:
            self._quarter = int(fraction * 4)
            self.stream.write(text + "\n")
        self.stream.flush()

    def finish(self) -> None:
        if self.tty and self._drawn:
            self.stream.write("\n")
            self.stream.flush()


class PhaseProgress:
    """``on_progress(phase, done, total)`` for a sequence of phases: one bar each."""

    def __init__(self, prefix: str = "", stream: IO[str] | None = None):
        self.prefix = prefix
        self.stream = stream
        self.bar: ProgressBar | None = None

    def __call__(self, phase: str, done: int, total: int) -> None:
        if self.bar is None or self.bar.label != self.prefix + phase:
            self.finish()
            self.bar = ProgressBar(self.prefix + phase, self.stream)
        self.bar.update(done, total)

    def finish(self) -> None:
        if self.bar is not None:
            self.bar.finish()
            self.bar = None

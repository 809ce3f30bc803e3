"""A pack that is still arriving: which of its chunks are on disk and verified, for readers that start
before the last one lands.

``coldsnap restore oci://REF`` on a host with no copy starts CRIU as soon as the capsule is in and
hydrates the weights while the pack's chunks are still being pulled (:mod:`coldsnap.registry.pull`).
The pull marks each chunk the moment its own SHA-256 (which the published index binds) matched; a
reader waits for the chunks that hold the bytes it wants, and never reads one before that. A pull
that fails wakes every waiter with the failure.

Arrivals are registered per process by the pack's absolute path (:func:`arriving`): admission, the
launcher's weight staging and the prefetch ask :func:`arrival_for` whether a pack they are about to read
is complete or still coming. Engine-neutral, standard library only.
"""

from __future__ import annotations

import bisect
import threading
from pathlib import Path
from typing import Callable, Iterator

__all__ = ["ArrivalFailed", "PackArrival", "arrival_for", "arriving", "forget_arrival"]


class ArrivalFailed(RuntimeError):
    """The pull that was bringing the pack failed or was cancelled; the message says why."""


class PackArrival:
    """The chunks of one file, each ``False`` until it is written and verified."""

    def __init__(self, path: Path, offsets: list[int], size: int):
        self.path = path
        self.size = size
        self.offsets = offsets
        """Each chunk's first byte, ascending from 0; a chunk ends where the next one starts (the last at ``size``)."""
        self.through_cache = True
        """Whether chunks still to come should be written through the page cache (a reader hydrates each one right
        after it arrives) or may go straight to the disk (O_DIRECT: it is read only once it is whole). A streaming
        restore that hydrates a pack only once it is whole says so (:meth:`read_when_whole`)."""
        self._arrived = [False] * len(offsets)
        self._count = 0
        self._failure: str | None = None
        self._changed = threading.Condition()

    def chunk_range(self, index: int) -> tuple[int, int]:
        end = self.offsets[index + 1] if index + 1 < len(self.offsets) else self.size
        return self.offsets[index], end

    def chunks_of(self, offset: int, length: int) -> range:
        """The indexes of the chunks that hold bytes [offset, offset + length)."""
        if length <= 0:
            return range(0)
        first = bisect.bisect_right(self.offsets, offset) - 1
        last = bisect.bisect_right(self.offsets, offset + length - 1) - 1
        return range(max(first, 0), last + 1)

    # --- the pull's side -----------------------------------------------------------------------------

    def arrived(self, index: int) -> None:
        with self._changed:
            if not self._arrived[index]:
                self._arrived[index] = True
                self._count += 1
            self._changed.notify_all()

    def fail(self, why: str) -> None:
        with self._changed:
            if self._failure is None and self._count < len(self._arrived):
                self._failure = why
            self._changed.notify_all()

    # --- the readers' side ---------------------------------------------------------------------------

    def read_when_whole(self) -> None:
        """This pack's reader waits for the last chunk: the rest may bypass the page cache."""
        self.through_cache = False

    @property
    def complete(self) -> bool:
        with self._changed:
            return self._count == len(self._arrived)

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise ArrivalFailed(f"{self.path.name} did not arrive: {self._failure}")

    def wait(self, offset: int = 0, length: int | None = None, keep_going: Callable[[], bool] = lambda: True) -> None:
        """Block until bytes [offset, offset + length) (default: all) are on disk and verified. Raises
        :class:`ArrivalFailed` when the pull failed first, or when ``keep_going`` (asked every 50 ms) says stop."""
        wanted = self.chunks_of(offset, self.size - offset if length is None else length)
        with self._changed:
            while not all(self._arrived[i] for i in wanted):
                self._raise_failure()
                if not keep_going():
                    raise ArrivalFailed(f"{self.path.name}: stopped waiting for it")
                self._changed.wait(0.05)

    def as_they_arrive(self, keep_going: Callable[[], bool] = lambda: True) -> Iterator[list[int]]:
        """Every chunk once, in batches: each batch is the chunks that arrived since the last one (the first
        waits for at least one). Raises :class:`ArrivalFailed` as :meth:`wait` does."""
        handed = [False] * len(self._arrived)
        left = len(handed)
        while left:
            with self._changed:
                while True:
                    batch = [i for i, ok in enumerate(self._arrived) if ok and not handed[i]]
                    if batch:
                        break
                    self._raise_failure()
                    if not keep_going():
                        raise ArrivalFailed(f"{self.path.name}: stopped waiting for it")
                    self._changed.wait(0.05)
            for i in batch:
                handed[i] = True
            left -= len(batch)
            yield batch


_arriving: dict[Path, PackArrival] = {}
_lock = threading.Lock()


def arriving(arrival: PackArrival) -> None:
    """Register a pack being pulled in this process."""
    with _lock:
        _arriving[arrival.path.absolute()] = arrival


def forget_arrival(path: Path) -> None:
    with _lock:
        _arriving.pop(Path(path).absolute(), None)


def arrival_for(path: str | Path) -> PackArrival | None:
    """The arrival of the pack at ``path`` while this process pulls it, until the pull has recorded the whole
    file as verified (None: a file that is whole on disk, or one this process does not pull)."""
    with _lock:
        return _arriving.get(Path(path).absolute())

"""How a pull's chunks reach the disk: with O_DIRECT where nobody reads them at once (:func:`direct_writes`),
else through the page cache with each chunk's writeback started as soon as it is in (:class:`ChunkWriteback`)."""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

from coldsnap.registry.layout import Blob
from coldsnap.settings import SETTINGS

__all__ = ["DIRECT_ENV", "ChunkWriteback", "direct_writes"]

_SYNC_FILE_RANGE_WRITE = 2
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


DIRECT_ENV = "COLDSNAP_PULL_DIRECT"
"""``0``: never write the packs' chunks with O_DIRECT (:func:`direct_writes`)."""


def direct_writes(stream: bool, pack: Blob) -> bool | None:
    """Whether a pack's chunks may go to the disk with O_DIRECT (True) or only through the page cache (None).

    O_DIRECT wherever nobody reads a chunk right after it arrived (``coldsnap pull``, a warm's pull, a restore
    whose agents hydrate a pack only once it is whole): measured on the 2-core CI machine, buffered writes of
    fresh pages cost 1–2 s of kernel time per GB there (0.56–0.68 GB/s with the fsync), O_DIRECT 0.25 s
    (1.22 GB/s, at the disk's rate, durable when it returns), and a fleet host that pulls all day keeps its
    page cache for what it serves. A streamed pull writes through the page cache while its
    :class:`~coldsnap.payload.arrival.PackArrival` says a reader wants the chunks from there (the launcher's
    GPU staging hydrates each right after it arrived). ``COLDSNAP_PULL_DIRECT=0``: never O_DIRECT."""
    if not SETTINGS.flag(DIRECT_ENV) or any(c.offset % 4096 for c in pack.chunks):
        return None
    return True


class ChunkWriteback:
    """Starts the writeback of each chunk to disk as soon as it is in (``sync_file_range``), on a thread of its
    own: the call blocks while the disk's queue is full, and the receiving threads must not wait for the disk
    (a restore hydrates the chunks from the page cache at once). The last ``fsync`` then finds little left to
    write, and the pulled pack leaves no long tail of dirty pages behind."""

    def __init__(self) -> None:
        self._queue: list[tuple[int, int, int] | None] = []
        self._ready = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="coldsnap-pull-writeback", daemon=True)
        self._thread.start()

    def start(self, fd: int, offset: int, length: int) -> None:
        with self._ready:
            self._queue.append((fd, offset, length))
            self._ready.notify()

    def close(self) -> None:
        """After every range asked for was handed to the kernel (the descriptors may then be closed)."""
        with self._ready:
            self._queue.append(None)
            self._ready.notify()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._queue:
                    self._ready.wait()
                item = self._queue.pop(0)
            if item is None:
                return
            fd, offset, length = item
            try:
                _libc.sync_file_range(fd, ctypes.c_int64(offset), ctypes.c_int64(length), _SYNC_FILE_RANGE_WRITE)
            except (AttributeError, OSError):  # best effort: fsync writes what this did not
                pass

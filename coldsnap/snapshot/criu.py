"""CRIU, behind one class: :class:`CriuSnapshotter` dumps a process tree and restores it, as many times as
needed, with the same :class:`~coldsnap.snapshot.criu_options.SnapshotOptions` for both.

Its parts: the executable, its checks and typed error (:mod:`~coldsnap.snapshot.criu_binary`), the flags
(:mod:`~coldsnap.snapshot.criu_options`), the dump (:mod:`~coldsnap.snapshot.criu_dump`), the restore
(:mod:`~coldsnap.snapshot.criu_restore`) and a replica's CRIU in namespaces of its own
(:mod:`~coldsnap.snapshot.replica_launcher`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from coldsnap.snapshot.criu_binary import Criu
from coldsnap.snapshot.criu_dump import DumpResult, dump_tree
from coldsnap.snapshot.criu_options import SnapshotOptions
from coldsnap.snapshot.criu_restore import PendingRestore, RestoreResult, start_restore

__all__ = ["CriuSnapshotter"]


class CriuSnapshotter:
    """Dump a process tree into an image directory and restore it from there, as many times as needed."""

    def __init__(self, criu: Criu | None = None, options: SnapshotOptions = SnapshotOptions()):
        self.criu = criu or Criu()
        self.options = options

    def dump(self, root_pid: int, images: Path, timeout: float = 600, owned_root: Path | None = None,
             compact: bool = True) -> DumpResult:
        """Dump (and so stop) the tree rooted at ``root_pid`` into the empty directory ``images``
        (:func:`~coldsnap.snapshot.criu_dump.dump_tree`)."""
        return dump_tree(self.criu, self.options, root_pid, images, timeout, owned_root, compact)

    def restore(self, images: Path, state_dir: Path, owned_root: Path | None = None, timeout: float = 600,
                wait_for_pids_s: float = 10.0, replica: bool = True, own_images: bool = False,
                before_unlock: Callable[[], None] | None = None) -> RestoreResult:
        """Restore the tree detached (it keeps running after this returns) and wait for it
        (:func:`~coldsnap.snapshot.criu_restore.start_restore`, then :meth:`PendingRestore.finish`)."""
        return self.start_restore(images, state_dir, owned_root, timeout, wait_for_pids_s, replica, own_images,
                                  before_unlock).finish()

    def start_restore(self, images: Path, state_dir: Path, owned_root: Path | None = None, timeout: float = 600,
                      wait_for_pids_s: float = 10.0, replica: bool = True, own_images: bool = False,
                      before_unlock: Callable[[], None] | None = None) -> PendingRestore:
        """:meth:`restore`, returning once CRIU runs (a replica) or is done (the host's namespace)
        (:func:`~coldsnap.snapshot.criu_restore.start_restore`)."""
        return start_restore(self.criu, self.options, images, state_dir, owned_root, timeout, wait_for_pids_s,
                             replica, own_images, before_unlock)

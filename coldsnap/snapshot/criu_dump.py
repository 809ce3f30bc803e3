"""A CRIU dump: a process tree into an image directory, the files it writes under its artifact taken as
external, its zero pages left out of the image."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from coldsnap.snapshot.criu_binary import Criu, CriuError, log_file_tail, output_tail
from coldsnap.snapshot.criu_images import ImageFormatError
from coldsnap.snapshot.criu_options import EXTERNAL_NETNS_KEY, SnapshotOptions, log_level_args

if TYPE_CHECKING:
    from coldsnap.snapshot.criu_pages import ImageCensus

__all__ = ["DumpResult", "dump_tree"]


@dataclass(frozen=True)
class DumpResult:
    seconds: float
    image_bytes: int
    pids: list[int]
    census: "ImageCensus | None" = None
    """Each process's private pages by kind, and the zero pages left out (None: not compacted)."""
    compact_seconds: float = 0.0


def _network_namespace(pid: int) -> int | None:
    """The inode of ``pid``'s network namespace (None when it cannot be read)."""
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None


def _tree_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


def dump_tree(criu: Criu, options: SnapshotOptions, root_pid: int, images: Path, timeout: float = 600,
              owned_root: Path | None = None, compact: bool = True) -> DumpResult:
    """Dump (and so stop) the tree rooted at ``root_pid`` into the empty directory ``images``.

    ``compact`` (the default): the zero pages of private anonymous memory are then left out of the
    image (:func:`coldsnap.snapshot.criu_pages.compact_image`); the restore reads fewer pages and
    gives the same memory.

    Files under ``owned_root`` (the artifact) that the tree has open for writing — the engine's log —
    are dumped as external files: a restore gives the tree its own copy (see :func:`~coldsnap.snapshot.criu_restore.start_restore`), so
    the artifact is never written to and can move."""
    from coldsnap.snapshot import process_tree

    images.mkdir(parents=True, exist_ok=True)
    if any(images.iterdir()):
        raise CriuError("dump", None, f"image directory {images} is not empty")
    keys: dict[str, str] = {}
    pids, written, shm = process_tree.scan_tree(root_pid, keys)
    if not pids:
        raise CriuError("dump", None, f"no process {root_pid}")
    root = owned_root.resolve() if owned_root is not None else None
    # path → CRIU key of each file under owned_root the tree writes to
    owned = {path: keys[path] for path in written if root is not None and Path(path).is_relative_to(root)}
    shm_before = {p.name for p in process_tree.SHM_DIR.iterdir()} if process_tree.SHM_DIR.is_dir() else set()
    # A tree in a network namespace other than ours (a launch unit on a host of its own): the namespace is
    # placement, not part of the image. Dumped, it would come back as a copy of the capture host's devices,
    # addresses and routes, reachable from nowhere; external, each restore puts the tree into its own host's.
    netns = _network_namespace(root_pid)
    external_netns = netns is not None and netns != _network_namespace(os.getpid())
    netns_args = ["--external", f"net[{netns}]:{EXTERNAL_NETNS_KEY}"] if external_netns else []
    started = time.monotonic()
    # --link-remap: files unlinked while open (semaphores, temp files) are linked back under a new name.
    args = ["dump", "-t", str(root_pid), "-D", str(images), "-o", "dump.log", "--link-remap", *options.args(),
            *(argument for key in owned.values() for argument in ("--external", key)), *netns_args, *log_level_args()]
    result = criu.run("dump", args, timeout=timeout)
    seconds = time.monotonic() - started
    if result.returncode != 0:
        raise CriuError("dump", result.returncode, log_file_tail(images / "dump.log") or output_tail(result.stderr))
    # The sizes the frozen tree left, not the scan's: the tree ran on until CRIU froze it, and a line it
    # appended meanwhile is in the image's memory as written. Cut back to the scan's size, every restore
    # would lose it (a test's echo log showed a gap).
    written = process_tree.file_sizes(written)
    external: dict[str, dict[str, object]] = {
        key: {"path": str(Path(path).relative_to(root)), "size": written.pop(path)}
        for path, key in owned.items() if root is not None}
    process_tree.capture_tree_files(images, pids, written, shm, shm_before, external, external_netns)
    census, compact_seconds = None, 0.0
    if compact:
        from coldsnap.snapshot.criu_pages import compact_image  # (a dump's only: a restore's entry imports less)

        started = time.monotonic()
        try:
            census = compact_image(images)
        except (ImageFormatError, OSError) as exc:
            raise CriuError("dump", None, f"leaving the zero pages out of the image: {exc}") from None
        compact_seconds = time.monotonic() - started
    return DumpResult(seconds=seconds, image_bytes=_tree_bytes(images), pids=pids, census=census,
                      compact_seconds=compact_seconds)

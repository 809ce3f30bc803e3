"""What a pull keeps on disk between its runs: the staging folder beside DIR and its lock, the pull's state
file (which artifact it holds; in DIR, an artifact handed over before its packs were complete), each pack's
chunk progress, and the files an interrupted pull left whole."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Callable

from coldsnap.payload.validation import recorded
from coldsnap.registry.client import sha256_digest
from coldsnap.registry.layout import Blob, Chunk

__all__ = ["STATE_FILE", "PullLock", "arrived_whole", "chunk_on_disk", "chunk_progress_file", "incomplete",
           "load_chunk_progress", "lock_path", "reset_if_other", "same_artifact", "staging_dir", "state_digest"]

STATE_FILE = ".coldsnap-pull.json"


def staging_dir(destination: Path) -> Path:
    return destination.parent / f".{destination.name}.coldsnap-pull"


def lock_path(destination: Path) -> Path:
    return destination.parent / f".{destination.name}.coldsnap-pull.lock"


def incomplete(directory: Path) -> bool:
    """Whether ``directory`` is an artifact a streaming pull handed over before its packs were complete,
    and which it did not finish (interrupted): a later pull resumes it in place."""
    return (directory / STATE_FILE).exists()


def chunk_progress_file(pack: Path) -> Path:
    return pack.with_name(pack.name + ".chunks")


def load_chunk_progress(pack: Path, blob: Blob) -> set[int]:
    try:
        state = json.loads(chunk_progress_file(pack).read_text())
        if state["sha256"] == blob.digest[7:] and state["chunks"] == [c.digest for c in blob.chunks]:
            return {int(i) for i in state["done"]}
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return set()


def chunk_on_disk(fd: int, chunk: Chunk) -> bool:
    """Whether the file already holds this chunk's bytes (an interrupted pull wrote it)."""
    hasher = hashlib.sha256()
    buffer = bytearray(min(8 << 20, chunk.size))
    view = memoryview(buffer)
    position, left = chunk.offset, chunk.size
    while left:
        n = os.preadv(fd, [view[:min(left, len(buffer))]], position)
        if n <= 0:
            return False
        hasher.update(view[:n])
        position += n
        left -= n
    return "sha256:" + hasher.hexdigest() == chunk.digest


def state_digest(directory: Path) -> str | None:
    try:
        return json.loads((directory / STATE_FILE).read_text()).get("digest")
    except (OSError, ValueError, AttributeError):
        return None


def same_artifact(destination: Path, descriptor: Blob) -> bool:
    try:
        return sha256_digest((destination / "artifact.json").read_bytes()) == descriptor.digest
    except OSError:
        return False


class PullLock:
    """One pull per destination at a time, across processes and containers sharing the folder: a flock on
    ``.DIR.coldsnap-pull.lock`` beside DIR (kept: removing a lock file races with its next taker). A second
    pull waits for the first, then finds DIR there."""

    def __init__(self, destination: Path, log: Callable[[str], None]):
        self.path = lock_path(destination)
        self.log = log

    def __enter__(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.log(f"another pull into {self.path.parent} is under way; waiting for it")
            fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)


def reset_if_other(staging: Path, digest: str) -> None:
    """A staging folder left by a pull of another artifact is emptied; one of this artifact resumes."""
    state = staging / STATE_FILE
    try:
        previous = json.loads(state.read_text()).get("digest")
    except (OSError, ValueError, AttributeError):
        previous = None
    if previous != digest:
        for child in staging.iterdir():
            shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
    state.write_text(json.dumps({"digest": digest}))


def arrived_whole(staging: Path, blob: Blob) -> bool:
    """Whether an earlier, interrupted pull left this file whole (its validation record vouches)."""
    path = staging / blob.path
    return path.is_file() and path.stat().st_size == blob.size and recorded(path, blob.digest[7:])

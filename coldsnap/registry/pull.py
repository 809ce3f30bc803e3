"""``coldsnap pull REF DIR``: an artifact out of a registry, verified, written atomically, resumable.

The index is fetched first and everything else by digest: each manifest is checked against the digest
its index names, each blob's SHA-256 while it streams to disk. Files land in a staging folder beside
DIR (``.DIR.coldsnap-pull``, one pull at a time by a lock beside it); a file that arrived whole is recorded in its folder's validation record
(:mod:`coldsnap.payload.validation`) the moment its digest matched, so an interrupted pull started again
fetches only what is missing (and the missing ranges of a large blob), and the first restore trusts
the records instead of hashing the pack again. Only when every file matches, the descriptor decodes and
binds exactly the files that arrived, the staging folder is renamed to DIR: a reader sees no artifact
or the whole one.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from coldsnap.atomic import fsync_directory
from coldsnap.contracts.artifact import ArtifactDescriptor
from coldsnap.contracts.base import ContractError, load_document
from coldsnap.contracts.capsule import CapsuleManifest
from coldsnap.payload.errors import PackDigestMismatch, PackUnreadable
from coldsnap.payload.validation import record_written_file, verify_file
from coldsnap.registry.client import RANGE_BYTES, RegistryClient, sha256_digest
from coldsnap.registry.layout import DESCRIPTOR_TYPE, Blob, LayoutError, read_index, read_manifest
from coldsnap.registry.reference import Reference

__all__ = ["DestinationTaken", "PullError", "PullResult", "lock_path", "pull", "staging_dir"]

PARALLEL_BLOBS = 4
_STATE = ".coldsnap-pull.json"


class PullError(Exception):
    """A pull that cannot go on: a published artifact that does not hold together."""


class DestinationTaken(PullError):
    """DIR exists and holds something other than this artifact (the caller's to fix)."""


@dataclass
class PullResult:
    directory: Path
    digest: str
    """The index digest: what was pulled, whatever tag named it."""
    blobs: int = 0
    blobs_fetched: int = 0
    bytes_total: int = 0
    bytes_fetched: int = 0
    seconds: float = 0.0
    already_there: bool = False


def staging_dir(destination: Path) -> Path:
    return destination.parent / f".{destination.name}.coldsnap-pull"


def lock_path(destination: Path) -> Path:
    return destination.parent / f".{destination.name}.coldsnap-pull.lock"


def _contents(client: RegistryClient, reference: Reference) -> tuple[str, list[Blob]]:
    """The index digest and every file of the artifact, the descriptor's ``artifact.json`` first."""
    data, _, digest = client.get_manifest(reference.pinned)
    what = f"{reference.registry}/{reference.repository}@{digest}"
    blobs: list[Blob] = []
    for manifest_digest, _, kind in sorted(read_index(data, what), key=lambda e: e[2] != DESCRIPTOR_TYPE):
        manifest, _, _ = client.get_manifest(manifest_digest)
        blobs.extend(read_manifest(manifest, kind, f"{what}: manifest {manifest_digest}"))
    seen: dict[str, Blob] = {}
    for blob in blobs:
        if seen.setdefault(blob.path, blob) != blob:
            raise LayoutError(f"{what}: {blob.path} is published twice with different contents")
    if not blobs or blobs[0].path != "artifact.json":
        raise LayoutError(f"{what}: the descriptor manifest's config is not artifact.json")
    return digest, list(seen.values())


def pull(reference: Reference, destination: Path, client: RegistryClient,
         on_progress: Callable[[int, int], None] | None = None, log: Callable[[str], None] = lambda _: None) -> PullResult:
    started = time.monotonic()
    digest, blobs = _contents(client, reference)
    result = PullResult(destination, digest, blobs=len(blobs), bytes_total=sum(b.size for b in blobs))
    staging = staging_dir(destination)
    with _locked(destination, log):
        if destination.exists():  # checked under the lock: a pull that held it may just have renamed its staging here
            if _same_artifact(destination, blobs[0]):
                result.already_there, result.seconds = True, time.monotonic() - started
                return result
            raise DestinationTaken(f"{destination} already exists and is not this artifact: pull into a new directory")
        staging.mkdir(parents=True, exist_ok=True)
        _reset_if_other(staging, digest)
        todo = [b for b in blobs if not _arrived(staging, b)]
        result.blobs_fetched = len(todo)
        to_fetch = sum(b.size for b in todo)
        if len(todo) < len(blobs):
            log(f"resuming: {len(blobs) - len(todo)} of {len(blobs)} files already here")
        got = [0]
        lock = threading.Lock()

        def count(n: int) -> None:
            with lock:
                got[0] += n
                if on_progress:
                    on_progress(got[0], to_fetch)

        def fetch(blob: Blob) -> None:
            target = staging / blob.path
            target.parent.mkdir(parents=True, exist_ok=True)
            client.fetch_blob(blob.digest, blob.size, target, on_bytes=count)
            os.chmod(target, blob.mode)  # before the record: a chmod changes the ctime the record binds
            record_written_file(target, blob.digest[7:])

        large = [b for b in todo if b.size > RANGE_BYTES]  # fetched one at a time, each in parallel ranges
        with ThreadPoolExecutor(PARALLEL_BLOBS, thread_name_prefix="coldsnap-pull") as pool:
            small = [pool.submit(fetch, b) for b in todo if b.size <= RANGE_BYTES]
            for blob in large:
                fetch(blob)
            for future in small:
                future.result()
        result.bytes_fetched = got[0]
        _check_artifact(staging, blobs, f"{reference.registry}/{reference.repository}@{digest}")
        (staging / _STATE).unlink(missing_ok=True)
        os.rename(staging, destination)
    fsync_directory(destination.parent)
    result.seconds = time.monotonic() - started
    return result


def _same_artifact(destination: Path, descriptor: Blob) -> bool:
    try:
        return sha256_digest((destination / "artifact.json").read_bytes()) == descriptor.digest
    except OSError:
        return False


class _locked:
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


def _reset_if_other(staging: Path, digest: str) -> None:
    """A staging folder left by a pull of another artifact is emptied; one of this artifact resumes."""
    state = staging / _STATE
    try:
        previous = json.loads(state.read_text()).get("digest")
    except (OSError, ValueError, AttributeError):
        previous = None
    if previous != digest:
        for child in staging.iterdir():
            shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
    state.write_text(json.dumps({"digest": digest}))


def _arrived(staging: Path, blob: Blob) -> bool:
    """Whether an earlier, interrupted pull left this file whole (its validation record vouches)."""
    path = staging / blob.path
    if not path.is_file() or path.stat().st_size != blob.size:
        return False
    try:
        return verify_file(path, blob.digest[7:]).method == "record"
    except (PackDigestMismatch, PackUnreadable):
        return False


def _check_artifact(staging: Path, blobs: list[Blob], what: str) -> None:
    """The descriptor and capsules decode and bind exactly the digests that arrived."""
    arrived = {b.path: b.digest[7:] for b in blobs}
    try:
        descriptor = load_document(ArtifactDescriptor, staging / "artifact.json")
        refs = []
        for unit in descriptor.units:
            refs.append((unit.capsule.path, unit.capsule.sha256))
            capsule = load_document(CapsuleManifest, staging / unit.capsule.path)
            images = Path(unit.capsule.path).parent / "images"
            refs.extend((str(images / f.path), f.sha256) for f in capsule.files)
            for worker in unit.workers:
                refs.extend((r.path, r.sha256) for r in (worker.residual, worker.payload, worker.recovery_plan,
                                                           worker.recovery_gap) if r is not None)
    except ContractError as exc:
        raise PullError(f"{what} does not hold a valid artifact: {exc}") from None
    for path, sha256 in refs:
        if arrived.get(path) != sha256:
            raise PullError(f"{what}: the descriptor binds {path} to {sha256[:16]}…, but the published artifact "
                            f"{'has other bytes there' if path in arrived else 'does not carry it'}")

"""``coldsnap pull REF DIR``: an artifact out of a registry, verified, written atomically, resumable.

The index is fetched first and everything else by digest: each manifest is checked against the digest
its index names, each blob's SHA-256 while it streams to disk. Files land in a staging folder beside
DIR (``.DIR.coldsnap-pull``, one pull at a time by a lock beside it); a file that arrived whole is recorded in its folder's validation record
(:mod:`coldsnap.payload.validation`) the moment its digest matched, so an interrupted pull started again
fetches only what is missing (and the missing ranges of a large blob), and the first restore trusts
the records instead of hashing the pack again. Only when every file matches, the descriptor decodes and
binds exactly the files that arrived, the staging folder is renamed to DIR: a reader sees no artifact
or the whole one.

A chunked pack (:mod:`coldsnap.registry.publish`) comes down as its chunks, many at once, each written
with ``pwrite`` into its place in the final file and hashed on the thread that received it, so a pull
hashes on every core; the disk is told to start writing each chunk back as soon as it is in
(``sync_file_range``), so the last ``fsync`` finds little left to write and the page cache holds no
long tail of dirty pages. The index binds every chunk's digest to the pack's SHA-256 the descriptor
names, and a coldsnap publish derives both from one read of a file it verified whole: a pack whose
every chunk matched is recorded as that SHA-256 without hashing it again in order (which one core
would do at ~2 GB/s, slower than the disk).

:class:`PullSession` can also hand the artifact over before its packs are complete (``restore
oci://REF`` on a host with no copy): once every other file is in and checked, the staging folder is
renamed to DIR with the pull's state file still inside it (``.coldsnap-pull.json``: an incomplete DIR,
which a later pull resumes in place), and each pack's :class:`~coldsnap.payload.arrival.PackArrival`
says which chunks a reader may use.

What a pull keeps on disk between runs (staging folder, lock, state and chunk progress) is
:mod:`coldsnap.registry.pull_staging`; how the chunks reach the disk, :mod:`coldsnap.registry.pull_writes`.
"""

from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from coldsnap.atomic import fsync_directory
from coldsnap.contracts.artifact import ArtifactDescriptor
from coldsnap.contracts.base import ContractError, load_document
from coldsnap.contracts.capsule import CapsuleManifest
from coldsnap.payload.arrival import PackArrival, arriving, forget_arrival
from coldsnap.payload.validation import record_written_file
from coldsnap.registry.client import RANGE_BYTES, RegistryClient
from coldsnap.registry.layout import DESCRIPTOR_TYPE, Blob, Chunk, LayoutError, read_index, read_manifest
from coldsnap.registry.publish import record_chunks
from coldsnap.registry.pull_staging import (STATE_FILE, PullLock, arrived_whole, chunk_on_disk, chunk_progress_file,
                                            incomplete, load_chunk_progress, reset_if_other, same_artifact, staging_dir,
                                            state_digest)
from coldsnap.registry.pull_writes import ChunkWriteback, direct_writes
from coldsnap.registry.reference import Reference
from coldsnap.settings import SETTINGS

__all__ = ["DestinationTaken", "PullError", "PullResult", "PullSession", "pull"]

PARALLEL_BLOBS = 4
PARALLEL_STREAMS = SETTINGS.number("COLDSNAP_PULL_STREAMS") or min(16, max(4, 2 * (os.cpu_count() or 1)))
"""Chunks (and ranges of a large file) fetched at once: each stream receives, hashes and writes on its own
thread, so more streams use more cores, up to what the link and the registry give."""


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
    """Pull the artifact into ``destination``, whole and verified, before returning."""
    return PullSession(reference, destination, client, on_progress, log).run()


class PullSession:
    """One pull: :meth:`run` to pull whole, or :meth:`start` → :meth:`usable` (DIR there, packs arriving)
    → :meth:`finish` to hand DIR over early. :meth:`cancel` stops it; what arrived stays for a resume."""

    def __init__(self, reference: Reference, destination: Path, client: RegistryClient,
                 on_progress: Callable[[int, int], None] | None = None, log: Callable[[str], None] = lambda _: None):
        self.reference = reference
        self.destination = destination
        self.client = client
        self.on_progress = on_progress
        self.log = log
        self.result: PullResult | None = None
        self.arrivals: dict[str, PackArrival] = {}
        """Each chunked pack being fetched, by its path in the artifact."""
        self.handed_over = threading.Event()
        self._dir_ready = False  # DIR holds every file but the packs' chunks, checked
        self._stream = False
        self._error: BaseException | None = None
        self._cancelled = threading.Event()
        self._thread: threading.Thread | None = None
        self._root_lock = threading.Lock()
        self._root = destination  # where the files are now: the staging folder, then DIR
        self._got = 0
        self._to_fetch = 0
        self._count_lock = threading.Lock()

    # --- the two ways to run it --------------------------------------------------------------------

    def run(self) -> PullResult:
        self._pull()
        assert self.result is not None
        return self.result

    def start(self) -> "PullSession":
        self._stream = True
        self._thread = threading.Thread(target=self._in_background, name="coldsnap-pull", daemon=True)
        self._thread.start()
        return self

    def _in_background(self) -> None:
        try:
            self._pull()
        except BaseException as exc:  # the caller's: usable() and finish() raise it
            self._error = exc
            for arrival in self.arrivals.values():
                arrival.fail(f"{type(exc).__name__}: {exc}")
        finally:
            for arrival in self.arrivals.values():
                forget_arrival(arrival.path)
            self.handed_over.set()

    def usable(self) -> Path:
        """Wait until DIR holds the artifact with every file but the packs' chunks verified; raises the pull's
        error when it failed first."""
        self.handed_over.wait()
        if self._error is not None and not self._dir_ready:
            raise self._error
        return self.destination

    def finish(self) -> PullResult:
        """Wait for the last chunk, the records and the final rename; raises the pull's error."""
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
        assert self.result is not None
        return self.result

    def cancel(self) -> None:
        self._cancelled.set()
        for arrival in self.arrivals.values():
            arrival.fail("the pull was cancelled")

    # --- the pull ----------------------------------------------------------------------------------------

    def _count(self, n: int) -> None:
        with self._count_lock:
            self._got += n
            if self.on_progress:
                self.on_progress(self._got, self._to_fetch)

    def _pull(self) -> None:
        started = time.monotonic()
        digest, blobs = _contents(self.client, self.reference)
        destination = self.destination
        result = self.result = PullResult(destination, digest, blobs=len(blobs), bytes_total=sum(b.size for b in blobs))
        with PullLock(destination, self.log):
            if destination.exists() and not incomplete(destination):  # checked under the lock: a pull that held
                if same_artifact(destination, blobs[0]):             # it may just have renamed its staging here
                    result.already_there, result.seconds = True, time.monotonic() - started
                    return
                raise DestinationTaken(f"{destination} already exists and is not this artifact: pull into a new directory")
            if destination.exists() and state_digest(destination) != digest:
                raise DestinationTaken(f"{destination} holds an unfinished pull of another artifact: pull into a new "
                                       "directory, or remove it")
            work = destination if destination.exists() else staging_dir(destination)
            work.mkdir(parents=True, exist_ok=True)
            reset_if_other(work, digest)
            self._root = work
            files = [b for b in blobs if not b.chunks and not arrived_whole(work, b)]
            packs = [b for b in blobs if b.chunks and not arrived_whole(work, b)]
            result.blobs_fetched = len(files) + sum(len(p.chunks) for p in packs)
            fetched_before = sum(b.size for b in blobs) - sum(b.size for b in files) - sum(p.size for p in packs)
            if fetched_before:
                self.log(f"resuming: {fetched_before / 1e9:.2f} of {result.bytes_total / 1e9:.2f} GB already here")
            self._to_fetch = sum(b.size for b in files) + sum(p.size for p in packs)
            fds: dict[str, int] = {}
            direct_fds: dict[str, int] = {}
            writeback = ChunkWriteback()
            try:
                for pack in packs:  # opened now: the descriptors stay valid when the folder is renamed
                    target = work / pack.path
                    target.parent.mkdir(parents=True, exist_ok=True)
                    fds[pack.path] = fd = os.open(target, os.O_RDWR | os.O_CREAT, 0o644)
                    if os.fstat(fd).st_size != pack.size:
                        os.ftruncate(fd, pack.size)
                    direct = direct_writes(self._stream, pack)
                    if direct is not None:
                        try:
                            direct_fds[pack.path] = os.open(target, os.O_WRONLY | os.O_DIRECT)
                        except OSError:  # a filesystem without O_DIRECT (tmpfs): through the page cache
                            pass
                    self.arrivals[pack.path] = arrival = PackArrival(destination / pack.path,
                                                                     [c.offset for c in pack.chunks], pack.size)
                    if self._stream:
                        arriving(arrival)
                self._fetch_files(work, files)
                _check_artifact(work, blobs, f"{self.reference.registry}/{self.reference.repository}@{digest}")
                if self._stream and packs and work != destination:  # hand DIR over: the packs go on arriving
                    os.rename(work, destination)
                    fsync_directory(destination.parent)
                    with self._root_lock:
                        self._root = work = destination
                self._dir_ready = True
                self.handed_over.set()
                self._fetch_chunks(packs, fds, direct_fds, writeback)
                writeback.close()
                for pack in packs:
                    os.fsync(fds[pack.path])
            finally:
                writeback.close()
                for fd in [*direct_fds.values(), *fds.values()]:
                    os.close(fd)
            with self._root_lock:
                for pack in packs:
                    target = work / pack.path
                    os.chmod(target, pack.mode)
                    record_written_file(target, pack.digest[7:])  # the chunks matched: see the module's note
                    record_chunks(target, pack.chunks[0].size, pack.chunks)  # (publishing it again reads nothing)
                    chunk_progress_file(target).unlink(missing_ok=True)
                    forget_arrival(self.arrivals[pack.path].path)
                (work / STATE_FILE).unlink(missing_ok=True)
                if work != destination:
                    os.rename(work, destination)
            fsync_directory(destination.parent)
            self._dir_ready = True
        result.bytes_fetched = self._got
        result.seconds = time.monotonic() - started

    def _fetch_files(self, work: Path, files: list[Blob]) -> None:
        """Every file but the packs: the large ones (a capsule's page images) one at a time in parallel ranges,
        the rest several at once."""

        def fetch(blob: Blob) -> None:
            if self._cancelled.is_set():
                raise PullError("the pull was cancelled")
            target = work / blob.path
            target.parent.mkdir(parents=True, exist_ok=True)
            self.client.fetch_blob(blob.digest, blob.size, target, on_bytes=self._count, parallel=PARALLEL_STREAMS)
            os.chmod(target, blob.mode)  # before the record: a chmod changes the ctime the record binds
            record_written_file(target, blob.digest[7:])

        with ThreadPoolExecutor(PARALLEL_BLOBS, thread_name_prefix="coldsnap-pull") as pool:
            small = [pool.submit(fetch, b) for b in files if b.size <= RANGE_BYTES]
            for blob in files:
                if blob.size > RANGE_BYTES:
                    fetch(blob)
            for future in small:
                future.result()

    def _fetch_chunks(self, packs: list[Blob], fds: dict[str, int], direct_fds: dict[str, int],
                      writeback: ChunkWriteback) -> None:
        """Every chunk not already here, :data:`PARALLEL_STREAMS` at once, each marked arrived the moment its
        digest matched; a chunk an interrupted pull left is hashed again from disk before it counts."""
        failures: list[BaseException] = []

        def fetch(pack: Blob, index: int, chunk: Chunk, resumed: bool) -> None:
            if failures or self._cancelled.is_set():
                return
            fd = fds[pack.path]
            try:
                if not (resumed and chunk_on_disk(fd, chunk)):
                    arrival = self.arrivals[pack.path]
                    direct_fd = None if self._stream and arrival.through_cache else direct_fds.get(pack.path)
                    self.client.fetch_chunk(chunk.digest, chunk.size, fd, chunk.offset, direct_fd=direct_fd,
                                            on_bytes=self._count)
                    if direct_fd is None:
                        writeback.start(fd, chunk.offset, chunk.size)
                else:
                    self._count(chunk.size)
                self.arrivals[pack.path].arrived(index)
                self._note_progress(pack, index)
            except BaseException as exc:
                failures.append(exc)
                self.arrivals[pack.path].fail(f"{type(exc).__name__}: {exc}")

        with ThreadPoolExecutor(PARALLEL_STREAMS, thread_name_prefix="coldsnap-pull-chunk") as pool:
            futures = []
            for pack in packs:
                with self._root_lock:
                    done = load_chunk_progress(self._root / pack.path, pack)
                futures += [pool.submit(fetch, pack, i, c, i in done) for i, c in enumerate(pack.chunks)]
            wait(futures)
        if failures:
            raise failures[0]
        if self._cancelled.is_set():
            raise PullError("the pull was cancelled")

    def _note_progress(self, pack: Blob, index: int) -> None:
        """The chunks of ``pack`` that arrived, beside it (``<pack>.chunks``), for a pull run again."""
        arrival = self.arrivals[pack.path]
        with self._root_lock:
            done = [i for i in range(len(pack.chunks)) if arrival._arrived[i]]
            path = chunk_progress_file(self._root / pack.path)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps({"sha256": pack.digest[7:], "chunks": [c.digest for c in pack.chunks], "done": done}))
            os.replace(tmp, path)


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

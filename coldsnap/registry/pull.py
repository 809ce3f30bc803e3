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
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import hashlib
import json
import os
import shutil
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
from coldsnap.payload.validation import record_written_file, recorded
from coldsnap.registry.client import RANGE_BYTES, RegistryClient, sha256_digest
from coldsnap.registry.layout import DESCRIPTOR_TYPE, Blob, Chunk, LayoutError, read_index, read_manifest
from coldsnap.registry.publish import record_chunks
from coldsnap.registry.reference import Reference
from coldsnap.settings import SETTINGS

__all__ = ["DestinationTaken", "PullError", "PullResult", "PullSession", "incomplete", "lock_path", "pull", "staging_dir"]

PARALLEL_BLOBS = 4
PARALLEL_STREAMS = SETTINGS.number("COLDSNAP_PULL_STREAMS") or min(16, max(4, 2 * (os.cpu_count() or 1)))
"""Chunks (and ranges of a large file) fetched at once: each stream receives, hashes and writes on its own
thread, so more streams use more cores, up to what the link and the registry give."""
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


def incomplete(directory: Path) -> bool:
    """Whether ``directory`` is an artifact a streaming pull handed over before its packs were complete,
    and which it did not finish (interrupted): a later pull resumes it in place."""
    return (directory / _STATE).exists()


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


_SYNC_FILE_RANGE_WRITE = 2
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


DIRECT_ENV = "COLDSNAP_PULL_DIRECT"
"""``0``: never write the packs' chunks with O_DIRECT (:func:`_direct_writes`)."""


def _direct_writes(stream: bool, pack: Blob) -> bool | None:
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


class _Writeback:
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
        with _locked(destination, self.log):
            if destination.exists() and not incomplete(destination):  # checked under the lock: a pull that held
                if _same_artifact(destination, blobs[0]):             # it may just have renamed its staging here
                    result.already_there, result.seconds = True, time.monotonic() - started
                    return
                raise DestinationTaken(f"{destination} already exists and is not this artifact: pull into a new directory")
            if destination.exists() and _state_digest(destination) != digest:
                raise DestinationTaken(f"{destination} holds an unfinished pull of another artifact: pull into a new "
                                       "directory, or remove it")
            work = destination if destination.exists() else staging_dir(destination)
            work.mkdir(parents=True, exist_ok=True)
            _reset_if_other(work, digest)
            self._root = work
            files = [b for b in blobs if not b.chunks and not _arrived(work, b)]
            packs = [b for b in blobs if b.chunks and not _arrived(work, b)]
            result.blobs_fetched = len(files) + sum(len(p.chunks) for p in packs)
            fetched_before = sum(b.size for b in blobs) - sum(b.size for b in files) - sum(p.size for p in packs)
            if fetched_before:
                self.log(f"resuming: {fetched_before / 1e9:.2f} of {result.bytes_total / 1e9:.2f} GB already here")
            self._to_fetch = sum(b.size for b in files) + sum(p.size for p in packs)
            fds: dict[str, int] = {}
            direct_fds: dict[str, int] = {}
            writeback = _Writeback()
            try:
                for pack in packs:  # opened now: the descriptors stay valid when the folder is renamed
                    target = work / pack.path
                    target.parent.mkdir(parents=True, exist_ok=True)
                    fds[pack.path] = fd = os.open(target, os.O_RDWR | os.O_CREAT, 0o644)
                    if os.fstat(fd).st_size != pack.size:
                        os.ftruncate(fd, pack.size)
                    direct = _direct_writes(self._stream, pack)
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
                    _chunk_progress(target).unlink(missing_ok=True)
                    forget_arrival(self.arrivals[pack.path].path)
                (work / _STATE).unlink(missing_ok=True)
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
                      writeback: _Writeback) -> None:
        """Every chunk not already here, :data:`PARALLEL_STREAMS` at once, each marked arrived the moment its
        digest matched; a chunk an interrupted pull left is hashed again from disk before it counts."""
        failures: list[BaseException] = []

        def fetch(pack: Blob, index: int, chunk: Chunk, resumed: bool) -> None:
            if failures or self._cancelled.is_set():
                return
            fd = fds[pack.path]
            try:
                if not (resumed and _chunk_on_disk(fd, chunk)):
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
                    done = _load_chunk_progress(self._root / pack.path, pack)
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
            path = _chunk_progress(self._root / pack.path)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps({"sha256": pack.digest[7:], "chunks": [c.digest for c in pack.chunks], "done": done}))
            os.replace(tmp, path)


def _chunk_progress(pack: Path) -> Path:
    return pack.with_name(pack.name + ".chunks")


def _load_chunk_progress(pack: Path, blob: Blob) -> set[int]:
    try:
        state = json.loads(_chunk_progress(pack).read_text())
        if state["sha256"] == blob.digest[7:] and state["chunks"] == [c.digest for c in blob.chunks]:
            return {int(i) for i in state["done"]}
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return set()


def _chunk_on_disk(fd: int, chunk: Chunk) -> bool:
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


def _state_digest(directory: Path) -> str | None:
    try:
        return json.loads((directory / _STATE).read_text()).get("digest")
    except (OSError, ValueError, AttributeError):
        return None


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
    return path.is_file() and path.stat().st_size == blob.size and recorded(path, blob.digest[7:])


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

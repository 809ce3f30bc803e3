"""``coldsnap publish DIR REF``: an artifact directory into a registry (layout: :mod:`coldsnap.registry`).

Nothing is sent that the registry has: every blob and manifest is asked for first by digest, so a
second publish of the same artifact (or of another capture that uses the same pack) sends only what
is new — at most the index. Every file is checked against the digest the descriptor or capsule binds
before it goes out (the validation records make that cheap), so a damaged artifact is never published.

A native pack goes up as fixed-size chunks (:data:`CHUNK_BYTES`, 256 MiB), each its own blob, many at once:
the registry hashes each upload on its own core, a pull fetches and hashes them on all of its cores, and
a pack that shares chunks with one the registry has (the same bytes at the same place) sends only the
others. The chunks are hashed in one parallel read of the pack, right after it was verified whole.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from coldsnap.atomic import write_atomic
from coldsnap.contracts.artifact import ArtifactDescriptor, FileRef
from coldsnap.contracts.base import load_document
from coldsnap.contracts.capsule import CapsuleManifest
from coldsnap.payload.records import VALIDATION_RECORD_NAME
from coldsnap.payload.validation import sha256_file, verify_files
from coldsnap.registry.client import RegistryClient, sha256_digest
from coldsnap.registry.layout import (CAPSULE_TYPE, DESCRIPTOR_CONFIG_TYPE, CAPSULE_CONFIG_TYPE, DESCRIPTOR_TYPE,
                                      EMPTY_CONFIG, FILE_TYPE, INDEX_MEDIA_TYPE, MANIFEST_MEDIA_TYPE, PACK_TYPE, Blob,
                                      Chunk, chunked_pack_manifest_bytes, index_bytes, manifest_bytes)
from coldsnap.registry.reference import Reference

__all__ = ["CHUNK_BYTES", "PublishResult", "publish"]

PARALLEL_BLOBS = min(16, max(4, os.cpu_count() or 1))
"""Uploads at once: the registry hashes each on its own goroutine, so more of them use more of its cores."""
CHUNK_BYTES = 256 << 20
"""A pack's chunk size (``--chunk-mib``): large enough that a chunk's request costs nothing against its
bytes, small enough that a 16 GB pack is 60 of them to spread over every core."""
_SKIPPED_NAMES = (VALIDATION_RECORD_NAME, "artifact.pending.json")


@dataclass
class PublishResult:
    reference: Reference
    """The reference published, with the index digest."""
    digest: str
    blobs: int = 0
    blobs_sent: int = 0
    bytes_total: int = 0
    bytes_sent: int = 0
    seconds: float = 0.0
    manifests_sent: int = 0
    packs: list[str] = field(default_factory=list)


@dataclass
class _Plan:
    artifact_id: str
    descriptor: list[Blob]
    capsules: dict[str, list[Blob]]
    packs: list[Blob]


def _blob(root: Path, relative: str, sha256: str, media_type: str | None = None) -> Blob:
    status = (root / relative).stat()
    return Blob(relative, "sha256:" + sha256, status.st_size, stat.S_IMODE(status.st_mode) & 0o777,
                media_type or FILE_TYPE)


def _plan(root: Path) -> _Plan:
    """Which file goes into which manifest, every digest checked against what the artifact binds."""
    descriptor = load_document(ArtifactDescriptor, root / "artifact.json")
    bound: dict[str, str] = {}  # relative path → sha256 the descriptor or a capsule binds
    owner: dict[str, str] = {}  # relative path → unit id ("" for the descriptor's manifest)
    packs: dict[str, FileRef] = {}

    def bind(ref: FileRef | None, unit: str) -> None:
        if ref is not None:
            bound[ref.path] = ref.sha256
            owner[ref.path] = unit

    for unit in descriptor.units:
        bind(unit.capsule, unit.unit_id)
        capsule = load_document(CapsuleManifest, root / unit.capsule.path)
        images = Path(unit.capsule.path).parent / "images"
        for image in capsule.files:
            bind(FileRef(path=str(images / image.path), sha256=image.sha256, size_bytes=image.size_bytes), unit.unit_id)
        for worker in unit.workers:
            for ref in (worker.residual, worker.recovery_plan, worker.recovery_gap):
                bind(ref, unit.unit_id)
            if worker.payload is not None:
                packs[worker.payload.path] = worker.payload
                bound[worker.payload.path] = worker.payload.sha256
        log = f"logs/{unit.unit_id}.log"
        owner.setdefault(log, unit.unit_id)
    verify_files([(root / path, sha) for path, sha in sorted(bound.items())])  # raises naming a damaged file

    capsules: dict[str, list[Blob]] = {unit.unit_id: [] for unit in descriptor.units}
    configs = {unit.capsule.path for unit in descriptor.units}
    plain: list[Blob] = []
    for path in sorted(p for p in root.rglob("*") if p.is_file() or p.is_symlink()):
        relative = str(path.relative_to(root))
        if path.name.startswith(_SKIPPED_NAMES) or path.name.startswith(".") or relative == "artifact.json" \
                or relative in packs or relative in configs:
            continue
        if path.is_symlink():
            raise ValueError(f"{root}: {relative} is a symbolic link; an artifact to publish holds regular files only")
        blob = _blob(root, relative, bound.get(relative) or sha256_file(path))  # request, logs: nothing recorded
        unit_id = owner.get(relative, "")
        (capsules[unit_id] if unit_id else plain).append(blob)
    config = _blob(root, "artifact.json", sha256_digest((root / "artifact.json").read_bytes())[7:], DESCRIPTOR_CONFIG_TYPE)
    for unit in descriptor.units:
        capsules[unit.unit_id].insert(0, _blob(root, unit.capsule.path, unit.capsule.sha256, CAPSULE_CONFIG_TYPE))
    return _Plan(descriptor.artifact_id, [config, *plain], capsules,
                 [_blob(root, ref.path, ref.sha256, PACK_TYPE) for _, ref in sorted(packs.items())])


CHUNK_RECORD_NAME = ".coldsnap-chunks.json"
"""Beside a pack: its chunks' digests by chunk size, bound to the file's stat identity, so a second publish
(or one after a pull, which knows them) does not read the pack again. Never published (a dot file)."""


def _identity(path: Path) -> list[int]:
    status = path.stat()
    return [status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns]


def recorded_chunks(path: Path, chunk_bytes: int) -> tuple[Chunk, ...] | None:
    """The chunks recorded for ``path`` at this chunk size while the file is unchanged (None otherwise)."""
    try:
        entry = json.loads((path.parent / CHUNK_RECORD_NAME).read_text())[path.name]
        if entry["identity"] != _identity(path) or entry["chunk_bytes"] != chunk_bytes:
            return None
        return tuple(Chunk(int(o), str(d), int(n)) for o, d, n in entry["chunks"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def record_chunks(path: Path, chunk_bytes: int, chunks: tuple[Chunk, ...]) -> None:
    """Best effort: an artifact this user may not write is published all the same."""
    record = path.parent / CHUNK_RECORD_NAME
    try:
        try:
            entries = json.loads(record.read_text())
            entries = entries if isinstance(entries, dict) else {}
        except (OSError, ValueError):
            entries = {}
        entries[path.name] = {"identity": _identity(path), "chunk_bytes": chunk_bytes,
                              "chunks": [[c.offset, c.digest, c.size] for c in chunks]}
        write_atomic(record, json.dumps(entries, sort_keys=True).encode())
    except OSError:
        pass


def _chunk_digests(path: Path, size: int, chunk_bytes: int) -> tuple[Chunk, ...]:
    """The pack's chunks with their SHA-256s: recorded beside it, or hashed in parallel (hashlib lets go of the
    GIL) and recorded."""
    known = recorded_chunks(path, chunk_bytes)
    if known is not None:
        return known

    def digest(offset: int) -> Chunk:
        length = min(chunk_bytes, size - offset)
        hasher = hashlib.sha256()
        buffer = bytearray(min(8 << 20, length))
        view = memoryview(buffer)
        fd = os.open(path, os.O_RDONLY)
        try:
            position, left = offset, length
            while left:
                n = os.preadv(fd, [view[:min(left, len(buffer))]], position)
                if n <= 0:
                    raise ValueError(f"{path.name} got shorter while it was read")
                hasher.update(view[:n])
                position += n
                left -= n
        finally:
            os.close(fd)
        return Chunk(offset, "sha256:" + hasher.hexdigest(), length)

    with ThreadPoolExecutor(min(PARALLEL_BLOBS, max(1, -(-size // chunk_bytes))), thread_name_prefix="coldsnap-chunk") as pool:
        chunks = tuple(pool.map(digest, range(0, size, chunk_bytes)))
    record_chunks(path, chunk_bytes, chunks)
    return chunks


def publish(root: Path, reference: Reference, client: RegistryClient,
            on_progress: Callable[[int, int], None] | None = None, log: Callable[[str], None] = lambda _: None,
            chunk_bytes: int = CHUNK_BYTES) -> PublishResult:
    """Publish the artifact at ``root``; returns the index digest and what was sent."""
    started = time.monotonic()
    plan = _plan(root)
    plan.packs = [Blob(p.path, p.digest, p.size, p.mode, p.media_type, _chunk_digests(root / p.path, p.size, chunk_bytes))
                  for p in plan.packs]
    artifact_id = plan.artifact_id
    manifests: list[tuple[bytes, str, dict[str, str]]] = []
    descriptor_config, *descriptor_layers = plan.descriptor
    manifests.append((manifest_bytes(DESCRIPTOR_TYPE, descriptor_config, descriptor_layers,
                                     {"vnd.coldsnap.artifact.id": artifact_id}), DESCRIPTOR_TYPE, {}))
    for unit_id, unit_blobs in plan.capsules.items():
        manifests.append((manifest_bytes(CAPSULE_TYPE, unit_blobs[0], unit_blobs[1:], {"vnd.coldsnap.unit.id": unit_id}),
                          CAPSULE_TYPE, {"vnd.coldsnap.unit.id": unit_id}))
    for pack in plan.packs:
        manifests.append((chunked_pack_manifest_bytes(pack), PACK_TYPE, {"vnd.coldsnap.pack.sha256": pack.digest[7:]}))
    index = index_bytes(manifests, {"vnd.coldsnap.artifact.id": artifact_id})

    client.check()
    # every blob as (file, offset, size): a chunk is a piece of its pack's file
    blobs = {b.digest: (b.path, 0, b.size) for b in [*plan.descriptor, *(b for bs in plan.capsules.values() for b in bs)]}
    blobs.update({c.digest: (p.path, c.offset, c.size) for p in plan.packs for c in p.chunks})
    result = PublishResult(reference, sha256_digest(index), blobs=len(blobs),
                           bytes_total=sum(size for _, _, size in blobs.values()), packs=[p.digest for p in plan.packs])
    with ThreadPoolExecutor(PARALLEL_BLOBS, thread_name_prefix="coldsnap-publish") as pool:
        present = dict(zip(blobs, pool.map(client.blob_exists, blobs)))
        if not client.blob_exists(sha256_digest(EMPTY_CONFIG)):
            client.push_blob(sha256_digest(EMPTY_CONFIG), data=EMPTY_CONFIG)
        missing = [(d, *where) for d, where in blobs.items() if not present[d]]
        result.blobs_sent = len(missing)
        to_send = sum(size for _, _, _, size in missing)
        log(f"{len(blobs) - len(missing)} of {len(blobs)} blobs already in {reference.registry}; "
            f"sending {len(missing)} ({to_send / 1e9:.2f} GB)")
        sent = [0]
        lock = threading.Lock()

        def count(n: int) -> None:
            with lock:
                sent[0] += n
                if on_progress:
                    on_progress(sent[0], to_send)

        # the largest first, so one big file does not start last and run alone
        for future in [pool.submit(client.push_blob, digest, path=root / path, offset=offset, size=size, on_bytes=count)
                       for digest, path, offset, size in sorted(missing, key=lambda m: -m[3])]:
            future.result()
        result.bytes_sent = sent[0]
    for data, _, _ in manifests:
        if not client.manifest_exists(sha256_digest(data)):
            client.put_manifest(sha256_digest(data), data, MANIFEST_MEDIA_TYPE)
            result.manifests_sent += 1
    client.put_manifest(reference.tag or result.digest, index, INDEX_MEDIA_TYPE)
    result.reference = reference.with_digest(result.digest)
    result.seconds = time.monotonic() - started
    return result

"""``coldsnap publish DIR REF``: an artifact directory into a registry (layout: :mod:`coldsnap.registry`).

Nothing is sent that the registry has: every blob and manifest is asked for first by digest, so a
second publish of the same artifact (or of another capture that uses the same pack) sends only what
is new — at most the index. Every file is checked against the digest the descriptor or capsule binds
before it goes out (the validation records make that cheap), so a damaged artifact is never published.
"""

from __future__ import annotations

import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from coldsnap.contracts.artifact import ArtifactDescriptor, FileRef
from coldsnap.contracts.base import load_document
from coldsnap.contracts.capsule import CapsuleManifest
from coldsnap.payload.validation import VALIDATION_RECORD_NAME, sha256_file, verify_files
from coldsnap.registry.client import RegistryClient, sha256_digest
from coldsnap.registry.layout import (CAPSULE_TYPE, DESCRIPTOR_CONFIG_TYPE, CAPSULE_CONFIG_TYPE, DESCRIPTOR_TYPE,
                                      EMPTY_CONFIG, INDEX_MEDIA_TYPE, MANIFEST_MEDIA_TYPE, PACK_TYPE, Blob, index_bytes,
                                      manifest_bytes)
from coldsnap.registry.reference import Reference

__all__ = ["PublishResult", "publish"]

PARALLEL_BLOBS = 4
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
    kwargs = {"media_type": media_type} if media_type else {}
    return Blob(relative, "sha256:" + sha256, status.st_size, stat.S_IMODE(status.st_mode) & 0o777, **kwargs)


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


def publish(root: Path, reference: Reference, client: RegistryClient,
            on_progress: Callable[[int, int], None] | None = None, log: Callable[[str], None] = lambda _: None) -> PublishResult:
    """Publish the artifact at ``root``; returns the index digest and what was sent."""
    started = time.monotonic()
    plan = _plan(root)
    artifact_id = plan.artifact_id
    manifests: list[tuple[bytes, str, dict[str, str]]] = []
    descriptor_config, *descriptor_layers = plan.descriptor
    manifests.append((manifest_bytes(DESCRIPTOR_TYPE, descriptor_config, descriptor_layers,
                                     {"vnd.coldsnap.artifact.id": artifact_id}), DESCRIPTOR_TYPE, {}))
    for unit_id, unit_blobs in plan.capsules.items():
        manifests.append((manifest_bytes(CAPSULE_TYPE, unit_blobs[0], unit_blobs[1:], {"vnd.coldsnap.unit.id": unit_id}),
                          CAPSULE_TYPE, {"vnd.coldsnap.unit.id": unit_id}))
    for pack in plan.packs:
        manifests.append((manifest_bytes(PACK_TYPE, None, [pack], {}), PACK_TYPE, {"vnd.coldsnap.pack.sha256": pack.digest[7:]}))
    index = index_bytes(manifests, {"vnd.coldsnap.artifact.id": artifact_id})

    client.check()
    blobs = {b.digest: b for b in [*plan.descriptor, *(b for bs in plan.capsules.values() for b in bs), *plan.packs]}
    result = PublishResult(reference, sha256_digest(index), blobs=len(blobs),
                           bytes_total=sum(b.size for b in blobs.values()), packs=[p.digest for p in plan.packs])
    with ThreadPoolExecutor(PARALLEL_BLOBS, thread_name_prefix="coldsnap-publish") as pool:
        present = dict(zip(blobs, pool.map(client.blob_exists, blobs)))
        if not client.blob_exists(sha256_digest(EMPTY_CONFIG)):
            client.push_blob(sha256_digest(EMPTY_CONFIG), data=EMPTY_CONFIG)
        missing = [b for d, b in blobs.items() if not present[d]]
        result.blobs_sent = len(missing)
        to_send = sum(b.size for b in missing)
        log(f"{len(blobs) - len(missing)} of {len(blobs)} blobs already in {reference.registry}; "
            f"sending {len(missing)} ({to_send / 1e9:.2f} GB)")
        sent = [0]
        lock = threading.Lock()

        def count(n: int) -> None:
            with lock:
                sent[0] += n
                if on_progress:
                    on_progress(sent[0], to_send)

        # the largest first, so one big pack does not start last and run alone
        for future in [pool.submit(client.push_blob, b.digest, path=root / b.path, size=b.size, on_bytes=count)
                       for b in sorted(missing, key=lambda b: -b.size)]:
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

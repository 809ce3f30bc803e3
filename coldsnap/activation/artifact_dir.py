"""The artifact directory: where a capture's pieces live, and how they are committed.

    DIR/artifact.json              descriptor (format 9), written last and atomically: the commit
    DIR/request.json               the resolved capture request (canonical JSON)
    DIR/payload/<sha256>.pack      native payload, and <sha256>.residual
    DIR/units/<unit>/images/       CRIU images of the unit's process tree
    DIR/units/<unit>/capsule.json  the images' manifest (name, size, SHA-256) + activation metadata
    DIR/logs/<unit>.log            the serving process's output up to the capture
    DIR/logs/<unit>-reference.log  the capture's plain reference start(s) of the same command

Without ``artifact.json`` nothing in DIR is an artifact: a failed capture leaves no descriptor, and a
capture refuses a DIR that already has one.

A restore writes nothing into DIR, so an artifact can ship read-only (an image layer, NFS) and move or
be copied: what a restore writes lives in its state directory (:func:`state_dir`),

    STATE/<artifact id>/port-<P>/logs/<unit>.log   the replica serving on P: its output (the captured
                                                   log, then its own)
    STATE/<artifact id>/port-<P>/criu/             its CRIU restore logs, stats and pidfile
    STATE/<artifact id>/port-<P>/images/           its copy of the images (links; files.img rewritten)
    STATE/<artifact id>/standby.json               the artifact's warm standby, if any
    STATE/<artifact id>/records/...                validation records of the artifact's files, where the
                                                   artifact's own no longer match (a moved or copied artifact)
    STATE/records/external/<folder id>/            validation records of pinned files outside artifacts (recovery
                                                   safetensors), written by the capture that pinned them

where STATE is ``--state-dir`` / ``COLDSNAP_STATE_DIR``, else ``$XDG_RUNTIME_DIR/coldsnap``, else
``/run/coldsnap`` (root), else ``/tmp/coldsnap-<uid>``, and the artifact id is the start of the SHA-256
of ``artifact.json`` (the same for a moved or copied artifact).

With an owner (:mod:`coldsnap.ownership`), a capture claims its directory (:meth:`ArtifactDir.claim`) and
every operation what it writes under STATE (:func:`claim_state`, a replica's folder where it is made): the
operation hands them over when it ends.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from coldsnap.activation.restore_inputs import unit_capsule, unit_images
from coldsnap.activation.state import STANDBY_RECORD, artifact_id
from coldsnap.atomic import write_atomic
from coldsnap.contracts.artifact import ArtifactDescriptor, FileRef
from coldsnap.contracts.base import load_document
from coldsnap.contracts.capsule import CAPSULE_FORMAT, ActivationMetadata, CapsuleFile, CapsuleManifest
from coldsnap.contracts.canonical import canonical_json
from coldsnap.host import state_root
from coldsnap.ownership import HandOver
from coldsnap.payload.records import VALIDATION_RECORD_NAME
from coldsnap.payload.validation import hash_and_record, sha256_file
from coldsnap.snapshot.criu_binary import CHECK_CACHE
from coldsnap.snapshot.cuda_checkpoint import PROBE_CACHE
from coldsnap.snapshot.thp import RECORD_FILES as THP_RECORD_FILES

__all__ = ["ArtifactDir", "claim_state", "external_record_dir", "file_ref"]



DESCRIPTOR = "artifact.json"
PENDING_DESCRIPTOR = "artifact.pending.json"
"""A capture's descriptor while the capture's own restore checks it (:meth:`ArtifactDir.pending`)."""


class ArtifactDir:
    def __init__(self, root: Path, descriptor: str = DESCRIPTOR):
        self.root = root
        self._descriptor = descriptor
        self._state_dir: Path | None = None

    descriptor_path = property(lambda self: self.root / self._descriptor)

    def pending(self) -> "ArtifactDir":
        """This directory seen through its pending descriptor: an artifact only the capture's check
        restores (same bytes, same artifact id); :meth:`promote` commits it."""
        return ArtifactDir(self.root, PENDING_DESCRIPTOR)

    def promote(self, pending: "ArtifactDir") -> None:
        """Commit the checked pending descriptor: one rename, atomic."""
        os.replace(pending.descriptor_path, self.descriptor_path)
    request_path = property(lambda self: self.root / "request.json")
    payload_dir = property(lambda self: self.root / "payload")

    def unit_dir(self, unit_id: str) -> Path:
        return self.root / "units" / unit_id

    def images(self, unit_id: str) -> Path:
        return unit_images(self.root, unit_id)

    def capsule_path(self, unit_id: str) -> Path:
        return unit_capsule(self.root, unit_id)

    def log_path(self, unit_id: str) -> Path:
        return self.root / "logs" / f"{unit_id}.log"

    def reference_log_path(self, unit_id: str) -> Path:
        """The output of the capture's plain reference start(s) (:mod:`coldsnap.activation.reference_check`)."""
        return self.root / "logs" / f"{unit_id}-reference.log"

    def claim(self, hand_over: HandOver) -> None:
        """What a capture writes here, for its owner: the directory with everything in it when the capture
        makes it (and the folders above it it makes), else exactly the layout's paths above — a directory
        it found may hold what is not the capture's to give away. Never for a committed artifact."""
        hand_over.claim_new(self.root)
        for name in (DESCRIPTOR, PENDING_DESCRIPTOR, "request.json", "payload", "units", "logs"):
            hand_over.claim(self.root / name)

    def state_path(self) -> Path:
        """Where :meth:`state_dir` is (OSError when no descriptor is committed); nothing is made."""
        return self._state_dir or state_root() / artifact_id(self.root, self._descriptor)

    def state_dir(self) -> Path:
        """This artifact's state directory (created once): where its restores write."""
        if self._state_dir is None:
            path = self.state_path()
            path.mkdir(parents=True, exist_ok=True, mode=0o700)
            self._state_dir = path
        return self._state_dir

    def record_dir(self, path: Path) -> Path | None:
        """Where a restore keeps the validation record of ``path`` (a file in this artifact), or None
        when the state directory cannot be made (verification then hashes unrecorded files in full)."""
        return self._records(self.relative(path.parent))

    def _records(self, folder: str) -> Path | None:
        try:
            directory = self.state_dir() / "records" / folder
            directory.mkdir(parents=True, exist_ok=True)
            return directory
        except OSError:
            return None

    def committed(self) -> bool:
        return self.descriptor_path.exists()

    def clear_uncommitted(self, unit_ids: list[str]) -> None:
        """Remove what a failed earlier capture left (never anything of a committed artifact)."""
        assert not self.committed()
        for unit_id in unit_ids:
            shutil.rmtree(self.unit_dir(unit_id), ignore_errors=True)

    def entries(self) -> set[str]:
        """Names directly in the artifact directory now (empty when it does not exist)."""
        try:
            return {p.name for p in self.root.iterdir()}
        except FileNotFoundError:
            return set()

    def remove_created(self, before: set[str] | None) -> None:
        """After a failed capture: remove what it created — every entry not in ``before`` (the names
        there when it started), and the directory itself when it did not exist (``before`` None).
        Never anything of a committed artifact."""
        assert not self.committed()
        for name in self.entries() - (before or set()):
            path = self.root / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        if before is None:
            try:
                self.root.rmdir()
            except OSError:
                pass  # something appeared there meanwhile: not ours to remove

    def external_record_dir(self, path: Path, hand_over: HandOver | None = None) -> Path | None:
        """Where restores keep the validation record of ``path``, a file outside the artifact (a pinned
        recovery safetensors): :func:`external_record_dir`."""
        return external_record_dir(path, hand_over)

    def relative(self, path: Path) -> str:
        return str(path.resolve().relative_to(self.root.resolve()))

    def write_capsule(self, unit_id: str, metadata: ActivationMetadata) -> FileRef:
        """Manifest every image file with its SHA-256, plus activation metadata; returns its FileRef. Each
        digest is also recorded in the images' validation record, so restore admission verifies every
        image against the capsule without hashing them again while they are unchanged; and the manifest's
        own in its folder's, so that a restore's entry can start CRIU on the first restore after the
        capture too (:mod:`coldsnap.activation.early_restore`: it trusts records, never hashes)."""
        images = self.images(unit_id)
        files = [
            CapsuleFile(path=str(p.relative_to(images)), size_bytes=p.stat().st_size, sha256=hash_and_record(p))
            for p in sorted(images.rglob("*"))
            # restore logs and pidfiles come later; validation records are not images
            if p.is_file() and not p.name.startswith(("restore", VALIDATION_RECORD_NAME))
        ]
        manifest = CapsuleManifest(format=CAPSULE_FORMAT, unit_id=unit_id, files=files, metadata=metadata)
        path = self.capsule_path(unit_id)
        write_atomic(path, manifest.canonical_json() + b"\n")
        return file_ref(self, path, hash_and_record(path))

    def read_capsule(self, unit_id: str) -> CapsuleManifest:
        """The unit's capsule manifest, strictly decoded (raises ContractError, naming the problem)."""
        return load_document(CapsuleManifest, self.capsule_path(unit_id))

    def commit(self, descriptor: ArtifactDescriptor) -> None:
        write_atomic(self.descriptor_path, canonical_json(descriptor.to_json_value()) + b"\n")

    def load(self) -> ArtifactDescriptor:
        return load_document(ArtifactDescriptor, self.descriptor_path)


def external_record_dir(path: Path, hand_over: HandOver | None = None) -> Path | None:
    """Where this host keeps the validation record of ``path``, a file outside any artifact (a pinned
    recovery safetensors): ``STATE/records/external/<its folder's id>/``, shared by every artifact that pins
    it — the capture that pinned it records its hash there, so a restore's first recovery does not hash
    the model again (15.7 s for the 8B shape's 15 GB on the H200). None when it cannot be made.
    ``hand_over``: the operation's, which claims the folder (and those above it it makes)."""
    try:
        directory = state_root() / "records" / "external" / hashlib.sha256(str(path.parent).encode()).hexdigest()[:16]
        if hand_over is not None:
            hand_over.claim_new(directory)
            hand_over.claim(directory)
        directory.mkdir(parents=True, exist_ok=True)
        return directory
    except OSError:
        return None


def file_ref(artifact: ArtifactDir, path: Path, sha256: str | None = None) -> FileRef:
    return FileRef(path=artifact.relative(path), sha256=sha256 or sha256_file(path), size_bytes=path.stat().st_size)


def claim_state(hand_over: HandOver, artifact: ArtifactDir | None = None) -> None:
    """Claim what an operation may write under STATE, for its owner (:mod:`coldsnap.ownership`): STATE
    itself (and the folders above it) when it makes it, the host facts it writes there (``criu check``'s
    verdict, the CUDA probe, the host THP record), and of ``artifact`` (when it has a descriptor): its
    state directory when the operation makes it, its validation records and its standby record. A
    replica's own folder is claimed where it is made (``RestoreSequence.state_dir``)."""
    root = state_root()
    hand_over.claim_new(root)
    for name in (CHECK_CACHE, PROBE_CACHE, *THP_RECORD_FILES):
        hand_over.claim_written(root / name)
    if artifact is None:
        return
    try:
        state = artifact.state_path()
    except OSError:
        return  # no descriptor: admission refuses it before anything is written there
    hand_over.claim_new(state)
    hand_over.claim(state / "records")
    hand_over.claim_written(state / STANDBY_RECORD)

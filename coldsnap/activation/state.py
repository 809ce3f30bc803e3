"""Where restores keep what they write, and an artifact's identity there (standard library only: the
program's entry reads them before anything else is imported, see :mod:`coldsnap.activation.early_wake`).

STATE is ``--state-dir`` / ``COLDSNAP_STATE_DIR``, else ``$XDG_RUNTIME_DIR/coldsnap``, else
``/run/coldsnap`` (root), else ``/tmp/coldsnap-<uid>``; an artifact's state lives in
``STATE/<artifact id>/``, the id being the start of the SHA-256 of its ``artifact.json`` (the same for a
moved or copied artifact).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from coldsnap.host import state_root

__all__ = ["STANDBY_RECORD", "artifact_id", "forget_removed_artifacts", "standby_record_file"]

STANDBY_RECORD = "standby.json"
"""A warm standby's record in its artifact's state directory (:mod:`coldsnap.activation.standby`)."""


def host_cache_dir() -> Path | None:
    """Where restores keep this boot's host facts (a passing ``criu check`` verdict, the GPUs the CUDA
    probe found): the state root, made if needed; None when it cannot be made (each restore then asks
    afresh)."""
    try:
        root = state_root()
        root.mkdir(parents=True, exist_ok=True)
        return root
    except OSError:
        return None


def artifact_id(root: Path, descriptor: str = "artifact.json") -> str:
    """The id of the artifact committed in ``root`` (OSError when it has none); ``descriptor``: the
    descriptor's name there (a capture's check restore reads the pending one, the same bytes)."""
    return hashlib.sha256((root / descriptor).read_bytes()).hexdigest()[:16]


def standby_record_file(target: str, root: Path | None = None) -> Path:
    """Where the standby record that ``coldsnap wake TARGET`` means is: an artifact directory's, else
    the standby id's (a state directory's name), under ``root`` (default :func:`state_root`)."""
    given = Path(target)
    identity = artifact_id(given) if (given / "artifact.json").exists() else target
    return (root or state_root()) / identity / STANDBY_RECORD


def _artifact_gone(state: Path) -> bool:
    """Whether the artifact ``state`` belongs to is gone: its replicas' image folders link into the
    artifact's capsule images (:func:`coldsnap.snapshot.moved_sockets.replica_images`), and those links dangle."""
    linked = False
    for link in state.glob("port-*/images/*"):
        if link.is_symlink():
            if link.exists():  # one live link: the artifact (or a copy of it, the same id) is still there
                return False
            linked = True
    return linked


def forget_removed_artifacts(root: Path | None = None) -> list[str]:
    """Remove the state folders (restore logs, CRIU's files, per-restore images) of artifacts that no longer
    exist, so a host that restores all day, artifact after artifact, keeps only what can still be used. A
    folder holding a standby record is kept (the standby's own deadline removes it). Returns the ids removed;
    never raises (a folder it cannot read or remove stays for the next restore)."""
    removed: list[str] = []
    try:
        entries = list((root or state_root()).iterdir())
    except OSError:
        return removed
    for state in entries:
        try:
            if (re.fullmatch(r"[0-9a-f]{16}", state.name) and state.is_dir() and not (state / STANDBY_RECORD).exists()
                    and _artifact_gone(state)):
                import shutil  # (here only: a restore's entry imports this module)

                shutil.rmtree(state)
                removed.append(state.name)
        except OSError:
            continue
    return removed

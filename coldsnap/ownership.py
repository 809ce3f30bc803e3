"""Files owned by the caller: coldsnap runs as root (CRIU, CUDA checkpoint and the restored namespaces need
it), yet what an operation writes under an artifact directory or a state root ends owned by the user who
asked for it, mode bits kept (docs/design.md, "Ownership").

The owner is, in order: ``--owner UID:GID`` (:func:`parse_owner`), the request's ``owner`` field, the
caller's ``SUDO_UID``/``SUDO_GID`` when coldsnap runs as root through sudo; with none of them nothing is
handed over (:func:`resolve_owner`).

An operation *claims* what it is about to write (:class:`HandOver`: the exact coldsnap-managed paths, and
the directories it is about to create) and everything claimed is handed over when the operation ends,
however it ends (:mod:`coldsnap.operation` applies it in its ``finally``). A command outside the operation
envelope (publish, pull) does the same with its own :class:`HandOver`, or calls :func:`hand_over`.

The walk (:func:`hand_over`) changes owners only, never modes, and never leaves the claimed trees: every
directory is opened with ``O_NOFOLLOW`` relative to its parent's descriptor, a symlink gets ``lchown``
(its target is not touched), a regular file is changed through its own descriptor, and a regular file
with more than one hard link is left as it is (its other name may be anywhere). A directory is handed
over after its entries, so its new owner cannot change it while the walk is inside. Linux clears a
regular file's setuid/setgid bits when its owner changes: they are put back.

Validation records (``.coldsnap-validation.json``) bind a file's ``ctime``, which a change of owner moves:
the entries that vouched for a file before are carried over to it afterwards
(:func:`coldsnap.payload.validation.carry_records_over`), so the first restore of a handed-over capture
does not hash its packs and images again.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

__all__ = ["FLAG_SOURCE", "REQUEST_SOURCE", "SUDO_SOURCE", "HandOver", "HandOverReport", "Owner", "OwnerError",
           "hand_over", "parse_owner", "resolve_owner"]

FLAG_SOURCE = "--owner"
REQUEST_SOURCE = "the request's owner"
SUDO_SOURCE = "SUDO_UID:SUDO_GID"
MAX_ID = 2**32 - 2
"""The largest uid or gid: chown(2) reads ``(uid_t) -1`` as "leave it as it is"."""

_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_REGULAR = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


class OwnerError(ValueError):
    """An owner that is malformed or cannot be given; the message is one line naming where it came from."""


@dataclass(frozen=True)
class Owner:
    """Who gets the files: numeric ids (a manager resolves its user; a container may know no names)."""

    uid: int
    gid: int
    source: str = FLAG_SOURCE
    """Where it came from (``--owner``, the request, sudo): for messages."""

    def __str__(self) -> str:
        return f"{self.uid}:{self.gid}"


def parse_owner(text: str, source: str = FLAG_SOURCE) -> Owner:
    """``UID:GID`` (numeric, each 0 .. 4294967294) → :class:`Owner`; else :class:`OwnerError`."""
    uid, separator, gid = text.partition(":")
    if not separator or not uid.isascii() or not gid.isascii() or not uid.isdigit() or not gid.isdigit():
        raise OwnerError(f"{source} {text!r}: expected numeric UID:GID, e.g. 1000:1000")
    owner = Owner(int(uid), int(gid), source)
    if owner.uid > MAX_ID or owner.gid > MAX_ID:
        raise OwnerError(f"{source} {text!r}: a uid or gid is at most {MAX_ID}")
    return owner


def resolve_owner(flag: Owner | str | None = None, requested: tuple[int, int] | None = None,
                  environ: Mapping[str, str] | None = None, euid: int | None = None) -> Owner | None:
    """The owner an operation hands its files to: ``flag`` (``--owner``, parsed or not), else ``requested``
    (the request's ``owner``), else ``SUDO_UID``/``SUDO_GID`` of ``environ`` (default the process's) when
    running as root; None when none of them says. :class:`OwnerError` for a malformed one, and for an
    owner that is not this process's own user when it is not root (only root may give files away).
    ``euid``: the effective uid to judge that by (default this process's)."""
    euid = os.geteuid() if euid is None else euid
    environ = os.environ if environ is None else environ
    if flag is not None:
        owner = parse_owner(flag) if isinstance(flag, str) else flag
    elif requested is not None:
        owner = Owner(requested[0], requested[1], REQUEST_SOURCE)
    else:
        uid, gid = environ.get("SUDO_UID"), environ.get("SUDO_GID")
        if (uid is None and gid is None) or euid != 0:  # `sudo -u someone`: what it writes is theirs already
            return None
        if uid is None or gid is None:
            raise OwnerError(f"{SUDO_SOURCE}: only {'SUDO_UID' if gid is None else 'SUDO_GID'} is set; set both, "
                             "or pass --owner UID:GID")
        owner = parse_owner(f"{uid}:{gid}", SUDO_SOURCE)
    if euid != 0 and not (owner.uid == euid and (owner.gid == os.getegid() or owner.gid in os.getgroups())):
        raise OwnerError(f"{owner.source} {owner}: handing files to another user needs root (this runs as uid {euid})")
    return owner


@dataclass
class HandOverReport:
    """What :func:`hand_over` did."""

    owner: Owner
    changed: int = 0
    """Entries whose owner changed (the others were the owner's already)."""
    linked: list[str] = field(default_factory=list)
    """Regular files left as they were: more than one hard link."""
    failed: list[str] = field(default_factory=list)
    """``path: reason`` of every entry that could not be handed over."""

    def warnings(self) -> list[str]:
        """One line for each kind of shortfall (for a receipt's warnings)."""
        found = []
        if self.failed:
            more = f" (and {len(self.failed) - 1} more)" if len(self.failed) > 1 else ""
            found.append(f"could not hand {len(self.failed)} path(s) to {self.owner} ({self.owner.source}): "
                         f"{self.failed[0]}{more}")
        if self.linked:
            more = f" (and {len(self.linked) - 1} more)" if len(self.linked) > 1 else ""
            found.append(f"left {len(self.linked)} file(s) with more than one hard link as they were, not given to "
                         f"{self.owner} (a link elsewhere would change owner too): {self.linked[0]}{more}")
        return found


def hand_over(paths: Iterable[str | Path], owner: Owner) -> HandOverReport:
    """Give each of ``paths`` and, for a directory, everything under it to ``owner``, keeping every mode bit
    (see the module's description of the walk). A path that does not exist is skipped; a path inside
    another one given is walked once. Never raises for an entry: what failed is in the report."""
    report = HandOverReport(owner)
    for path in _outermost(paths):
        try:
            parent = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        except OSError as exc:
            report.failed.append(f"{path.parent}: {exc.strerror or exc}")
            continue
        try:
            _entry(parent, path.name, path, owner, report)
        finally:
            os.close(parent)
    return report


def _outermost(paths: Iterable[str | Path]) -> list[Path]:
    """The absolute forms of ``paths`` with those inside another one left out (each tree is walked once)."""
    found: list[Path] = []
    for path in sorted({Path(os.path.abspath(p)) for p in paths}, key=lambda p: len(p.parts)):
        if path.parent != path and not any(path.is_relative_to(kept) for kept in found):
            found.append(path)
    return found


def _entry(dir_fd: int, name: str, shown: Path, owner: Owner, report: HandOverReport) -> os.stat_result | None:
    """Hand ``name`` (in the directory ``dir_fd``) over; returns a regular file's status before, when its
    owner changed (for :func:`carry_records_over`)."""
    try:
        status = os.lstat(name, dir_fd=dir_fd)
        if stat.S_ISDIR(status.st_mode):
            fd = os.open(name, _DIRECTORY, dir_fd=dir_fd)  # (ELOOP / ENOTDIR: swapped for a link meanwhile)
            try:
                _directory(fd, shown, owner, report)
            finally:
                os.close(fd)
        elif stat.S_ISREG(status.st_mode):
            if (status.st_uid, status.st_gid) == (owner.uid, owner.gid):
                return None
            if status.st_nlink > 1:
                report.linked.append(str(shown))
                return None
            fd = os.open(name, _REGULAR, dir_fd=dir_fd)
            try:
                before = os.fstat(fd)
                if (before.st_dev, before.st_ino) != (status.st_dev, status.st_ino) or before.st_nlink > 1:
                    report.failed.append(f"{shown}: replaced while it was handed over")
                    return None
                return before if _give(fd, before, owner, report) else None
            finally:
                os.close(fd)
        elif (status.st_uid, status.st_gid) != (owner.uid, owner.gid):  # a symlink (not followed), socket, fifo
            os.chown(name, owner.uid, owner.gid, dir_fd=dir_fd, follow_symlinks=False)
            report.changed += 1
    except FileNotFoundError:
        pass  # removed meanwhile (a replica's socket, a rotated log)
    except OSError as exc:
        report.failed.append(f"{shown}: {exc.strerror or exc}")
    return None


def _directory(fd: int, shown: Path, owner: Owner, report: HandOverReport) -> None:
    """The directory ``fd``: its entries first, then itself."""
    from coldsnap.payload.records import VALIDATION_RECORD_NAME
    from coldsnap.payload.validation import carry_records_over

    with os.scandir(fd) as scan:
        names = sorted(entry.name for entry in scan)
    changed: dict[str, os.stat_result] = {}
    for name in names:
        before = _entry(fd, name, shown / name, owner, report)
        if before is not None:
            changed[name] = before
    if VALIDATION_RECORD_NAME in names and changed:
        # (the directory through its descriptor: the walk never follows a path again)
        if carry_records_over(Path(f"/proc/self/fd/{fd}"), changed):
            for name in (VALIDATION_RECORD_NAME, VALIDATION_RECORD_NAME + ".lock"):  # rewritten by root just now
                _entry(fd, name, shown / name, owner, report)
    _give(fd, os.fstat(fd), owner, report)


def _give(fd: int, before: os.stat_result, owner: Owner, report: HandOverReport) -> bool:
    """``fchown`` with the mode bits put back (Linux drops a regular file's setuid/setgid on chown)."""
    if (before.st_uid, before.st_gid) == (owner.uid, owner.gid):
        return False
    os.fchown(fd, owner.uid, owner.gid)
    mode = stat.S_IMODE(before.st_mode)
    if stat.S_IMODE(os.fstat(fd).st_mode) != mode:
        os.fchmod(fd, mode)
    report.changed += 1
    return True


class HandOver:
    """What one operation writes that goes to its owner: claimed while it runs — before it is made, so a
    failure half-way is covered — and handed over when it ends (:meth:`apply`). With no owner it claims
    nothing and hands nothing over (coldsnap's behaviour without ``--owner``, a request owner or sudo)."""

    def __init__(self, owner: Owner | None):
        self.owner = owner
        self._claimed: dict[Path, None] = {}  # (ordered, no repeats)
        self._written: dict[Path, tuple[int, int, int, int] | None] = {}  # file → its identity when claimed

    @property
    def claimed(self) -> list[Path]:
        return list(self._claimed)

    def claim(self, path: str | Path) -> None:
        """``path`` and, if it is a directory, everything in it when the operation ends."""
        if self.owner is not None:
            self._claimed[Path(os.path.abspath(path))] = None

    def claim_written(self, path: str | Path) -> None:
        """The file ``path`` if the operation writes it: made, replaced or changed by the time it ends (a host
        fact in the state root that another operation wrote and this one only read stays as it is)."""
        if self.owner is not None:
            path = Path(os.path.abspath(path))
            self._written.setdefault(path, _file_identity(path))

    def claim_new(self, path: str | Path) -> None:
        """What making ``path`` (``mkdir(parents=True)``) creates: the topmost of it and its ancestors that
        do not exist now, with everything that will be under it. Nothing when ``path`` exists: a directory
        the operation found is not its to give away (claim the exact paths it writes there)."""
        if self.owner is None:
            return
        missing, probe = None, Path(os.path.abspath(path))
        while not os.path.lexists(probe) and probe.parent != probe:
            missing, probe = probe, probe.parent
        if missing is not None:
            self.claim(missing)

    def apply(self) -> HandOverReport | None:
        """Hand everything claimed over (None when there is no owner)."""
        if self.owner is None:
            return None
        written = [path for path, before in self._written.items() if _file_identity(path) not in (before, None)]
        return hand_over([*self._claimed, *written], self.owner)


def _file_identity(path: Path) -> tuple[int, int, int, int] | None:
    """What changes when a file is made, replaced or written: device, inode, size, mtime (None: absent)."""
    try:
        status = os.lstat(path)
    except OSError:
        return None
    return status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns

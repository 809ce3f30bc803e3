"""What a process tree holds outside its memory, read from /proc: its pids, the files it writes to,
and its POSIX shared memory. CRIU restores all of it, but three things need help to restore more
than once from one image (measured on vLLM; docs/design.md):

- files in ``/dev/shm`` (vLLM's POSIX semaphores) and the ``link_remap`` files CRIU creates there for
  unlinked ones are consumed by a restore: they are saved with the image and put back before each;
- a log file the restored process appended to no longer has the size CRIU recorded ("bad size"):
  what was appended is moved aside and the file is cut back to its size at dump time;
- restore reuses the captured pids: it waits until the previous incarnation's pids are gone.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

from coldsnap.atomic import write_atomic
from coldsnap.host import PF_EXITING, stat_fields
from coldsnap.snapshot.shm import SHM_PATH, copy_sparse, restore_shm

SHM_DIR = Path(SHM_PATH)

__all__ = ["SHM_DIR", "group_members", "TreeFiles", "ImageStateError", "tree_pids", "kill_tree", "bound_socket_files", "remove_socket_files", "socket_files_in", "anonymous_bytes", "resident_bytes", "TcpConnection", "TcpConnections", "tcp_connections", "capture_tree_files", "file_sizes", "prepare_restore", "namespace_pid", "inherited_files",
           "STATE_FILE"]

STATE_FILE = "coldsnap-tree-files.json"
_WRITE_MODES = os.O_WRONLY | os.O_RDWR


class ImageStateError(RuntimeError):
    """The host is not in a state the image can be restored into (pids taken, a file shrank...)."""


def _process_stats() -> Iterator[tuple[int, list[bytes]]]:
    """Every process (threads excluded) with its :func:`~coldsnap.host.stat_fields`; processes that exit
    meanwhile are skipped."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = stat_fields(entry)
        except OSError:  # exited meanwhile
            continue
        yield int(entry), fields


def tree_pids(root: int) -> list[int]:
    """``root`` and all its descendants (threads excluded), parents before children."""
    children: dict[int, list[int]] = {}
    for pid, fields in _process_stats():
        children.setdefault(int(fields[1]), []).append(pid)
    if not os.path.exists(f"/proc/{root}"):
        return []
    order, queue = [], [root]
    while queue:
        pid = queue.pop(0)
        order.append(pid)
        queue.extend(sorted(children.get(pid, [])))
    return order


def kill_tree(root: int, timeout: float = 10.0) -> None:
    """SIGKILL the tree's process group (orphans too) and every descendant; wait until they are gone,
    then remove the socket files they had bound (:func:`bound_socket_files`: a SIGKILLed vLLM leaves its
    ZeroMQ ``ipc://`` files in /tmp, and a host that restores all day would keep every one). The tree and
    the group are listed before the kill: once the root dies its children are init's and no longer in
    its tree, and returning while one of them is still exiting would leave it behind."""
    pids = set(tree_pids(root)) | set(group_members(root))
    socket_files = bound_socket_files(pids)
    try:
        _kill_and_wait(root, pids, timeout)
    finally:
        remove_socket_files(socket_files)


def _fd_targets(pid: int) -> Iterator[tuple[str, str]]:
    """``(fd, what it points at)`` for each open descriptor of ``pid`` (none once it is gone)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return
    for fd in fds:
        try:
            yield fd, os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue


def bound_socket_files(pids: set[int] | list[int]) -> list[Path]:
    """The files of the unix sockets that ``pids`` hold bound to a path (or accepted on one); not the
    sockets they connected to elsewhere (a client's end has no name). From ``/proc/PID/fd`` and
    ``/proc/net/unix`` (this network namespace's)."""
    inodes = {target[8:-1] for pid in pids for _, target in _fd_targets(pid) if target.startswith("socket:[")}
    if not inodes:
        return []
    try:
        lines = Path("/proc/net/unix").read_text(errors="surrogateescape").splitlines()[1:]
    except OSError:
        return []
    paths = set()
    for line in lines:  # Num RefCount Protocol Flags Type St Inode Path
        fields = line.split(None, 7)
        if len(fields) == 8 and fields[7].startswith("/") and fields[6] in inodes:
            paths.add(Path(fields[7]))
    return sorted(paths)


def remove_socket_files(paths: list[Path]) -> None:
    """Unlink each of ``paths`` that is still a socket file (once its processes are gone nothing else can
    have bound it: a bind fails on an existing file)."""
    for path in paths:
        try:
            if stat.S_ISSOCK(path.lstat().st_mode):
                path.unlink()
        except OSError:
            pass


def socket_files_in(directory: Path) -> set[Path]:
    """The socket files directly in ``directory`` (an engine's temporary folder)."""
    try:
        return {entry for entry in directory.iterdir() if stat.S_ISSOCK(entry.lstat().st_mode)}
    except OSError:
        return set()


def _kill_and_wait(root: int, pids: set[int], timeout: float) -> None:
    try:
        os.killpg(root, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for pid in sorted(pids, reverse=True):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = []
        for pid in pids | set(group_members(root)):
            try:
                os.waitpid(pid, os.WNOHANG)  # reap our own children; others are init's
            except ChildProcessError:
                pass
            if not _gone(pid):
                alive.append(pid)
        if not alive:
            return
        time.sleep(0.02)


def group_members(pgid: int, exiting: bool = True) -> list[int]:
    """Processes (zombies left out) whose process group is ``pgid``, sorted; without ``exiting``, also
    those already in ``do_exit`` (SIGKILLed: they never run user code again, but still hold memory)."""
    return sorted(pid for pid, fields in _process_stats()
                  if int(fields[2]) == pgid and fields[0] not in (b"Z", b"X")
                  and (exiting or not int(fields[6]) & PF_EXITING))


def _gone(pid: int) -> bool:
    """Whether ``pid`` has released everything: no process, or a zombie whose other threads have exited
    too. (A multithreaded process's leader shows ``Z`` while its other threads are still exiting and its
    files — a listening socket — still open; only its parent's wait would say when they are done.)"""
    if not os.path.exists(f"/proc/{pid}"):
        return True
    if not _is_zombie(pid):
        return False
    try:
        return len(os.listdir(f"/proc/{pid}/task")) <= 1
    except OSError:
        return True


def _is_zombie(pid: int) -> bool:
    try:
        return stat_fields(pid)[0] == b"Z"
    except OSError:
        return False


def _fdinfo(pid: int, fd: str) -> dict[str, str]:
    """``/proc/PID/fdinfo/FD`` as field → value (``flags`` in octal, ``mnt_id``, ``pos``...)."""
    with open(f"/proc/{pid}/fdinfo/{fd}") as handle:
        return {name: value.strip() for name, _, value in (line.partition(":") for line in handle)}


@dataclass
class TreeFiles:
    """What :func:`prepare_restore` needs, stored next to the CRIU images."""

    pids: list[int]
    appended: dict[str, int] = field(default_factory=dict)  # path -> size at dump time
    shm: list[str] = field(default_factory=list)  # names under /dev/shm, saved in IMAGES/devshm/
    external: dict[str, dict[str, Any]] = field(default_factory=dict)
    """CRIU key (``file[mnt_id:inode]``) → {"path": relative to the artifact, "size": at dump} of every
    file inside the artifact the tree had open for writing (the engine's log): dumped as external, so a
    restore hands the tree a file of its own instead of writing into the artifact (:func:`inherited_files`)."""
    external_netns: bool = False
    """The tree ran in a network namespace other than the dumping process's (a launch unit on a host of its
    own): dumped as external, a restore puts it into the restoring process's network namespace."""

    def save(self, images: Path) -> None:
        write_atomic(images / STATE_FILE, (json.dumps(asdict(self), indent=1, sort_keys=True) + "\n").encode())

    @classmethod
    def load(cls, images: Path) -> "TreeFiles":
        try:
            return cls(**json.loads((images / STATE_FILE).read_text()))
        except (OSError, ValueError, TypeError) as exc:
            raise ImageStateError(f"{images}: no readable {STATE_FILE} ({exc})") from None


def scan_tree(root: int, keys: dict[str, str] | None = None) -> tuple[list[int], dict[str, int], set[str]]:
    """Pids, regular files open for writing (with their sizes) and /dev/shm names of a live tree;
    ``keys``, when given, receives each written file's CRIU key (path → key)."""
    pids = tree_pids(root)
    written: dict[str, int] = {}
    shm: set[str] = set()
    for pid in pids:
        for fd, target in _fd_targets(pid):
            if target.startswith(f"{SHM_DIR}/"):
                shm.add(target[len(str(SHM_DIR)) + 1:].removesuffix(" (deleted)"))
                continue
            if not target.startswith("/") or target.endswith(" (deleted)"):
                continue
            try:
                info = os.stat(f"/proc/{pid}/fd/{fd}")
                if not stat.S_ISREG(info.st_mode):
                    continue
                fields = _fdinfo(pid, fd)
                if int(fields.get("flags", "0"), 8) & _WRITE_MODES:
                    written[target] = info.st_size
                    if keys is not None:  # CRIU's name for the file (--external / --inherit-fd)
                        keys[target] = f"file[{int(fields['mnt_id']):x}:{info.st_ino:x}]"
            except OSError:
                continue
        try:
            with open(f"/proc/{pid}/maps") as handle:
                for line in handle:
                    parts = line.split(maxsplit=5)
                    path = parts[5].strip() if len(parts) == 6 else ""
                    if path.startswith(f"{SHM_DIR}/"):
                        shm.add(path[len(str(SHM_DIR)) + 1:].removesuffix(" (deleted)"))
        except OSError:
            continue
    return pids, written, shm


def file_sizes(paths: dict[str, int]) -> dict[str, int]:
    """``paths`` with each file's size now (its old size where it can no longer be read)."""
    sizes = {}
    for path, size in paths.items():
        try:
            sizes[path] = os.stat(path).st_size
        except OSError:
            sizes[path] = size
    return sizes


def capture_tree_files(images: Path, pids: list[int], written: dict[str, int], shm_in_use: set[str],
                       shm_before_dump: set[str], external: dict[str, dict[str, Any]] | None = None,
                       external_netns: bool = False) -> TreeFiles:
    """After a successful dump: save the tree's /dev/shm files and the ones CRIU added (link_remap)."""
    created = {p.name for p in SHM_DIR.iterdir()} - shm_before_dump if SHM_DIR.is_dir() else set()
    names = sorted(n for n in (shm_in_use | created) if (SHM_DIR / n).is_file())
    if names:
        (images / "devshm").mkdir(exist_ok=True)
    for name in names:
        copy_sparse(SHM_DIR / name, images / "devshm" / name)
    state = TreeFiles(pids=pids, appended=written, shm=names, external=external or {}, external_netns=external_netns)
    state.save(images)
    # The dumped tree is gone (CRIU kills it); its /dev/shm files live on in the image and are put back
    # before each restore. Left in /dev/shm they would only pile up (vLLM's are 400 MB each).
    for name in names:
        try:
            (SHM_DIR / name).unlink()
        except OSError:
            pass
    return state


def prepare_restore(images: Path, wait_for_pids_s: float = 10.0, host_namespace: bool = True) -> TreeFiles:
    """Put the host back in the state the image expects; raises :class:`ImageStateError` if it cannot.
    ``host_namespace``: the tree takes its captured pids and ``/dev/shm`` names on the host itself (not a
    replica in namespaces of its own, whose ``/dev/shm`` :mod:`coldsnap.snapshot.namespace_init` fills)."""
    state = TreeFiles.load(images)
    if host_namespace:
        _wait_for_pids(state.pids, wait_for_pids_s)
        restore_shm(images, state.shm, SHM_DIR)
    for path, size in state.appended.items():
        try:
            current = os.stat(path).st_size
        except FileNotFoundError:
            raise ImageStateError(f"{path} (open for writing at capture) no longer exists") from None
        if current < size:
            raise ImageStateError(f"{path} shrank from {size} to {current} bytes since capture")
        if current > size:
            # Keep what a previous incarnation wrote: move it aside, then cut back to the captured size.
            aside = f"{path}.coldsnap-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
            with open(path, "rb") as source, open(aside, "xb") as copy:
                source.seek(size)
                shutil.copyfileobj(source, copy)
            os.truncate(path, size)
    return state


def _wait_for_pids(pids: list[int], wait_for_pids_s: float) -> None:
    deadline = time.monotonic() + wait_for_pids_s
    while True:
        busy = [pid for pid in pids if os.path.exists(f"/proc/{pid}")]
        if not busy:
            return
        if time.monotonic() >= deadline:
            raise ImageStateError(
                f"pids {busy[:8]} of the image are still in use after {wait_for_pids_s:.0f} s "
                "(the previous incarnation is still running or not reaped)"
            )
        time.sleep(0.02)


def namespace_pid(pid: int) -> int:
    """``pid``'s number in its own (innermost) pid namespace (``NSpid``'s last field); ``pid`` itself
    when /proc does not say."""
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                if line.startswith("NSpid:"):
                    return int(line.split()[-1])
    except (OSError, ValueError):
        pass
    return pid


def inherited_files(state: TreeFiles, artifact_root: Path, state_dir: Path) -> dict[str, int]:
    """For each file of ``state.external``: a fresh copy of its captured bytes in ``state_dir`` (same
    relative path; a previous incarnation's kept as ``.previous``), opened for appending, for CRIU's
    ``--inherit-fd`` (CRIU checks the size is the captured one; the tree then appends to this copy).
    Returns key → descriptor; the caller closes them after CRIU ran."""
    opened: dict[str, int] = {}
    try:
        for key, entry in state.external.items():
            target = state_dir / entry["path"]
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.exists():
                os.replace(target, target.with_name(target.name + ".previous"))
            size = int(entry["size"])
            with open(target, "xb") as copy:
                try:
                    with open(artifact_root / entry["path"], "rb") as source:
                        left = size
                        while left and (block := source.read(min(left, 1 << 20))):
                            copy.write(block)
                            left -= len(block)
                except FileNotFoundError:
                    pass  # the captured log is gone: its size in zeros keeps CRIU's check
                copy.truncate(size)
            opened[key] = os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
    except BaseException:
        for fd in opened.values():
            os.close(fd)
        raise
    return opened


def _rollup(pids: list[int], field: str) -> int:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as handle:
                for line in handle:
                    if line.startswith(field):
                        total += int(line.split()[1]) * 1024
        except OSError:
            continue  # exited meanwhile: counts 0
    return total


def anonymous_bytes(pids: list[int]) -> int:
    """Anonymous memory of ``pids`` (``smaps_rollup``): what CRIU copies into the image, roughly."""
    return _rollup(pids, "Anonymous:")


def resident_bytes(pids: list[int]) -> int:
    """Resident memory of ``pids`` (RSS: anonymous and file-backed pages)."""
    return _rollup(pids, "Rss:")


@dataclass(frozen=True)
class TcpConnection:
    """One connected TCP socket of a tree: a process holding it, and its two ends."""

    pid: int
    """The first process of the tree (parents first) found holding the socket."""
    local: str
    """``address:port`` (an IPv6 address in brackets; an IPv4-mapped one as IPv4)."""
    remote: str

    def __str__(self) -> str:
        return f"pid {self.pid} holds {self.local} -> {self.remote}"


@dataclass(frozen=True)
class TcpConnections:
    """The connected (not listening) TCP sockets a tree holds: what needs CRIU's ``--tcp-established``."""

    connected: int
    outside: tuple[TcpConnection, ...]
    """Of them, those whose peer is not a socket of the tree (another process, another host): only these
    need CRIU's network lock while the tree is dumped, since the tree's own peers are frozen with it."""


_V4_MAPPED = "0000000000000000FFFF0000"  # ::ffff:a.b.c.d as /proc/net/tcp6 prints it


def _endpoint(field: str) -> str:
    """``/proc/net/tcp{,6}``'s ``ADDR:PORT`` with IPv4-mapped IPv6 addresses as their IPv4 form, so an
    AF_INET6 socket and its AF_INET peer name each other alike."""
    address, _, port = field.partition(":")
    return f"{address[len(_V4_MAPPED):] if address.startswith(_V4_MAPPED) else address}:{port}"


def _readable(endpoint: str) -> str:
    """An :func:`_endpoint` as people write it: ``127.0.0.1:40000``, ``[::1]:40000``. The table prints
    each 32-bit word of the address in the host's byte order."""
    address, _, port = endpoint.partition(":")
    packed = b"".join(int(address[i:i + 8], 16).to_bytes(4, sys.byteorder) for i in range(0, len(address), 8))
    if len(packed) == 4:
        return f"{socket.inet_ntop(socket.AF_INET, packed)}:{int(port, 16)}"
    return f"[{socket.inet_ntop(socket.AF_INET6, packed)}]:{int(port, 16)}"


def tcp_connections(pids: list[int]) -> TcpConnections:
    """How many connected TCP sockets ``pids`` hold, and those of them whose peer is outside ``pids``
    (matched by endpoints in the tree's network namespace: a peer socket whose local end is this one's
    remote end and the other way round)."""
    inodes: dict[str, int] = {}  # socket inode -> the first pid holding it
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith("socket:["):
                    inodes.setdefault(target[8:-1], pid)
        except OSError:
            continue
    if not inodes:
        return TcpConnections(0, ())
    connected: dict[str, tuple[str, str]] = {}  # inode -> (local, remote)
    by_endpoints: dict[tuple[str, str], str] = {}  # (local, remote) -> inode, every socket of the namespace
    for pid in pids[:1]:  # one tree, one network namespace
        for table in ("tcp", "tcp6"):
            try:
                with open(f"/proc/{pid}/net/{table}") as handle:
                    next(handle, None)
                    for row in handle:
                        fields = row.split()
                        if len(fields) <= 9 or fields[3] in ("0A", "07"):  # LISTEN, CLOSE
                            continue
                        local, remote = _endpoint(fields[1]), _endpoint(fields[2])
                        by_endpoints[(local, remote)] = fields[9]
                        if fields[9] in inodes:
                            connected[fields[9]] = (local, remote)
            except OSError:
                continue
    outside = tuple(TcpConnection(inodes[inode], _readable(local), _readable(remote))
                    for inode, (local, remote) in connected.items() if by_endpoints.get((remote, local)) not in inodes)
    return TcpConnections(len(connected), outside)

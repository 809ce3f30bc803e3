"""A replica's CRIU, started as the first process of new pid and mount namespaces (``unshare``), and what the
launcher does to it: hold its network unlock (:class:`UnlockHold`), find the restored tree's pids on this host,
kill it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from coldsnap.snapshot.criu_binary import CriuError

__all__ = ["UNLOCK_HOLD_ENV", "UNLOCK_HOLD_SCRIPT", "UnlockHold", "kill_replica", "launch_replica", "replica_pids",
           "unshare_path"]

UNLOCK_HOLD_ENV = "COLDSNAP_UNLOCK_HOLD"
UNLOCK_HOLD_SCRIPT = Path(__file__).with_name("unlock_hold.sh")
"""CRIU's action script of a held restore (package data). It talks through two FIFOs in CRIU's work directory:
``unlock-restored`` (the script says the tree is back) and ``unlock-go`` (the launcher says ``go`` or ``abort``).
The launcher holds both open for reading and writing from before CRIU starts, so neither side's open blocks; if
the launcher dies, the script reads end of file and fails, and CRIU kills the tree."""


def unshare_path() -> str:
    """Where ``unshare`` is; raises :class:`CriuError` when it is not on ``PATH``."""
    unshare = shutil.which("unshare")
    if unshare is None:
        raise CriuError("restore", None, "no unshare (util-linux) on PATH: a replica restore needs it")
    return unshare


def launch_replica(unshare: str, criu: str, images: Path, root_pid: int, args: list[str], inherited: dict[str, int],
                   own_images: bool, env: dict[str, str], shm: list[str]) -> "subprocess.Popen[bytes]":
    """``criu ARGS`` under ``unshare``, through :mod:`coldsnap.snapshot.namespace_init`, in a session of its own;
    its standard output says when the tree is restored."""
    # python -S, coldsnap found through PYTHONPATH: no site-packages scan on the restore's path; what this
    # process knows already (the /dev/shm names, the sockets to rename) given, not read again there.
    from coldsnap.snapshot.moved_sockets import namespace_sockets
    from coldsnap.snapshot.namespace_init import ENTRY

    options = [f"--shm={name}" for name in shm]
    if own_images:
        names = namespace_sockets(images)
        options += ["--own-images", *([f"--namespace-sockets={','.join(n.hex() for n in names)}"]
                                      if names is not None else [])]
    command = [unshare, "--pid", "--fork", "--mount-proc", "--", sys.executable, "-S", "-c", ENTRY, *options,
               str(images), str(root_pid), criu, *args]
    package_root = str(Path(__file__).resolve().parents[2])
    env = {**env, "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)}
    try:
        # Its own session: the replica must not get the launcher's terminal signals (^C).
        return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                pass_fds=tuple(inherited.values()), start_new_session=True, env=env)
    except OSError as exc:
        raise CriuError("restore", exc.errno, str(exc)) from None


def replica_pids(launcher: "subprocess.Popen[bytes]") -> tuple[int, dict[int, int]]:
    """The restored root's pid on this host and every restored pid's host pid by its captured one; raises
    :class:`CriuError` (the namespace killed) when the root is gone."""
    from coldsnap.snapshot import process_tree

    # unshare → pid 1 (the reaper) → the restored root: the pids as this host sees them.
    init = _children(launcher.pid)
    roots = _children(init[0]) if init else []
    if not roots:
        os.killpg(launcher.pid, signal.SIGKILL)
        raise CriuError("restore", None, "CRIU reported the tree restored, but its root is gone")
    pids = {process_tree.namespace_pid(pid): pid for pid in process_tree.tree_pids(roots[0])}
    return roots[0], pids


def kill_replica(launcher: "subprocess.Popen[bytes]") -> int:
    """``unshare``, the namespace's pid 1 (CRIU, or the reaper) and whatever was restored so far, killed and
    waited for; returns unshare's status. Killed, ``unshare`` exits at once, not after its child: returning
    then would leave pid 1 and the namespace exiting, the tree's ports still bound for a moment."""
    from coldsnap.snapshot.process_tree import kill_tree

    kill_tree(launcher.pid)
    return launcher.wait()


class UnlockHold:
    """The FIFOs and a copy of :data:`UNLOCK_HOLD_SCRIPT` in ``work``, removed on exit."""

    def __init__(self, work: Path):
        self.script = work / "unlock-hold.sh"
        self.paths = [work / "unlock-restored", work / "unlock-go"]
        self.restored = self.go = -1

    def __enter__(self) -> "UnlockHold":
        try:
            for path in self.paths:
                path.unlink(missing_ok=True)
                os.mkfifo(path, 0o600)
            self.restored, self.go = (os.open(path, os.O_RDWR | os.O_NONBLOCK) for path in self.paths)
            self.script.write_text(UNLOCK_HOLD_SCRIPT.read_text())
            self.script.chmod(0o700)
        except OSError as exc:
            self.__exit__()
            raise CriuError("restore", exc.errno, f"cannot make the network-unlock hold in {self.script.parent}: {exc}") from None
        return self

    def __exit__(self, *_: object) -> None:
        for fd in (self.restored, self.go):
            if fd >= 0:
                os.close(fd)
        self.restored = self.go = -1
        for path in [*self.paths, self.script]:
            path.unlink(missing_ok=True)


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as handle:
            return [int(child) for child in handle.read().split()]
    except OSError:
        return []


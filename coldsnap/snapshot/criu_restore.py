"""A CRIU restore: an image directory back into a running tree, as a replica in namespaces of its own
(:mod:`coldsnap.snapshot.replica_launcher`) or with its captured pids in this host's; the logs it leaves."""

from __future__ import annotations

import os
import select
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from coldsnap.snapshot.criu_binary import (Criu, CriuError, criu_environment, fill_threads_wanted, log_file_tail,
                                           output_tail, thp_fill_wanted)
from coldsnap.snapshot.criu_options import EXTERNAL_NETNS_KEY, SnapshotOptions, log_level_args
from coldsnap.snapshot.replica_launcher import (UNLOCK_HOLD_ENV, UnlockHold, kill_replica, launch_replica,
                                                replica_pids, unshare_path)

__all__ = ["KEPT_RESTORE_LOGS", "PendingRestore", "RestoreResult", "drop_old_logs", "start_restore"]


@dataclass(frozen=True)
class RestoreResult:
    pid: int
    """The restored root process, as this host sees it."""
    seconds: float
    host_pids: dict[int, int] = field(default_factory=dict)
    """A replica's pids on this host by their captured (namespace) pid; empty when restored with the
    captured pids themselves."""
    thp_fill: bool = False
    """CRIU was asked to fill huge pages (:func:`thp_fill_wanted`)."""
    fill_threads: int = 0
    """Helper threads per process CRIU was allowed for the fill (:func:`fill_threads_wanted`)."""


def start_restore(criu: Criu, options: SnapshotOptions, images: Path, state_dir: Path, owned_root: Path | None = None,
                  timeout: float = 600, wait_for_pids_s: float = 10.0, replica: bool = True, own_images: bool = False,
                  before_unlock: Callable[[], None] | None = None) -> "PendingRestore":
    """Start restoring the tree detached (it keeps running after the restore): returns once CRIU runs (a
    replica) or is done (the host's namespace); the caller does other work meanwhile, then
    :meth:`PendingRestore.finish` waits for the tree (its root pid), or :meth:`PendingRestore.abandon` kills
    whatever of it there is. Raises :class:`CriuError` when CRIU cannot be started.

    Nothing is written into ``images``: CRIU's log, stats and pidfile go to ``state_dir/criu``, and
    the files the dump took as external (under ``owned_root``, the artifact) are handed to the tree
    as fresh copies in ``state_dir`` (``--inherit-fd``). On failure CRIU kills whatever it had
    restored, so nothing of the tree is left running.

    ``replica`` (the default): the tree gets its own pid and mount namespaces and ``/dev/shm``
    (:mod:`coldsnap.snapshot.namespace_init`), so restores of one image can run side by side; the
    result names its pids as this host sees them. ``own_images`` says ``images`` is this restore's
    copy (:func:`coldsnap.snapshot.moved_sockets.replica_images`), where the sockets named after their pid
    namespace (the CUDA driver's) are renamed for the new one. Without ``replica``, the tree takes
    back its captured pids in the host's namespace (waiting up to ``wait_for_pids_s`` for a previous
    incarnation to go).

    ``before_unlock`` (a replica only): called once every process and socket of the tree is restored, but
    before CRIU takes the restored TCP connections out of repair mode and lets the tree run (CRIU's
    ``post-restore`` action, :data:`~coldsnap.snapshot.replica_launcher.UNLOCK_HOLD_SCRIPT`). One launch unit
    of several waits there for the others: a connection to another unit's tree must not send (leaving repair
    mode sends a window probe) before the peer's socket exists, or the peer's host resets it. If it raises,
    CRIU is told to abort: the tree is killed and the exception raised from :meth:`PendingRestore.finish`.
    """
    from coldsnap.snapshot import process_tree

    if before_unlock is not None and not replica:
        raise ValueError("before_unlock needs a replica restore")

    try:
        state = process_tree.prepare_restore(images, wait_for_pids_s, host_namespace=not replica)
    except process_tree.ImageStateError as exc:
        raise CriuError("restore", None, str(exc)) from None
    work = state_dir / "criu"
    work.mkdir(parents=True, exist_ok=True)
    pidfile = work / "restore.pid"
    pidfile.unlink(missing_ok=True)
    log = f"restore-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}.log"
    drop_old_logs(work, "restore-*.log", KEPT_RESTORE_LOGS - 1)
    inherited: dict[str, int] = {}
    if state.external:
        if owned_root is None:
            raise CriuError("restore", None,
                            "the image has files of its artifact open (its log); restore needs the artifact's root")
        inherited = process_tree.inherited_files(state, owned_root, state_dir)
    if state.external_netns:  # the tree goes into this process's network namespace: this host's
        inherited[EXTERNAL_NETNS_KEY] = os.open("/proc/self/ns/net", os.O_RDONLY)
    args = ["restore", "-D", str(images), "-W", str(work), "-o", log, "--pidfile", str(pidfile),
            *options.args(),
            *(argument for key, fd in inherited.items() for argument in ("--inherit-fd", f"fd[{fd}]:{key}")),
            *log_level_args()]
    # CRIU_THP_FILL: this project's CRIU fills private memory into huge pages where the host's THP
    # mode is "madvise"; CRIU_FILL_THREADS: on that many more threads per process (a stock CRIU
    # ignores both).
    thp_fill, fill_threads = thp_fill_wanted(), fill_threads_wanted()
    env = criu_environment({**os.environ, "CRIU_THP_FILL": "1" if thp_fill else "0",
                            "CRIU_FILL_THREADS": str(fill_threads)})
    pending = PendingRestore(work / log, timeout, thp_fill, fill_threads)
    try:
        if replica:
            pending.launch_replica(criu.path, images, state.pids[0], args, inherited, own_images, env,
                                   before_unlock, state.shm)
        else:
            pending.done = _restore_here(criu, args + ["-d"], work / log, pidfile, timeout, inherited, env), {}
    except BaseException:
        pending.abandon()
        raise
    finally:
        for fd in inherited.values():  # (the child has its own copies)
            os.close(fd)
    return pending


def _restore_here(criu: Criu, args: list[str], log: Path, pidfile: Path, timeout: float,
                  inherited: dict[str, int], env: dict[str, str]) -> int:
    result = criu.run("restore", args, timeout=timeout, pass_fds=tuple(inherited.values()), env=env)
    if result.returncode != 0:
        raise CriuError("restore", result.returncode, log_file_tail(log) or output_tail(result.stderr))
    try:
        return int(pidfile.read_text().strip())
    except (OSError, ValueError):
        raise CriuError("restore", None, f"CRIU reported success but wrote no pid to {pidfile}") from None


class PendingRestore:
    """A CRIU restore under way (:func:`start_restore`). A replica's CRIU runs as the first
    process of new pid and mount namespaces (``unshare``); :meth:`finish` waits for it to report the tree
    restored, :meth:`abandon` kills it and whatever it restored (the namespace dies with its pid 1)."""

    def __init__(self, log: Path, timeout: float, thp_fill: bool, fill_threads: int):
        self.log = log
        self.started = time.monotonic()
        self.deadline = self.started + timeout
        self.thp_fill = thp_fill
        self.fill_threads = fill_threads
        self.launcher: subprocess.Popen[bytes] | None = None
        self.done: tuple[int, dict[int, int]] | None = None  # (root pid, host pids) once restored
        self._hold: UnlockHold | None = None
        self._before_unlock: Callable[[], None] | None = None

    def launch_replica(self, criu: str, images: Path, root_pid: int, args: list[str], inherited: dict[str, int],
                       own_images: bool, env: dict[str, str], before_unlock: Callable[[], None] | None,
                       shm: list[str]) -> None:
        unshare = unshare_path()
        if before_unlock is not None:
            self._hold = UnlockHold(self.log.parent).__enter__()
            self._before_unlock = before_unlock
            args = [*args, "--action-script", str(self._hold.script)]
            env = {**env, UNLOCK_HOLD_ENV: str(self.log.parent)}
        self.launcher = launch_replica(unshare, criu, images, root_pid, args, inherited, own_images, env, shm)

    def finish(self) -> RestoreResult:
        """Wait for the tree (a replica: CRIU's ``ready``, the held unlock passed through ``before_unlock``);
        raises :class:`CriuError` with CRIU's log when it failed, having killed what it restored."""
        try:
            if self.done is None:
                self.done = self._await_replica()
        except BaseException:
            self.abandon()
            raise
        finally:
            self._close_hold()
        pid, pids = self.done
        return RestoreResult(pid=pid, seconds=time.monotonic() - self.started, host_pids=pids,
                             thp_fill=self.thp_fill, fill_threads=self.fill_threads)

    def abandon(self) -> None:
        """Kill CRIU and whatever it restored; wait for them. Idempotent."""
        launcher, self.launcher = self.launcher, None
        if launcher is not None:
            kill_replica(launcher)
            for stream in (launcher.stdout, launcher.stderr):
                if stream is not None:
                    stream.close()
        self._close_hold()

    def _close_hold(self) -> None:
        hold, self._hold = self._hold, None
        if hold is not None:
            hold.__exit__()

    def _reap(self, grace_s: float, read_stderr: bool = True) -> tuple[int, str]:
        """CRIU's exit (killed after ``grace_s``), its status and (``read_stderr``) standard error; nothing
        left to abandon."""
        launcher, self.launcher = self.launcher, None
        assert launcher is not None and launcher.stdout is not None and launcher.stderr is not None
        try:
            status = launcher.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            status = kill_replica(launcher)
        stderr = launcher.stderr.read().decode(errors="replace") if read_stderr else ""
        launcher.stdout.close()
        launcher.stderr.close()
        return status, stderr

    def _await_replica(self) -> tuple[int, dict[int, int]]:
        """The root's pid on this host and every restored pid's host pid by its captured one."""
        from coldsnap.snapshot.namespace_init import READY

        launcher, hold = self.launcher, self._hold
        assert launcher is not None and launcher.stdout is not None and launcher.stderr is not None
        held_back: BaseException | None = None  # what before_unlock raised: CRIU was told to abort
        watched: list[Any] = [launcher.stdout, *([hold.restored] if hold is not None else [])]
        while True:
            readable = select.select(watched, [], [], max(0.0, self.deadline - time.monotonic()))[0]
            if hold is None or hold.restored not in readable:
                break
            os.read(hold.restored, 64)  # the script's "restored": every process and socket is back
            watched.remove(hold.restored)
            waited = time.monotonic()
            try:
                assert self._before_unlock is not None
                self._before_unlock()
            except BaseException as exc:
                held_back = exc
                os.write(hold.go, b"abort\n")  # the script fails, CRIU kills the tree and exits non-zero
                self._reap(30, read_stderr=False)  # (what before_unlock raised is the error)
                break
            os.write(hold.go, b"go\n")
            self.deadline += time.monotonic() - waited  # (the other units' time is not CRIU's)
        ready = bool(readable) and held_back is None and launcher.stdout.readline() == READY
        if held_back is not None:
            raise held_back
        if not ready:  # CRIU failed (pid 1 gone: unshare exits with its status) or ran out of time
            status, stderr = self._reap(10)
            raise CriuError("restore", status, log_file_tail(self.log) or output_tail(stderr) or
                            f"timed out after {self.deadline - self.started:.0f} s")
        launcher.stdout.close()
        launcher.stderr.close()
        self.launcher = None  # the tree is on its own now: abandon() no longer kills it
        return replica_pids(launcher)


KEPT_RESTORE_LOGS = 8
"""CRIU restore logs kept per state directory: a host restoring one replica all day keeps the latest."""


def drop_old_logs(folder: Path, pattern: str, keep: int) -> None:
    """All but the ``keep`` newest files matching ``pattern`` in ``folder`` removed (best effort)."""
    try:
        logs = sorted(folder.glob(pattern), key=lambda p: p.stat().st_mtime_ns, reverse=True)
    except OSError:
        return
    for old in logs[keep:]:
        old.unlink(missing_ok=True)


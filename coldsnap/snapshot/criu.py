"""CRIU, behind one module with a typed error.

coldsnap needs CRIU >= 4.2 on current kernels: 3.17 fails on the vDSO layout of 6.x kernels and 4.1.1
cannot dump TCP sockets on kernels >= 6.16 (checkpoint-restore/criu#2705, #2718). ``scripts/install-criu.sh``
installs 4.2.1 into a private prefix with a ``criu`` wrapper.

The binary is found through ``COLDSNAP_CRIU`` (a path), else ``criu`` on ``PATH``.

The CRIU that script builds carries ``scripts/criu/thp-fill.patch``: with ``CRIU_THP_FILL=1`` (set by
restores here as :func:`thp_fill_wanted` says) and the host's THP mode ``madvise``, it fills private
anonymous memory into 2 MiB pages and takes the advice back after; and ``parallel-fill.patch``: with
``CRIU_FILL_THREADS=N`` (:func:`fill_threads_wanted`) each restored process's pages are read by up to N
helper threads beside it, and the tree's root fills beside the other processes instead of after them.
A stock CRIU ignores both variables; and ``kdat-dir.patch``: with ``CRIU_KDAT_DIR`` (every run here,
:func:`criu_environment`) CRIU keeps the kernel facts it probes at its start in that folder, one per boot,
on any file system (stock CRIU keeps them only where ``/run`` is a tmpfs, and probes again at every run
elsewhere). ``criu --version`` names the build (GitID ``v4.2.1-coldsnap-thp-fill+parallel+kdat-dir``).
"""

from __future__ import annotations

import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal

from coldsnap.snapshot.criu_images import ImageFormatError
from coldsnap.settings import SETTINGS

if TYPE_CHECKING:
    from coldsnap.snapshot.criu_pages import ImageCensus

__all__ = [
    "CriuError",
    "Criu",
    "CriuCheck",
    "CriuVersion",
    "CriuSnapshotter",
    "DumpResult",
    "PendingRestore",
    "RestoreResult",
    "SnapshotOptions",
    "criu_environment",
    "find_criu",
    "MINIMUM_VERSION",
]

MINIMUM_VERSION = (4, 2)
THP_FILL_BUILD = "coldsnap-thp-fill"
"""In the GitID of a CRIU built by ``scripts/build-criu.sh``: it fills huge pages (``CRIU_THP_FILL``)."""
THP_FILL_ENV = "COLDSNAP_CRIU_THP_FILL"
PARALLEL_FILL_BUILD = "+parallel"
"""In the GitID of a CRIU built with ``scripts/criu/parallel-fill.patch`` (``CRIU_FILL_THREADS``)."""
KDAT_DIR_BUILD = "+kdat-dir"
"""In the GitID of a CRIU built with ``scripts/criu/kdat-dir.patch`` (``CRIU_KDAT_DIR``)."""
FILL_THREADS_ENV = "COLDSNAP_CRIU_FILL_THREADS"
FILL_THREADS_MAX = 16  # the patch's FILL_THREADS_MAX: helpers per process
KDAT_DIR_ENV = "CRIU_KDAT_DIR"
KDAT_FOLDER = "criu-kdat"
"""In the state root: one folder per boot (named by its boot id), where CRIU keeps that boot's kernel facts."""

# Printed by every run inside containers with a low hard limit; it does not affect the result.
_HARMLESS = re.compile(r"rlimit: Can't setup RLIMIT_NOFILE for self")


class CriuError(RuntimeError):
    """A CRIU invocation failed. ``op`` is the CRIU action, ``errno`` its exit status or OS errno."""

    def __init__(self, op: str, errno: int | None, log_tail: str):
        self.op = op
        self.errno = errno
        self.log_tail = log_tail
        status = f" (status {errno})" if errno is not None else ""
        lines = log_tail.strip().splitlines()
        # The first error says why; the last one is CRIU's generic "Dumping FAILED."
        reason = next((line for line in lines if "Error (" in line), lines[-1] if lines else "")
        super().__init__(f"criu {op} failed{status}" + (f": {reason}" if reason else ""))


@dataclass(frozen=True)
class CriuCheck:
    """Verdict of ``criu check``."""

    ok: bool
    output: str


@dataclass(frozen=True)
class CriuVersion:
    """What ``criu --version`` says."""

    numbers: tuple[int, ...]
    """``(major, minor[, sublevel])``."""
    gitid: str = ""
    """The build's GitID line, empty for a release built outside git (Debian's)."""

    @property
    def fills_huge_pages(self) -> bool:
        """Built with ``scripts/criu/thp-fill.patch``: ``CRIU_THP_FILL=1`` fills private memory into huge
        pages."""
        return THP_FILL_BUILD in self.gitid

    @property
    def fills_in_parallel(self) -> bool:
        """Built with ``scripts/criu/parallel-fill.patch``: ``CRIU_FILL_THREADS=N`` reads each process's
        pages on up to N more threads."""
        return self.fills_huge_pages and PARALLEL_FILL_BUILD in self.gitid

    @property
    def keeps_kernel_facts(self) -> bool:
        """Built with ``scripts/criu/kdat-dir.patch``: ``CRIU_KDAT_DIR`` keeps the kernel facts CRIU probes
        at its start, once per boot (:func:`criu_environment`)."""
        return KDAT_DIR_BUILD in self.gitid

    def __str__(self) -> str:
        return ".".join(map(str, self.numbers)) + (f" ({self.gitid})" if self.gitid else "")


VIRTIO_BALLOONS = Path("/sys/bus/virtio/drivers/virtio_balloon")
_BALLOON_F_REPORTING = 5  # VIRTIO_BALLOON_F_REPORTING: the guest reports its free pages to the host


def reports_free_pages(balloons: Path = VIRTIO_BALLOONS) -> bool:
    """This machine is a VM whose virtio balloon hands free memory back to its host ("Free page
    reporting enabled" at boot). Free 2 MiB blocks are what it reports, so a fresh huge page then costs
    the host's faults on first touch, and CRIU's huge-page fill runs slower than its 4 KiB one (measured
    on the project's CPU machine: vLLM's CPU restore 2.28 against 1.15 s)."""
    try:
        features = [device / "features" for device in balloons.iterdir()]
        return any(len(bits := f.read_text().strip()) > _BALLOON_F_REPORTING and bits[_BALLOON_F_REPORTING] == "1"
                   for f in features if f.exists())
    except OSError:
        return False


def thp_fill_wanted(balloons: Path = VIRTIO_BALLOONS) -> bool:
    """Whether restores ask CRIU to fill huge pages: ``COLDSNAP_CRIU_THP_FILL=1`` always, ``0`` never;
    otherwise (``auto``, the default) unless this machine reports free pages to a hypervisor
    (:func:`reports_free_pages`)."""
    value = SETTINGS.choice(THP_FILL_ENV) or "auto"
    if value in ("0", "1"):
        return value == "1"
    return not reports_free_pages(balloons)


def fill_threads_wanted() -> int:
    """How many helper threads CRIU may start per restored process to read its pages
    (``CRIU_FILL_THREADS``; one per 64 MiB of pages at most): ``COLDSNAP_CRIU_FILL_THREADS=N`` (0: CRIU's
    own single-threaded fill), else half this machine's CPUs less one, at least one, at most seven. A
    restore fills its GPU process and its API server at once while the weights stage beside them, so the
    helpers get half the CPUs; one thread fills ~2 GB/s of image (the page faults of the destination),
    and the fill is what most of CRIU's step is for an engine's process."""
    value = SETTINGS.text(FILL_THREADS_ENV) or "auto"
    if value.isdigit():
        return min(int(value), FILL_THREADS_MAX)
    try:
        cpus = len(os.sched_getaffinity(0))  # (a container's cpuset, where os.cpu_count() says the host's)
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 2
    return min(7, max(1, cpus // 2 - 1))


def _tail(text: str, lines: int = 20) -> str:
    kept = [line for line in text.splitlines() if not _HARMLESS.search(line)]
    return "\n".join(kept[-lines:])


def find_criu() -> str | None:
    """Path of the CRIU executable coldsnap will use, or ``None``."""
    explicit = SETTINGS.text("COLDSNAP_CRIU")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    return shutil.which("criu")


def criu_environment(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default this process's) for a CRIU run, with :data:`KDAT_DIR_ENV` naming this boot's folder
    under the state root (made here; other boots' folders removed), unless ``env`` names one already.

    CRIU probes the kernel at every start (a network namespace with a veth pair, the vDSO, CPU features,
    iptables: ~50 ms on the 2-core CPU machine, ~30 ms of each restore's CRIU step on the H200) unless it
    finds the facts kept, which stock CRIU does only on a tmpfs ``/run``. Without a boot id, or a folder it
    can make that only this user can write (a state root handed over to ``--owner`` is that owner's: root's
    CRIU must not read facts another user could have written), ``env`` goes as it is (CRIU probes, as before)."""
    from coldsnap.host import boot_id, state_root

    result = dict(os.environ if env is None else env)
    boot = boot_id()
    if KDAT_DIR_ENV in result or not boot:
        return result
    folder = state_root() / KDAT_FOLDER
    try:
        (folder / boot).mkdir(parents=True, exist_ok=True, mode=0o700)
        if any(st.st_uid != os.geteuid() or st.st_mode & 0o022 for st in map(os.stat, (folder, folder / boot))):
            return result
        with os.scandir(folder) as entries:
            for entry in entries:
                if entry.name != boot:
                    shutil.rmtree(entry.path, ignore_errors=True)  # (an earlier boot's: its kernel may be gone)
    except OSError:
        return result
    result[KDAT_DIR_ENV] = str(folder / boot)
    return result


class Criu:
    """One CRIU executable."""

    def __init__(self, path: str | None = None):
        found = path or find_criu()
        if found is None:
            where = SETTINGS.text("COLDSNAP_CRIU")
            hint = f"COLDSNAP_CRIU={where} is not executable" if where else "no criu on PATH and COLDSNAP_CRIU unset"
            raise CriuError("locate", None, f"{hint}; install it with scripts/install-criu.sh")
        self.path = found

    def _run(self, op: str, args: list[str], timeout: float, pass_fds: tuple[int, ...] = (),
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        try:
            return subprocess.run(
                [self.path, *args], capture_output=True, text=True, timeout=timeout, check=False, pass_fds=pass_fds,
                env=env if op == "--version" else criu_environment(env))
        except OSError as exc:
            raise CriuError(op, exc.errno, str(exc)) from None
        except subprocess.TimeoutExpired:
            raise CriuError(op, None, f"timed out after {timeout:.0f} s") from None

    def version(self) -> CriuVersion:
        """``criu --version``: the version's numbers and the build's GitID."""
        result = self._run("--version", ["--version"], timeout=30)
        match = re.search(r"Version:\s*([0-9]+(?:\.[0-9]+)*)", result.stdout)
        if result.returncode != 0 or not match:
            raise CriuError("--version", result.returncode, _tail(result.stdout + result.stderr))
        gitid = re.search(r"GitID:\s*(\S+)", result.stdout)
        return CriuVersion(tuple(int(p) for p in match.group(1).split(".")), gitid.group(1) if gitid else "")

    def check(self) -> CriuCheck:
        """Run ``criu check`` (needs root); never raises for a failed check, only for a missing binary."""
        result = self._run("check", ["check"], timeout=60)
        output = _tail(result.stdout + result.stderr)
        return CriuCheck(ok=result.returncode == 0 and "Looks good" in result.stdout + result.stderr, output=output)


CHECK_CACHE = "criu-check.json"


def checked_criu(cache_dir: Path | None = None) -> tuple[CriuVersion, CriuCheck]:
    """CRIU's version and ``criu check`` verdict. With ``cache_dir`` (a restore's state root) a passing
    verdict is kept there and reused while the executable file, the kernel and the boot are the same: the
    two runs cost ~0.1 s of every restore's admission, and what ``check`` probes (kernel features) does not
    change within a boot. A failing verdict is never kept. ``coldsnap doctor`` always asks afresh."""
    from coldsnap.host import keep_boot_fact, kept_boot_fact

    criu = Criu()
    key: list[object] = []
    try:
        status = os.stat(criu.path)
        key = [os.path.realpath(criu.path), status.st_ino, status.st_size, status.st_mtime_ns, os.uname().release,
               os.geteuid()]
    except OSError:
        cache_dir = None  # nothing to key on (criu.version reports why)
    kept = kept_boot_fact(cache_dir, CHECK_CACHE, key)
    if isinstance(kept, dict) and isinstance(kept.get("version"), list) and isinstance(kept.get("output"), str) \
            and isinstance(kept.get("gitid"), str):
        return CriuVersion(tuple(kept["version"]), kept["gitid"]), CriuCheck(ok=True, output=kept["output"])
    version, check = criu.version(), criu.check()
    if check.ok:
        keep_boot_fact(cache_dir, CHECK_CACHE, key, {"version": list(version.numbers), "gitid": version.gitid,
                                                     "output": check.output})
    return version, check


TcpMode = Literal["established", "close", "none"]


EXTERNAL_NETNS_KEY = "coldsnap-netns"
"""CRIU's key for a tree's network namespace dumped as external (``--external net[INODE]:KEY`` at dump,
``--inherit-fd fd[N]:KEY`` at restore)."""


def _network_namespace(pid: int) -> int | None:
    """The inode of ``pid``'s network namespace (None when it cannot be read)."""
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None


@dataclass(frozen=True)
class SnapshotOptions:
    """How a tree is dumped and restored; the same options must be used for both."""

    tcp: TcpMode = "established"
    """``established``: live TCP connections are dumped and restored (needs a network lock);
    ``close``: they are dropped at dump and restored closed; ``none``: the tree has no connected TCP
    socket (listening ones are fine), so no flag and no network lock — CRIU then neither probes
    nftables nor unlocks anything, ~0.25 s less per dump and per restore. A connection that appears
    anyway makes the dump fail cleanly."""
    network_lock: Literal["nftables", "iptables", "skip"] = "nftables"
    """How established connections are frozen while the tree is dumped; nftables rather than CRIU's default
    iptables, which many hosts lack (and which is iptables-nft where podman is installed). ``skip`` when every
    connection's peer is a socket of the tree itself (frozen with it: nothing moves on them while CRIU reads
    them). CRIU keeps the dump's method in the image and uses it at restore whatever the restore's flag says:
    with ``nftables`` every restore deletes the dump's table (a libnftables context and a ``delete table``,
    which fails after the first restore, that deleted it, and otherwise leaves the table on the capture host);
    with ``skip`` it runs no nftables at all. (On the H200 the time saved was within the noise of SGLang's
    restores.)"""
    external_unix_sockets: bool = True
    """Allow unix sockets connected to peers outside the tree (e.g. a journal or a launcher)."""
    shell_job: bool = False
    """The tree shares the caller's session/terminal (not needed for ``setsid`` trees)."""
    ghost_limit_bytes: int = 256 << 20
    """Largest unlinked-but-open file copied into the image (CRIU's default, 1 MiB, refuses the
    unlinked shared-memory buffers servers keep in /dev/shm)."""

    def args(self) -> list[str]:
        out = ["--file-locks", "--manage-cgroups=ignore", "--ghost-limit", str(self.ghost_limit_bytes)]
        if self.tcp == "established":
            out += ["--tcp-established", "--network-lock", self.network_lock]
        elif self.tcp == "close":
            out += ["--tcp-close"]
        if self.external_unix_sockets:
            out += ["--ext-unix-sk"]
        if self.shell_job:
            out += ["--shell-job"]
        return out


@dataclass(frozen=True)
class DumpResult:
    seconds: float
    image_bytes: int
    pids: list[int]
    census: "ImageCensus | None" = None
    """Each process's private pages by kind, and the zero pages left out (None: not compacted)."""
    compact_seconds: float = 0.0


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


def _log_tail(path: Path) -> str:
    try:
        return _tail(path.read_text(errors="replace"))
    except OSError:
        return ""


def _tree_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


class CriuSnapshotter:
    """Dump a process tree into an image directory and restore it from there, as many times as needed."""

    def __init__(self, criu: Criu | None = None, options: SnapshotOptions = SnapshotOptions()):
        self.criu = criu or Criu()
        self.options = options

    def dump(self, root_pid: int, images: Path, timeout: float = 600, owned_root: Path | None = None,
             compact: bool = True) -> DumpResult:
        """Dump (and so stop) the tree rooted at ``root_pid`` into the empty directory ``images``.

        ``compact`` (the default): the zero pages of private anonymous memory are then left out of the
        image (:func:`coldsnap.snapshot.criu_pages.compact_image`); the restore reads fewer pages and
        gives the same memory.

        Files under ``owned_root`` (the artifact) that the tree has open for writing — the engine's log —
        are dumped as external files: a restore gives the tree its own copy (see :meth:`restore`), so
        the artifact is never written to and can move."""
        from coldsnap.snapshot import process_tree

        images.mkdir(parents=True, exist_ok=True)
        if any(images.iterdir()):
            raise CriuError("dump", None, f"image directory {images} is not empty")
        keys: dict[str, str] = {}
        pids, written, shm = process_tree.scan_tree(root_pid, keys)
        if not pids:
            raise CriuError("dump", None, f"no process {root_pid}")
        root = owned_root.resolve() if owned_root is not None else None
        # path → CRIU key of each file under owned_root the tree writes to
        owned = {path: keys[path] for path in written if root is not None and Path(path).is_relative_to(root)}
        shm_before = {p.name for p in process_tree.SHM_DIR.iterdir()} if process_tree.SHM_DIR.is_dir() else set()
        # A tree in a network namespace other than ours (a launch unit on a host of its own): the namespace is
        # placement, not part of the image. Dumped, it would come back as a copy of the capture host's devices,
        # addresses and routes, reachable from nowhere; external, each restore puts the tree into its own host's.
        netns = _network_namespace(root_pid)
        external_netns = netns is not None and netns != _network_namespace(os.getpid())
        netns_args = ["--external", f"net[{netns}]:{EXTERNAL_NETNS_KEY}"] if external_netns else []
        started = time.monotonic()
        # --link-remap: files unlinked while open (semaphores, temp files) are linked back under a new name.
        args = ["dump", "-t", str(root_pid), "-D", str(images), "-o", "dump.log", "--link-remap", *self.options.args(),
                *(argument for key in owned.values() for argument in ("--external", key)), *netns_args, *_log_level()]
        result = self.criu._run("dump", args, timeout=timeout)
        seconds = time.monotonic() - started
        if result.returncode != 0:
            raise CriuError("dump", result.returncode, _log_tail(images / "dump.log") or _tail(result.stderr))
        # The sizes the frozen tree left, not the scan's: the tree ran on until CRIU froze it, and a line it
        # appended meanwhile is in the image's memory as written. Cut back to the scan's size, every restore
        # would lose it (a test's echo log showed a gap).
        written = process_tree.file_sizes(written)
        external: dict[str, dict[str, object]] = {
            key: {"path": str(Path(path).relative_to(root)), "size": written.pop(path)}
            for path, key in owned.items() if root is not None}
        process_tree.capture_tree_files(images, pids, written, shm, shm_before, external, external_netns)
        census, compact_seconds = None, 0.0
        if compact:
            from coldsnap.snapshot.criu_pages import compact_image  # (a dump's only: a restore's entry imports less)

            started = time.monotonic()
            try:
                census = compact_image(images)
            except (ImageFormatError, OSError) as exc:
                raise CriuError("dump", None, f"leaving the zero pages out of the image: {exc}") from None
            compact_seconds = time.monotonic() - started
        return DumpResult(seconds=seconds, image_bytes=_tree_bytes(images), pids=pids, census=census,
                          compact_seconds=compact_seconds)

    def restore(self, images: Path, state_dir: Path, owned_root: Path | None = None, timeout: float = 600,
                wait_for_pids_s: float = 10.0, replica: bool = True, own_images: bool = False,
                before_unlock: Callable[[], None] | None = None) -> RestoreResult:
        """Restore the tree detached (it keeps running after this returns); returns its root pid.

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
        ``post-restore`` action, :data:`UNLOCK_HOLD_SCRIPT`). One launch unit of several waits there for the
        others: a connection to another unit's tree must not send (leaving repair mode sends a window probe)
        before the peer's socket exists, or the peer's host resets it. If it raises, CRIU is told to abort:
        the tree is killed and the exception raised from here.
        """
        return self.start_restore(images, state_dir, owned_root, timeout, wait_for_pids_s, replica, own_images,
                                  before_unlock).finish()

    def start_restore(self, images: Path, state_dir: Path, owned_root: Path | None = None, timeout: float = 600,
                      wait_for_pids_s: float = 10.0, replica: bool = True, own_images: bool = False,
                      before_unlock: Callable[[], None] | None = None) -> "PendingRestore":
        """:meth:`restore`, returning once CRIU runs (a replica) or is done (the host's namespace): the
        caller does other work meanwhile, then :meth:`PendingRestore.finish` waits for the tree, or
        :meth:`PendingRestore.abandon` kills whatever of it there is. Raises :class:`CriuError` when CRIU
        cannot be started."""
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
        _drop_old_logs(work, "restore-*.log", KEPT_RESTORE_LOGS - 1)
        inherited: dict[str, int] = {}
        if state.external:
            if owned_root is None:
                raise CriuError("restore", None,
                                "the image has files of its artifact open (its log); restore needs the artifact's root")
            inherited = process_tree.inherited_files(state, owned_root, state_dir)
        if state.external_netns:  # the tree goes into this process's network namespace: this host's
            inherited[EXTERNAL_NETNS_KEY] = os.open("/proc/self/ns/net", os.O_RDONLY)
        args = ["restore", "-D", str(images), "-W", str(work), "-o", log, "--pidfile", str(pidfile),
                *self.options.args(),
                *(argument for key, fd in inherited.items() for argument in ("--inherit-fd", f"fd[{fd}]:{key}")),
                *_log_level()]
        # CRIU_THP_FILL: this project's CRIU fills private memory into huge pages where the host's THP
        # mode is "madvise"; CRIU_FILL_THREADS: on that many more threads per process (a stock CRIU
        # ignores both).
        thp_fill, fill_threads = thp_fill_wanted(), fill_threads_wanted()
        env = criu_environment({**os.environ, "CRIU_THP_FILL": "1" if thp_fill else "0",
                                "CRIU_FILL_THREADS": str(fill_threads)})
        pending = PendingRestore(work / log, timeout, thp_fill, fill_threads)
        try:
            if replica:
                pending.launch_replica(self.criu.path, images, state.pids[0], args, inherited, own_images, env,
                                       before_unlock, state.shm)
            else:
                pending.done = self._restore_here(args + ["-d"], work / log, pidfile, timeout, inherited, env), {}
        except BaseException:
            pending.abandon()
            raise
        finally:
            for fd in inherited.values():  # (the child has its own copies)
                os.close(fd)
        return pending

    def _restore_here(self, args: list[str], log: Path, pidfile: Path, timeout: float,
                      inherited: dict[str, int], env: dict[str, str]) -> int:
        result = self.criu._run("restore", args, timeout=timeout, pass_fds=tuple(inherited.values()), env=env)
        if result.returncode != 0:
            raise CriuError("restore", result.returncode, _log_tail(log) or _tail(result.stderr))
        try:
            return int(pidfile.read_text().strip())
        except (OSError, ValueError):
            raise CriuError("restore", None, f"CRIU reported success but wrote no pid to {pidfile}") from None


class PendingRestore:
    """A CRIU restore under way (:meth:`CriuSnapshotter.start_restore`). A replica's CRIU runs as the first
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
        self._hold: _UnlockHold | None = None
        self._before_unlock: Callable[[], None] | None = None

    def launch_replica(self, criu: str, images: Path, root_pid: int, args: list[str], inherited: dict[str, int],
                       own_images: bool, env: dict[str, str], before_unlock: Callable[[], None] | None,
                       shm: list[str]) -> None:
        unshare = shutil.which("unshare")
        if unshare is None:
            raise CriuError("restore", None, "no unshare (util-linux) on PATH: a replica restore needs it")
        if before_unlock is not None:
            self._hold = _UnlockHold(self.log.parent).__enter__()
            self._before_unlock = before_unlock
            args = [*args, "--action-script", str(self._hold.script)]
            env = {**env, UNLOCK_HOLD_ENV: str(self.log.parent)}
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
            self.launcher = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                             stderr=subprocess.PIPE, pass_fds=tuple(inherited.values()),
                                             start_new_session=True, env=env)
        except OSError as exc:
            raise CriuError("restore", exc.errno, str(exc)) from None

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
            _kill_replica(launcher)
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
            status = _kill_replica(launcher)
        stderr = launcher.stderr.read().decode(errors="replace") if read_stderr else ""
        launcher.stdout.close()
        launcher.stderr.close()
        return status, stderr

    def _await_replica(self) -> tuple[int, dict[int, int]]:
        """The root's pid on this host and every restored pid's host pid by its captured one."""
        from coldsnap.snapshot import process_tree
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
            raise CriuError("restore", status, _log_tail(self.log) or _tail(stderr) or
                            f"timed out after {self.deadline - self.started:.0f} s")
        launcher.stdout.close()
        launcher.stderr.close()
        self.launcher = None  # the tree is on its own now: abandon() no longer kills it
        # unshare → pid 1 (the reaper) → the restored root: the pids as this host sees them.
        init = _children(launcher.pid)
        roots = _children(init[0]) if init else []
        if not roots:
            os.killpg(launcher.pid, signal.SIGKILL)
            raise CriuError("restore", None, "CRIU reported the tree restored, but its root is gone")
        pids = {process_tree.namespace_pid(pid): pid for pid in process_tree.tree_pids(roots[0])}
        return roots[0], pids


def _kill_replica(launcher: "subprocess.Popen[bytes]") -> int:
    """``unshare``, the namespace's pid 1 (CRIU, or the reaper) and whatever was restored so far, killed and
    waited for; returns unshare's status. Killed, ``unshare`` exits at once, not after its child: returning
    then would leave pid 1 and the namespace exiting, the tree's ports still bound for a moment."""
    from coldsnap.snapshot.process_tree import kill_tree

    kill_tree(launcher.pid)
    return launcher.wait()


UNLOCK_HOLD_ENV = "COLDSNAP_UNLOCK_HOLD"
UNLOCK_HOLD_SCRIPT = """#!/bin/sh
# CRIU's action script of a held restore (coldsnap.snapshot.criu): at post-restore, with the tree restored
# and its TCP connections still in repair mode, tell the launcher and wait for its word.
[ "$CRTOOLS_SCRIPT_ACTION" = post-restore ] || exit 0
echo restored > "$COLDSNAP_UNLOCK_HOLD/unlock-restored"
read -r answer < "$COLDSNAP_UNLOCK_HOLD/unlock-go"
[ "$answer" = go ]
"""
"""Two FIFOs in CRIU's work directory: ``unlock-restored`` (the script says the tree is back) and ``unlock-go``
(the launcher says ``go`` or ``abort``). The launcher holds both open for reading and writing from before CRIU
starts, so neither side's open blocks; if the launcher dies, the script reads end of file and fails, and CRIU
kills the tree."""


class _UnlockHold:
    """The FIFOs and the script of :data:`UNLOCK_HOLD_SCRIPT` in ``work``, removed on exit."""

    def __init__(self, work: Path):
        self.script = work / "unlock-hold.sh"
        self.paths = [work / "unlock-restored", work / "unlock-go"]
        self.restored = self.go = -1

    def __enter__(self) -> "_UnlockHold":
        try:
            for path in self.paths:
                path.unlink(missing_ok=True)
                os.mkfifo(path, 0o600)
            self.restored, self.go = (os.open(path, os.O_RDWR | os.O_NONBLOCK) for path in self.paths)
            self.script.write_text(UNLOCK_HOLD_SCRIPT)
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


KEPT_RESTORE_LOGS = 8
"""CRIU restore logs kept per state directory: a host restoring one replica all day keeps the latest."""


def _drop_old_logs(folder: Path, pattern: str, keep: int) -> None:
    """All but the ``keep`` newest files matching ``pattern`` in ``folder`` removed (best effort)."""
    try:
        logs = sorted(folder.glob(pattern), key=lambda p: p.stat().st_mtime_ns, reverse=True)
    except OSError:
        return
    for old in logs[keep:]:
        old.unlink(missing_ok=True)


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as handle:
            return [int(child) for child in handle.read().split()]
    except OSError:
        return []


def _log_level() -> list[str]:
    """``COLDSNAP_CRIU_LOG_LEVEL=4`` (0-4) makes CRIU's logs verbose and timestamped, for diagnosing
    where a dump or restore spends its time; unset, CRIU's default (warnings and errors)."""
    level = SETTINGS.choice("COLDSNAP_CRIU_LOG_LEVEL")
    return [f"-v{level}"] if level is not None else []

"""The CRIU executable: where it is, its version and ``criu check`` verdict (kept per boot), the environment of
its runs, the page-fill policy of restores, and the typed error of every CRIU run.

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
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from coldsnap.settings import SETTINGS

__all__ = [
    "CHECK_CACHE",
    "Criu",
    "CriuCheck",
    "CriuError",
    "CriuVersion",
    "FILL_THREADS_ENV",
    "FILL_THREADS_MAX",
    "KDAT_DIR_ENV",
    "KDAT_FOLDER",
    "MINIMUM_VERSION",
    "THP_FILL_ENV",
    "checked_criu",
    "criu_environment",
    "fill_threads_wanted",
    "find_criu",
    "log_file_tail",
    "output_tail",
    "reports_free_pages",
    "thp_fill_wanted",
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


def output_tail(text: str, lines: int = 20) -> str:
    """The last ``lines`` lines of CRIU's output, less the harmless ones."""
    kept = [line for line in text.splitlines() if not _HARMLESS.search(line)]
    return "\n".join(kept[-lines:])


def log_file_tail(path: Path) -> str:
    """:func:`output_tail` of a CRIU log file; empty when it cannot be read."""
    try:
        return output_tail(path.read_text(errors="replace"))
    except OSError:
        return ""


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

    def run(self, op: str, args: list[str], timeout: float, pass_fds: tuple[int, ...] = (),
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """``criu ARGS`` (``op`` names it in a :class:`CriuError`), in :func:`criu_environment`."""
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
        result = self.run("--version", ["--version"], timeout=30)
        match = re.search(r"Version:\s*([0-9]+(?:\.[0-9]+)*)", result.stdout)
        if result.returncode != 0 or not match:
            raise CriuError("--version", result.returncode, output_tail(result.stdout + result.stderr))
        gitid = re.search(r"GitID:\s*(\S+)", result.stdout)
        return CriuVersion(tuple(int(p) for p in match.group(1).split(".")), gitid.group(1) if gitid else "")

    def check(self) -> CriuCheck:
        """Run ``criu check`` (needs root); never raises for a failed check, only for a missing binary."""
        result = self.run("check", ["check"], timeout=60)
        output = output_tail(result.stdout + result.stderr)
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


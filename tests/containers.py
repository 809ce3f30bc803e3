"""coldsnap's reference image built and run in a container storage of a test's own (issue 30).

:func:`private_storage` gives a :class:`ContainerStorage`: buildah and podman on vfs storage in one
folder (graph root, run root, podman's state), with coldsnap's containers.conf
(``scripts/install-containers.sh``). :meth:`~ContainerStorage.build_reference_image` runs
``scripts/build-reference-image.sh`` into it; :meth:`~ContainerStorage.run_steps` runs
``tests/integration/container_steps.py`` (cold start, capture, restore of the reference workload) in a
privileged container with a host folder at ``/data``, so a capture of one container restores in another.
Leaving the ``with`` removes every container, image and file it made; only the base's tar, which
``build-reference-image.sh`` keeps in build/containers/ for the next build, stays.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parents[1]
STEPS = ROOT / "tests" / "integration" / "container_steps.py"
REFERENCE_IMAGE = "localhost/coldsnap-reference:test"
TOOLS = ("buildah", "podman", "runc", "debootstrap", "git")


def containers_env() -> dict[str, str]:
    """CONTAINERS_CONF and CONTAINERS_STORAGE_CONF as scripts/install-containers.sh writes them."""
    printed = subprocess.run(["bash", str(ROOT / "scripts" / "install-containers.sh"), "--print-env"],
                             capture_output=True, text=True, check=True).stdout
    env = {}
    for line in printed.splitlines():
        name, _, value = line.removeprefix("export ").partition("=")
        env[name] = shlex.split(value)[0]
    return env


def missing_tools() -> str | None:
    """Why images cannot be built and run here, or None."""
    if os.geteuid() != 0:
        return "building and running images with CRIU needs root"
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not installed: run scripts/install-containers.sh"
    if not Path(containers_env()["CONTAINERS_CONF"]).exists():
        return "no containers.conf: run scripts/install-containers.sh"
    return None


class ContainerStorage:
    """buildah and podman on vfs storage under ``folder`` (nothing of it in the host's default storage)."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.graph_root = folder / "storage"
        self.run_root = folder / "run"
        self.env = {**os.environ, **containers_env()}

    def _storage_flags(self) -> list[str]:
        return ["--storage-driver", "vfs", "--root", str(self.graph_root), "--runroot", str(self.run_root)]

    def podman(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
        command = ["podman", *self._storage_flags(), "--tmpdir", str(self.folder / "libpod"),
                   "--events-backend", "none", *args]
        done = subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise RuntimeError(f"{shlex.join(command)} exited {done.returncode}:\n{done.stdout}{done.stderr}")
        return done

    def build_reference_image(self, tag: str = REFERENCE_IMAGE, python: str = sys.executable,
                              timeout: float = 900) -> str:
        """``scripts/build-reference-image.sh`` into this storage (its base too); the image's id."""
        command = ["bash", str(ROOT / "scripts" / "build-reference-image.sh"), "--tag", tag, "--python", python,
                   "--root", str(self.graph_root), "--runroot", str(self.run_root)]
        # Its own session: an interrupted or timed-out build is stopped whole (debootstrap, pip, buildah),
        # and TERM lets the script remove its build folder.
        process = subprocess.Popen(command, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   start_new_session=True)
        try:
            out, err = process.communicate(timeout=timeout)
        except BaseException:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            raise
        sys.stderr.write(err)  # the script's progress and timings (shown by pytest -s, or on failure)
        if process.returncode != 0:
            raise RuntimeError(f"{shlex.join(command)} exited {process.returncode}:\n{err[-4000:]}")
        return out.strip().splitlines()[-1]

    def run(self, image: str, command: list[str], mounts: dict[Path, str] | None = None, hostname: str = "coldsnap",
            timeout: float = 600, network: str = "none", env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """``podman run --rm --privileged --network none`` of ``command`` in ``image``, host folders bound
        read-write at their targets (``target:ro`` binds read-only). --privileged: CRIU needs the
        capabilities, no seccomp filter and an unmasked /proc (docs/images.md). --network none: the
        workload serves on the container's own loopback; ``network="host"`` for one that reaches a
        registry on the host's loopback."""
        volumes = [arg for host, target in (mounts or {}).items() for arg in ("--volume", f"{host}:{target}")]
        variables = [arg for name, value in (env or {}).items() for arg in ("--env", f"{name}={value}")]
        return self.podman("run", "--rm", "--privileged", "--network", network, "--hostname", hostname, *volumes,
                           *variables, image, *command, timeout=timeout, check=False)

    def run_steps(self, image: str, data: Path, *steps: str, hostname: str, network: str = "none",
                  mounts: dict[Path, str] | None = None, env: dict[str, str] | None = None) -> dict[str, Any]:
        """tests/integration/container_steps.py's ``steps`` in a container of ``image``, ``data`` at /data
        (plus ``mounts``, ``env``, ``network`` as for :meth:`run`); the JSON results found in ``data``
        afterwards, by file stem. Raises with the container's output when a step fails."""
        data.mkdir(parents=True, exist_ok=True)
        done = self.run(image, ["python", "/opt/container_steps.py", "/data", *steps],
                        {data: "/data", STEPS: "/opt/container_steps.py:ro", **(mounts or {})}, hostname=hostname,
                        network=network, env=env)
        if done.returncode != 0:
            raise RuntimeError(f"container steps {steps} exited {done.returncode}:\n{done.stdout}{done.stderr[-6000:]}")
        return {path.stem: json.loads(path.read_text()) for path in data.glob("*.json")}

    def remove(self) -> None:
        """Every container of this storage (stopped, its mounts gone), then the folder with every image
        (vfs keeps them as plain folders there: deleting it is all ``podman rmi`` would do, at once)."""
        if self.graph_root.exists():
            self.podman("rm", "--all", "--force", "--time", "0", check=False)
        # A container's /dev/shm stays mounted under the graph root if its podman was killed.
        mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()
                  if line.split()[1].startswith(str(self.folder) + "/")]
        for mount in sorted(mounts, reverse=True):
            subprocess.run(["umount", "--lazy", mount], check=False)
        shutil.rmtree(self.folder, ignore_errors=True)
        if self.folder.exists():
            raise RuntimeError(f"could not remove {self.folder}")


@contextlib.contextmanager
def private_storage(parent: str | None = None) -> Iterator[ContainerStorage]:
    """A fresh :class:`ContainerStorage` in a new folder under ``parent`` (default: the temporary
    folder), removed with everything in it on exit, failed or not."""
    storage = ContainerStorage(Path(tempfile.mkdtemp(prefix="coldsnap-images-", dir=parent)))
    try:
        yield storage
    finally:
        storage.remove()

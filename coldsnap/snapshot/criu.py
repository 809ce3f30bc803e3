"""CRIU, behind one module with a typed error.

coldsnap needs CRIU >= 4.2 on current kernels: 3.17 fails on the vDSO layout of 6.x kernels and 4.1.1
cannot dump TCP sockets on kernels >= 6.16 (checkpoint-restore/criu#2705, #2718). ``scripts/install-criu.sh``
installs 4.2.1 into a private prefix with a ``criu`` wrapper.

The binary is found through ``COLDSNAP_CRIU`` (a path), else ``criu`` on ``PATH``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass

__all__ = ["CriuError", "Criu", "CriuCheck", "find_criu", "MINIMUM_VERSION"]

MINIMUM_VERSION = (4, 2)

# Printed by every run inside containers with a low hard limit; it does not affect the result.
_HARMLESS = re.compile(r"rlimit: Can't setup RLIMIT_NOFILE for self")


class CriuError(RuntimeError):
    """A CRIU invocation failed. ``op`` is the CRIU action, ``errno`` its exit status or OS errno."""

    def __init__(self, op: str, errno: int | None, log_tail: str):
        self.op = op
        self.errno = errno
        self.log_tail = log_tail
        status = f" (status {errno})" if errno is not None else ""
        tail = f": {log_tail.strip().splitlines()[-1]}" if log_tail.strip() else ""
        super().__init__(f"criu {op} failed{status}{tail}")


@dataclass(frozen=True)
class CriuCheck:
    """Verdict of ``criu check``."""

    ok: bool
    output: str


def _tail(text: str, lines: int = 20) -> str:
    kept = [line for line in text.splitlines() if not _HARMLESS.search(line)]
    return "\n".join(kept[-lines:])


def find_criu() -> str | None:
    """Path of the CRIU executable coldsnap will use, or ``None``."""
    explicit = os.environ.get("COLDSNAP_CRIU")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    return shutil.which("criu")


class Criu:
    """One CRIU executable."""

    def __init__(self, path: str | None = None):
        found = path or find_criu()
        if found is None:
            where = os.environ.get("COLDSNAP_CRIU")
            hint = f"COLDSNAP_CRIU={where} is not executable" if where else "no criu on PATH and COLDSNAP_CRIU unset"
            raise CriuError("locate", None, f"{hint}; install it with scripts/install-criu.sh")
        self.path = found

    def _run(self, op: str, args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        try:
            return subprocess.run(
                [self.path, *args], capture_output=True, text=True, timeout=timeout, check=False
            )
        except OSError as exc:
            raise CriuError(op, exc.errno, str(exc)) from None
        except subprocess.TimeoutExpired:
            raise CriuError(op, None, f"timed out after {timeout:.0f} s") from None

    def version(self) -> tuple[int, ...]:
        """``(major, minor[, sublevel])`` from ``criu --version``."""
        result = self._run("--version", ["--version"], timeout=30)
        match = re.search(r"Version:\s*([0-9]+(?:\.[0-9]+)*)", result.stdout)
        if result.returncode != 0 or not match:
            raise CriuError("--version", result.returncode, _tail(result.stdout + result.stderr))
        return tuple(int(p) for p in match.group(1).split("."))

    def check(self) -> CriuCheck:
        """Run ``criu check`` (needs root); never raises for a failed check, only for a missing binary."""
        result = self._run("check", ["check"], timeout=60)
        output = _tail(result.stdout + result.stderr)
        return CriuCheck(ok=result.returncode == 0 and "Looks good" in result.stdout + result.stderr, output=output)

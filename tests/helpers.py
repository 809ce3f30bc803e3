"""Small helpers the integration tests share: a free port, the CLI run for its receipt, an artifact's bytes."""

from __future__ import annotations

import hashlib
import json
import socket
import subprocess
import sys
from pathlib import Path

__all__ = ["free_port", "coldsnap_receipt", "file_digests"]


def free_port() -> int:
    """A TCP port nothing listens on now (the kernel's pick for an ephemeral bind on the loopback)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def coldsnap_receipt(command: str, *args: str, env: dict | None = None,
                     timeout: float = 300) -> tuple[subprocess.CompletedProcess, dict]:
    """``coldsnap COMMAND --receipt-json - ARGS...`` in a new process: the finished process (text) and the
    receipt it wrote on stdout (``{}`` when it wrote none)."""
    done = subprocess.run([sys.executable, "-m", "coldsnap", command, "--receipt-json", "-", *args],
                          capture_output=True, text=True, timeout=timeout, env=env)
    return done, json.loads(done.stdout) if done.stdout.strip() else {}


def file_digests(root: Path) -> dict[str, str]:
    """Every file under ``root`` by relative path → its SHA-256: equal before and after means not a byte
    was written, added or removed."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*"))
            if p.is_file()}

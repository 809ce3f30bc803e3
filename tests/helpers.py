"""Small helpers the tests share: a free port, the CLI run for its receipt, an artifact's bytes, ranks run against
a real activation coordinator."""

from __future__ import annotations

import hashlib
import json
import random
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable

__all__ = ["free_port", "coldsnap_receipt", "file_digests", "run_ranks_with_coordinator"]


def free_port() -> int:
    """A TCP port free now, below the kernel's ephemeral range: a test captures a server on it and restores
    the server on it later, and a port of that range can be taken in between as the local end of any
    process's outgoing connection (then the restore's admission rightly says the port is taken)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    while True:
        port = random.randrange(10000, low - 1)
        if _bindable(port) and _bindable(port + 1):  # (a replica's neighbour too)
            return port


def _bindable(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("0.0.0.0", port))
        except OSError:
            return False
        return True


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


def run_ranks_with_coordinator(token: bytes, world: int, work: Callable[[int, object], None],
                               timeout: float = 30) -> list[tuple[int, Exception]]:
    """``work(rank, client)`` for every rank at once, each on its own thread with its own client of one real
    activation coordinator (the barriers and key exchange the engines' teardowns use); the exceptions the
    ranks raised, by rank."""
    from coldsnap.coord import Coordinator, CoordinatorClient

    server = Coordinator("127.0.0.1:0", token, world, ttl=60)
    serving = threading.Thread(target=server.serve, daemon=True)
    serving.start()
    errors: list[tuple[int, Exception]] = []

    def rank(r: int) -> None:
        try:
            with CoordinatorClient(server.endpoint, token, r) as client:
                work(r, client)
        except Exception as exc:  # collected, asserted by the caller
            errors.append((r, exc))

    ranks = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for thread in ranks:
        thread.start()
    for thread in ranks:
        thread.join(timeout)
    server.stop()
    serving.join(5)
    return errors

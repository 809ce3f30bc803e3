"""CRIU's page fill: a restore with the project's huge-page fill against CRIU's 4 KiB fill, one image.

    python -m benchmarks.criu_fill --mib 2048 --repeat 3 --out criu-fill.json

One process (``tests/integration/thp_fill_workload.py``) maps MIB MiB of private anonymous memory: the
first half written with bytes that are not zero, the second half with zeros, which the compacted image
leaves out (as the zeros of an engine's parked device state). It is dumped once; then restored
``--repeat`` times with ``CRIU_THP_FILL`` on and off, alternating. Per restore: CRIU's wall time (the
whole `criu restore`), the first pass reading a byte of every page afterwards (what the CUDA driver does
with the device state it parked in host memory: pages the image left out fault in one by one unless the
fill mapped them), the mapping's huge pages, and its SHA-256 (must equal the dumped one). Needs root and
the CRIU of ``scripts/install-criu.sh``; writes JSON, prints a table. Images in a temporary folder,
removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from coldsnap.snapshot.criu import CriuSnapshotter  # noqa: E402
from coldsnap.snapshot.criu_binary import THP_FILL_ENV, Criu  # noqa: E402
from coldsnap.snapshot.process_tree import kill_tree  # noqa: E402
from coldsnap.snapshot.thp import thp_mode  # noqa: E402

MODES = {"huge-page fill": "1", "4 KiB fill": "0"}


def ask(port: int, command: bytes, timeout: float = 600) -> str:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=timeout) as connection:
                connection.sendall(command + b"\n")
                return connection.recv(256).decode().strip()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def anon_huge_kib(pid: int, start: int) -> int:
    with open(f"/proc/{pid}/smaps") as smaps:
        inside = False
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                inside = int(head.split("-")[0], 16) == start
            elif inside and line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    return 0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=2048, help="the mapping's size (default 2048; half zeros)")
    parser.add_argument("--repeat", type=int, default=3, help="restores per fill mode (default 3)")
    parser.add_argument("--out", help="write the JSON here too")
    args = parser.parse_args()
    if os.geteuid() != 0:
        parser.error("needs root (CRIU)")
    version = Criu().version()
    port = free_port()
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="coldsnap-criu-fill-") as scratch:
        work = Path(scratch)
        process = subprocess.Popen([sys.executable, "-m", "tests.integration.thp_fill_workload", str(port), str(args.mib)],
                                   cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL, start_new_session=True)
        roots = [process.pid]
        try:
            digest, start = ask(port, b"digest").split()
            snapshotter = CriuSnapshotter()
            dump = snapshotter.dump(process.pid, work / "images")
            process.wait(timeout=60)
            for index in range(args.repeat * len(MODES)):
                label, value = list(MODES.items())[index % len(MODES)]
                os.environ[THP_FILL_ENV] = value
                restored = snapshotter.restore(work / "images", work / f"state-{index}", replica=False)
                roots.append(restored.pid)
                read_s = float(ask(port, b"read"))
                runs.append({"fill": label, "criu_restore_s": round(restored.seconds, 3), "first_read_s": round(read_s, 3),
                             "anon_huge_mib": anon_huge_kib(restored.pid, int(start, 16)) // 1024,
                             "same_memory": ask(port, b"digest") == f"{digest} {start}"})
                print(json.dumps(runs[-1]), flush=True)
                kill_tree(restored.pid)
        finally:
            os.environ.pop(THP_FILL_ENV, None)
            for root in roots:
                kill_tree(root)
    summary = {label: {key: statistics.median(r[key] for r in runs if r["fill"] == label)
                       for key in ("criu_restore_s", "first_read_s")} for label in MODES}
    result = {"benchmark": "criu_fill", "mib": args.mib, "criu": str(version), "host_thp": thp_mode(),
              "cpus": os.cpu_count(), "image_bytes": dump.image_bytes,
              "zero_bytes_left_out": dump.census.dropped_bytes if dump.census else None, "runs": runs, "summary": summary}
    print(f"CRIU fill, {args.mib} MiB mapping (half zeros, left out of the {dump.image_bytes / 2**20:.0f} MiB image), "
          f"{version}, host THP {result['host_thp']}, medians of {args.repeat}:")
    for label, values in summary.items():
        print(f"  {label:<15} criu restore {values['criu_restore_s']:>6.3f} s   first read of every page "
              f"{values['first_read_s']:>6.3f} s")
    print(f"  same memory after every restore: {all(r['same_memory'] for r in runs)}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if all(r["same_memory"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())

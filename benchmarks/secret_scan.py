"""The secret scan's rate (``coldsnap validate secrets`` / the scan before ``coldsnap publish``), on a real
artifact's files and on a page image of a GPU capsule's size built from them.

    python -m benchmarks.secret_scan --artifact DIR --out benchmarks/results/2026-12-07-vllm-cpu-secret-scan [--gpu-sized-gib 2.7]

For each: the scan on one thread and on every CPU, page cache warm (a publish follows the capture or the pull
that just wrote the files), repeated (--repeats, the median kept). The goal (issue: ≥ 1 GB/s per core, an 8B
capsule's ~2.7 GB of images ≤ 2 s more per publish) is read off the table. Writes scan.json, scan.md and
scan.png (without matplotlib: no PNG). The GPU-sized image is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
from pathlib import Path

from benchmarks.common import pyplot
from coldsnap.secrets.scan import SecretScanner, scan_artifact, secret_values


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.name.endswith(".pack"))


def _measure(root: Path, files: list[Path], threads: int, repeats: int, scanner: SecretScanner) -> dict:
    rates, seconds, findings, size = [], [], 0, 0
    scan_artifact(root, scanner, threads=threads, files=files)  # page cache warm
    for _ in range(repeats):
        report = scan_artifact(root, scanner, threads=threads, files=files)
        rates.append(report.bytes_per_second)
        seconds.append(report.seconds)
        findings, size = len(report.findings), report.bytes_scanned
    return {"threads": threads, "bytes": size, "files": len(files), "seconds_median": round(statistics.median(seconds), 4),
            "gb_per_s_median": round(statistics.median(rates) / 1e9, 3),
            "gb_per_s_per_core": round(statistics.median(rates) / 1e9 / threads, 3), "findings": findings}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", type=Path, required=True, help="a committed artifact directory")
    parser.add_argument("--out", type=Path, required=True, help="results folder")
    parser.add_argument("--gpu-sized-gib", type=float, default=2.7, help="size of the built page image (0: none)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if not (args.artifact / "artifact.json").is_file():
        parser.error(f"{args.artifact} holds no artifact.json")
    args.out.mkdir(parents=True, exist_ok=True)
    scanner = SecretScanner(secret_values())
    cores = len(os.sched_getaffinity(0))
    rows = []
    files = _files(args.artifact)
    for threads in sorted({1, cores}):
        rows.append({"data": f"artifact ({args.artifact.name})", **_measure(args.artifact, files, threads, args.repeats,
                                                                             scanner)})
    if args.gpu_sized_gib > 0:
        pages = [p for p in files if p.name.startswith("pages-")]
        with tempfile.TemporaryDirectory(prefix="scan-bench-", dir=args.out) as scratch:
            image = Path(scratch) / "pages-1.img"
            target = int(args.gpu_sized_gib * 2**30)
            with open(image, "wb") as out:
                while out.tell() < target:
                    for page in pages:
                        out.write(page.read_bytes()[: target - out.tell()])
                        if out.tell() >= target:
                            break
            for threads in sorted({1, cores}):
                rows.append({"data": f"one {args.gpu_sized_gib} GiB page image", **_measure(Path(scratch), [image], threads,
                                                                                           args.repeats, scanner)})
    document = {"host": platform.node(), "cpus": cores, "cpu": platform.processor() or platform.machine(), "rows": rows,
                "values_searched": len(scanner.values)}
    (args.out / "scan.json").write_text(json.dumps(document, indent=2) + "\n")
    table = ["| data | threads | MiB | seconds | GB/s | GB/s per core | findings |", "|---|---|---|---|---|---|---|"]
    table += [f"| {r['data']} | {r['threads']} | {r['bytes'] / 2**20:.0f} | {r['seconds_median']:.3f} | "
              f"{r['gb_per_s_median']:.2f} | {r['gb_per_s_per_core']:.2f} | {r['findings']} |" for r in rows]
    (args.out / "scan.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))
    plt = pyplot()
    if plt is not None:
        figure, axis = plt.subplots(figsize=(8, 0.6 + 0.5 * len(rows)))
        labels = [f"{r['data']}, {r['threads']} thread(s)" for r in rows]
        axis.barh(labels, [r["gb_per_s_median"] for r in rows], color="#1f77b4")
        axis.axvline(1.0, color="#d62728", linestyle="--", label="goal: 1 GB/s per core")
        for y, r in enumerate(rows):
            axis.text(r["gb_per_s_median"], y, f" {r['gb_per_s_median']:.2f} GB/s", va="center", fontsize=8)
        axis.invert_yaxis()
        axis.set_xlabel("GB/s, median of the repeats, page cache warm")
        axis.set_title(f"secret scan (Hyperscan), {cores}-CPU host", fontsize=9)
        axis.legend(fontsize=7)
        figure.tight_layout()
        figure.savefig(args.out / "scan.png", dpi=120)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

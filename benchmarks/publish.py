"""Publish and pull of a real artifact through a real registry, beside ``cp`` of the same bytes on the same disk.

    python -m benchmarks.publish --size 1b --dir WORK --out publish.json [--png publish.png] [--plain-http]
    python -m benchmarks.publish --png-from publish.json --png publish.png     # the chart, where matplotlib is

Captures the reference workload (``--size 1b`` on CPU: a ~5 GB float32 pack; or ``--artifact DIR`` reuses
one), starts Debian's ``docker-registry`` on localhost (TLS and basic auth unless ``--plain-http``; storage
under WORK, on the same disk as the artifact), then measures, in one run:

- ``cp`` of the artifact's files (its bytes, the pack first) into WORK, and the same followed by ``sync`` of
  the copies (the registry's files and a pull's reach the disk at their own pace: both bounds are shown);
- ``coldsnap publish`` (process exec → exit), then a second publish (what it sends: only the index);
- ``coldsnap pull`` into a new directory (exec → exit, verified, atomically renamed), and how much of the
  pulled pack is in the page cache when it returns (``fincore``);
- ``coldsnap restore oci://REF`` under a second state root, from the pull's cache (exec → the canary's
  match), and the cold start of the same workload (process start → first token).

Throughput = the artifact's bytes / seconds. Writes JSON, prints a table, draws a bar chart when
matplotlib is installed. Needs root (CRIU), torch, and scripts/install-registry.sh's tools.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


from coldsnap.demo import cold_start  # noqa: E402
from benchmarks.fresh_node import artifact_files, coldsnap, copy_files  # noqa: E402
from tests.registry_server import local_registry, missing_tools  # noqa: E402


def log(text: str) -> None:
    print(f"publish-bench: {text}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def resident_fraction(path: Path) -> float | None:
    """How much of ``path`` is in the page cache (util-linux ``fincore``)."""
    done = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
                          capture_output=True, text=True)
    try:
        return int(done.stdout.split()[0]) / path.stat().st_size
    except (ValueError, IndexError, ZeroDivisionError):
        return None


def capture(size: str, work: Path) -> tuple[Path, int, float, list[int]]:
    port = free_port()
    command = [sys.executable, "-m", "coldsnap.workloads.torch_lm", "--size", size, "--device", "cpu", "--port", str(port)]
    log(f"cold start of the {size} reference workload")
    cold_seconds, tokens = cold_start(command, port)
    artifact = work / "artifact"
    shutil.rmtree(artifact, ignore_errors=True)
    log("capture")
    coldsnap("capture", "--out", str(artifact), "--", *command, env={"COLDSNAP_STATE_DIR": str(work / "state-capture")})
    return artifact, port, cold_seconds, tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="1b", choices=["tiny", "1b"], help="reference workload size (default 1b)")
    parser.add_argument("--artifact", type=Path, help="reuse this artifact (its cold start is measured anyway)")
    parser.add_argument("--dir", type=Path, help="work folder (registry storage, copies, pulls)")
    parser.add_argument("--out", type=Path, help="JSON results")
    parser.add_argument("--png", type=Path, help="bar chart (needs matplotlib)")
    parser.add_argument("--plain-http", action="store_true", help="registry without TLS (COLDSNAP_PLAIN_HTTP_REGISTRIES)")
    parser.add_argument("--keep", action="store_true", help="keep WORK afterwards (default: remove what this run made)")
    parser.add_argument("--png-from", type=Path, metavar="JSON", help="only draw --png from an earlier run's JSON")
    args = parser.parse_args()
    if args.png_from:
        if not args.png:
            parser.error("--png-from needs --png")
        draw(json.loads(args.png_from.read_text()), args.png)
        return 0
    if not args.dir or not args.out:
        parser.error("--dir and --out are required")
    if os.geteuid() != 0:
        parser.error("needs root (CRIU)")
    if missing_tools():
        parser.error(f"needs {', '.join(missing_tools())}: bash scripts/install-registry.sh")
    work = args.dir.absolute()
    work.mkdir(parents=True, exist_ok=True)
    try:
        return run(args, work)
    finally:
        if not args.keep:
            for name in ("artifact", "copy", "pulled", "state-capture", "state-restore", "registry"):
                shutil.rmtree(work / name, ignore_errors=True)


def run(args: argparse.Namespace, work: Path) -> int:
    if args.artifact:
        artifact = args.artifact.absolute()
        descriptor = json.loads((artifact / "artifact.json").read_text())
        port = json.loads((artifact / "request.json").read_text())["units"][0]["serving_port"]
        command = [sys.executable, "-m", "coldsnap.workloads.torch_lm", "--size", args.size, "--device", "cpu",
                   "--port", str(port)]
        cold_seconds, tokens = cold_start(command, port)
    else:
        artifact, port, cold_seconds, tokens = capture(args.size, work)
        descriptor = json.loads((artifact / "artifact.json").read_text())
    files = artifact_files(artifact)
    total = sum(p.stat().st_size for p in files)
    pack = next((artifact / "payload").glob("*.pack"))
    log(f"artifact: {len(files)} files, {total / 1e9:.2f} GB (pack {pack.stat().st_size / 1e9:.2f} GB)")
    result: dict[str, Any] = {"benchmark": "publish", "size": args.size, "files": len(files), "artifact_bytes": total,
                              "pack_bytes": pack.stat().st_size, "tls": not args.plain_http, "cpus": os.cpu_count(),
                              "artifact_id": descriptor["artifact_id"], "cold_start_s": round(cold_seconds, 3)}
    subprocess.run(["sync"], check=True)
    result["cp_s"] = copy_files(files, artifact, work / "copy", sync=False)
    result["cp_sync_s"] = copy_files(files, artifact, work / "copy", sync=True)
    with local_registry(work / "registry", tls=not args.plain_http) as registry:
        env = registry.client_env()
        reference = f"{registry.address}/bench/{args.size}:v1"
        log("publish")
        seconds, done = coldsnap("publish", str(artifact), reference, "--json", env=env)
        first = json.loads(done.stdout)
        result["publish_s"], result["publish_bytes_sent"] = seconds, first["bytes_sent"]
        seconds, done = coldsnap("publish", str(artifact), reference, "--json", env=env)
        second = json.loads(done.stdout)
        result["republish_s"], result["republish_bytes_sent"] = seconds, second["bytes_sent"]
        result["republish_blobs_sent"], result["republish_manifests_sent"] = second["blobs_sent"], second["manifests_sent"]
        log("pull")
        pulled = work / "pulled"
        shutil.rmtree(pulled, ignore_errors=True)
        seconds, done = coldsnap("pull", first["reference"], str(pulled), "--json", env=env)
        result["pull_s"] = seconds
        result["pulled_pack_resident"] = resident_fraction(pulled / pack.relative_to(artifact))
        shutil.rmtree(pulled)
        log("restore oci:// (a second state root: its own pull, then the restore)")
        state = {**env, "COLDSNAP_STATE_DIR": str(work / "state-restore")}
        seconds, done = coldsnap("restore", f"oci://{first['reference']}", "--receipt-json", "-", env=state)
        receipt = json.loads(done.stdout)
        result["pull_and_restore_s"] = seconds
        restored = receipt["artifact"]
        _stop(receipt)
        seconds, done = coldsnap("restore", f"oci://{first['reference']}", "--receipt-json", "-", env=state)
        result["restore_from_cache_s"] = seconds
        result["restore_tokens_match"] = _tokens(port) == tokens
        _stop(json.loads(done.stdout))
        result["restored_artifact"] = restored
    for name in ("cp", "cp_sync", "publish", "pull"):
        result[f"{name}_gb_s"] = round(total / result[f"{name}_s"] / 1e9, 3)
    result["publish_vs_cp"] = round(result["cp_s"] / result["publish_s"], 3)
    result["pull_vs_cp"] = round(result["cp_s"] / result["pull_s"], 3)
    result["publish_vs_cp_sync"] = round(result["cp_sync_s"] / result["publish_s"], 3)
    result["pull_vs_cp_sync"] = round(result["cp_sync_s"] / result["pull_s"], 3)
    args.out.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    print(table(result))
    if args.png:
        draw(result, args.png)
    return 0


def _stop(receipt: dict) -> None:
    from coldsnap.contracts.receipt import restored_pid
    from coldsnap.snapshot.process_tree import kill_tree

    pid = restored_pid(receipt)
    if pid:
        kill_tree(pid)
        time.sleep(0.5)


def _tokens(port: int) -> list[int]:
    from coldsnap.activation.canary import ask_canary
    from coldsnap.demo import CHECK_PROMPT

    return ask_canary(port, CHECK_PROMPT, 8).token_ids


def table(r: dict) -> str:
    gb = r["artifact_bytes"] / 1e9
    rows = [("cp (page cache)", r["cp_s"], r["cp_gb_s"], "1.00"),
            ("cp + sync", r["cp_sync_s"], r["cp_sync_gb_s"], f"{r['cp_s'] / r['cp_sync_s']:.2f}"),
            ("coldsnap publish", r["publish_s"], r["publish_gb_s"], f"{r['publish_vs_cp']:.2f}"),
            ("coldsnap pull", r["pull_s"], r["pull_gb_s"], f"{r['pull_vs_cp']:.2f}")]
    lines = [f"{r['files']} files, {gb:.2f} GB (pack {r['pack_bytes'] / 1e9:.2f} GB), registry {'TLS + basic auth' if r['tls'] else 'plain HTTP'}, {r['cpus']} CPUs",
             "", "| step | s | GB/s | × cp |", "|---|---:|---:|---:|"]
    lines += [f"| {name} | {s:.2f} | {rate:.2f} | {ratio} |" for name, s, rate, ratio in rows]
    lines += ["", f"second publish: {r['republish_blobs_sent']} blobs, {r['republish_manifests_sent']} manifests, "
              f"{r['republish_bytes_sent']} bytes sent in {r['republish_s']:.2f} s",
              f"pulled pack in the page cache after the pull: {r['pulled_pack_resident']:.0%}" if r["pulled_pack_resident"] is not None else "",
              f"restore oci:// under a new state root (pull + restore): {r['pull_and_restore_s']:.2f} s; again from the "
              f"host's copy: {r['restore_from_cache_s']:.2f} s (tokens = cold start: {r['restore_tokens_match']}); "
              f"cold start {r['cold_start_s']:.2f} s"]
    return "\n".join(lines)


def draw(r: dict, png: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no PNG")
        return
    names = ["cp", "cp + sync", "publish", "pull"]
    rates = [r["cp_gb_s"], r["cp_sync_gb_s"], r["publish_gb_s"], r["pull_gb_s"]]
    figure, axis = plt.subplots(figsize=(6, 3.2))
    axis.bar(names, rates, color=["#999999", "#bbbbbb", "#3b75af", "#519e3e"])
    axis.axhline(0.7 * r["cp_gb_s"], color="#cc3333", linestyle="--", linewidth=1, label="0.7 × cp")
    axis.set_ylabel("GB/s")
    axis.set_title(f"{r['artifact_bytes'] / 1e9:.1f} GB artifact through a local registry "
                   f"({'TLS' if r['tls'] else 'HTTP'}, {r['cpus']} CPUs)", fontsize=9)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(png, dpi=120)


if __name__ == "__main__":
    sys.exit(main())

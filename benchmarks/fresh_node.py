"""A fresh node: `coldsnap restore oci://REF` on a host that holds nothing, and a restore from a cold local disk,
each beside the disk's own rates and `cp` of the same files, in one run.

    python -m benchmarks.fresh_node --size 1b --dir WORK --out DIR   # CPU: the reference workload, captured here
    # vLLM 8B on the H200: benchmarks/vllm_startup.py --steps fresh-node (the same measurements, its artifact)

What is measured (root: page-cache drops, CRIU):

- the disk: O_DIRECT write of 4 GiB (`dd oflag=direct`), O_DIRECT read of the pack after a page-cache drop by
  coldsnap's hydration engine (the rate a cold restore can read at) and by one `dd iflag=direct` stream;
- `cp` of the artifact's files (page cache warm), and the same followed by `sync`;
- `coldsnap publish` into Debian's `docker-registry` on loopback (plain HTTP, no auth: a registry on the node's
  own network), a second publish, and ``--repeat`` `coldsnap pull` into a new folder (exec → exit, verified);
- ``--repeat`` fresh-node restores: no copy on the host (a new state root), page cache dropped, `coldsnap restore
  oci://REF` from its exec to the canary's match (and to its exit, after the pull's last chunk, fsync and records);
- ``--repeat`` cold-disk restores of the local artifact, page cache dropped;
- the workload's cold start with the page cache dropped (CPU run; vllm_startup measures vLLM's).

The registry's storage is ``--registry-storage`` (default ``/dev/shm/coldsnap-fresh-registry``): in memory, so
a page-cache drop empties this node's cache but not the registry's, as with a registry on another machine.
Every restore's greedy tokens are compared with the cold start's. JSON into ``--out``/fresh-node.json, a table
into fresh-node.md, a chart into fresh-node.png where matplotlib is.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from benchmarks.common import drop_caches, pyplot, receipt_timeline

__all__ = ["artifact_files", "coldsnap", "copy_files", "disk_rates", "measure", "registry_rates", "restores"]


def log(text: str) -> None:
    print(f"fresh-node: {text}", file=sys.stderr, flush=True)


def coldsnap(*args: str, env: dict[str, str]) -> tuple[float, subprocess.CompletedProcess]:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "coldsnap", *args], capture_output=True, text=True,
                          env={**os.environ, **env})
    seconds = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"coldsnap {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return seconds, done


def artifact_files(root: Path) -> list[Path]:
    files = [p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".coldsnap-validation")]
    return sorted(files, key=lambda p: -p.stat().st_size)


def copy_files(files: list[Path], root: Path, target: Path, sync: bool) -> float:
    shutil.rmtree(target, ignore_errors=True)
    started = time.monotonic()
    for path in files:
        destination = target / path.relative_to(root)
        destination.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["cp", str(path), str(destination)], check=True)
    if sync:
        subprocess.run(["sync", "-f", str(target)], check=True)
    seconds = time.monotonic() - started
    shutil.rmtree(target)
    return seconds


def _dd_rate(*args: str) -> float:
    """GB/s as dd reports it (its last line: ``N bytes ... copied, S s, R GB/s``)."""
    done = subprocess.run(["dd", *args, "status=progress"], capture_output=True, text=True, check=True)
    line = [t for t in done.stderr.splitlines() if "copied" in t][-1]
    copied, seconds = int(line.split()[0]), float(line.split(",")[-2].split()[0])
    return round(copied / seconds / 1e9, 3)


def disk_rates(pack: Path, work: Path) -> dict[str, Any]:
    """The disk under ``work`` and ``pack``: O_DIRECT write (4 GiB) and O_DIRECT reads of the cold pack."""
    from coldsnap.hydrate import read_file

    probe = work / "disk-probe"
    rates: dict[str, Any] = {"odirect_write_gb_s": _dd_rate("if=/dev/zero", f"of={probe}", "bs=16M", "count=256",
                                                             "oflag=direct")}
    probe.unlink()
    drop_caches()
    stats = read_file(pack, direct=True)
    rates.update(odirect_read_gb_s=round(stats.gb_per_s, 3), odirect_read_threads=stats.threads,
                 odirect_read_used_direct=stats.direct)
    drop_caches()
    rates["dd_odirect_read_gb_s"] = _dd_rate(f"if={pack}", "of=/dev/null", "bs=16M", "iflag=direct")
    return rates


def registry_rates(artifact: Path, work: Path, registry: Any, repeat: int) -> tuple[dict[str, Any], str]:
    """cp, publish, second publish and pulls of the artifact; returns (results, the pinned reference)."""
    files = artifact_files(artifact)
    total = sum(p.stat().st_size for p in files)
    result: dict[str, Any] = {"artifact_bytes": total, "files": len(files)}
    subprocess.run(["sync"], check=True)
    result["cp_s"] = round(min(copy_files(files, artifact, work / "copy", sync=False) for _ in range(repeat)), 3)
    result["cp_sync_s"] = round(copy_files(files, artifact, work / "copy", sync=True), 3)
    env = registry.client_env()
    reference = f"{registry.address}/bench/fresh-node:v1"
    log("publish")
    seconds, done = coldsnap("publish", str(artifact), reference, "--json", env=env)
    first = json.loads(done.stdout)
    result["publish_s"], result["publish_bytes_sent"] = round(seconds, 3), first["bytes_sent"]
    seconds, done = coldsnap("publish", str(artifact), reference, "--json", env=env)
    second = json.loads(done.stdout)
    result["republish"] = {"s": round(seconds, 3), "bytes_sent": second["bytes_sent"], "blobs_sent": second["blobs_sent"]}
    pulls = []
    for n in range(repeat):
        pulled = work / "pulled"
        shutil.rmtree(pulled, ignore_errors=True)
        subprocess.run(["sync"], check=True)
        seconds, done = coldsnap("pull", first["reference"], str(pulled), "--json", env=env)
        pulls.append(round(seconds, 3))
        log(f"pull {n + 1}: {seconds:.2f} s ({total / seconds / 1e9:.2f} GB/s)")
        shutil.rmtree(pulled)
    result["pull_s"] = pulls
    result["pull_median_s"] = statistics.median(pulls)
    for name, seconds in (("cp", result["cp_s"]), ("cp_sync", result["cp_sync_s"]), ("publish", result["publish_s"]),
                          ("pull", result["pull_median_s"])):
        result[f"{name}_gb_s"] = round(total / seconds / 1e9, 3)
    result["pull_vs_cp"] = round(result["cp_s"] / result["pull_median_s"], 3)
    result["publish_vs_cp"] = round(result["cp_s"] / result["publish_s"], 3)
    return result, first["reference"]


def _restore(target: str, env: dict[str, str], work: Path, label: str, check: Callable[[], bool]) -> dict[str, Any]:
    receipt_path = work / f"{label}-{time.time_ns()}.json"
    exec_ns = time.time_ns()
    done = subprocess.run([sys.executable, "-m", "coldsnap", "restore", target, "--receipt-json", str(receipt_path)],
                          capture_output=True, text=True, env={**os.environ, **env})
    exit_ns = time.time_ns()
    if done.returncode != 0:
        raise SystemExit(f"{label}: restore failed:\n{done.stderr[-3000:]}")
    receipt = json.loads(receipt_path.read_text())
    try:
        same = check()
    finally:
        from coldsnap.contracts.receipt import restored_pid
        from coldsnap.snapshot.process_tree import kill_tree

        pid = restored_pid(receipt)
        if pid:
            kill_tree(pid)
        time.sleep(0.5)
    phases = receipt_timeline(receipt, exec_ns, exit_ns)
    staged = [s["attributes"] for s in receipt["timing"]["spans"] if s["name"].startswith("restore.stage_weights")]
    return {"seconds": phases.pop("exec → canary matched"), "exec_to_exit_s": round((exit_ns - exec_ns) / 1e9, 3),
            "same_tokens": same, "phases": phases, "staging": staged,
            "pull_line": next((line for line in done.stderr.splitlines() if "the pull finished" in line), None)}


def restores(artifact: Path, reference: str | None, registry_env: dict[str, str], work: Path, repeat: int,
             check: Callable[[], bool], env: dict[str, str] | None = None) -> dict[str, Any]:
    """``repeat`` fresh-node restores from ``reference`` (each: a new state root, page cache dropped) and ``repeat``
    cold-disk restores of ``artifact`` (page cache dropped)."""
    env = env or {}
    result: dict[str, Any] = {"fresh_node": [], "cold_disk": []}
    for n in range(repeat if reference else 0):
        state = work / "state-fresh"
        shutil.rmtree(state, ignore_errors=True)
        drop_caches()
        run = _restore(f"oci://{reference}", {**env, **registry_env, "COLDSNAP_STATE_DIR": str(state)}, work,
                       "fresh-node", check)
        log(f"fresh-node restore {n + 1}: {run['seconds']:.2f} s to the canary, {run['exec_to_exit_s']:.2f} s to exit")
        result["fresh_node"].append(run)
    shutil.rmtree(work / "state-fresh", ignore_errors=True)
    for n in range(repeat):
        drop_caches()
        run = _restore(str(artifact), env, work, "cold-disk", check)
        log(f"cold-disk restore {n + 1}: {run['seconds']:.2f} s")
        result["cold_disk"].append(run)
    for key in ("fresh_node", "cold_disk"):
        if result[key]:
            result[f"{key}_median_s"] = statistics.median(r["seconds"] for r in result[key])
    return result


def measure(artifact: Path, work: Path, registry_storage: Path, repeat: int, check: Callable[[], bool],
            env: dict[str, str] | None = None) -> dict[str, Any]:
    """Everything but the cold start: disk rates, registry rates, fresh-node and cold-disk restores."""
    from tests.registry_server import local_registry

    pack = max((artifact / "payload").glob("*.pack"), key=lambda p: p.stat().st_size)
    result: dict[str, Any] = {"cpus": os.cpu_count(), "pack_bytes": pack.stat().st_size}
    log("disk rates")
    result["disk"] = disk_rates(pack, work)
    with local_registry(registry_storage, tls=False, auth=False) as registry:
        rates, reference = registry_rates(artifact, work, registry, repeat)
        result["registry"] = rates
        result.update(restores(artifact, reference, registry.client_env(), work, repeat, check, env))
    result["pack_at_disk_rate_s"] = round(result["pack_bytes"] / (result["disk"]["odirect_read_gb_s"] * 1e9), 3)
    return result


def table(r: dict[str, Any]) -> str:
    g, d = r["registry"], r["disk"]
    gb = g["artifact_bytes"] / 1e9
    lines = [f"{g['files']} files, {gb:.2f} GB (pack {r['pack_bytes'] / 1e9:.2f} GB), {r['cpus']} CPUs; registry: "
             "Debian's docker-registry on loopback, plain HTTP, storage in memory", "",
             "| step | s | GB/s | × cp |", "|---|---:|---:|---:|",
             f"| cp (page cache warm) | {g['cp_s']:.2f} | {g['cp_gb_s']:.2f} | 1.00 |",
             f"| cp + sync | {g['cp_sync_s']:.2f} | {g['cp_sync_gb_s']:.2f} | {g['cp_s'] / g['cp_sync_s']:.2f} |",
             f"| coldsnap publish | {g['publish_s']:.2f} | {g['publish_gb_s']:.2f} | {g['publish_vs_cp']:.2f} |",
             f"| coldsnap pull (median of {len(g['pull_s'])}) | {g['pull_median_s']:.2f} | {g['pull_gb_s']:.2f} | "
             f"{g['pull_vs_cp']:.2f} |", "",
             f"disk: O_DIRECT write {d['odirect_write_gb_s']:.2f} GB/s; O_DIRECT read of the cold pack "
             f"{d['odirect_read_gb_s']:.2f} GB/s (coldsnap's engine, {d['odirect_read_threads']} threads), "
             f"{d['dd_odirect_read_gb_s']:.2f} GB/s (one dd stream); the pack at that rate: {r['pack_at_disk_rate_s']:.2f} s",
             f"second publish: {g['republish']['blobs_sent']} blobs, {g['republish']['bytes_sent']} bytes in "
             f"{g['republish']['s']:.2f} s", "", "| restore | runs (s, exec → canary) | median | exec → exit | same tokens |",
             "|---|---|---:|---|---|"]
    for key, name in (("fresh_node", "fresh node: `restore oci://`, nothing on the host, cache dropped"),
                      ("cold_disk", "cold disk: local artifact, cache dropped")):
        runs = r.get(key) or []
        if runs:
            canary = ", ".join(f"{x['seconds']:.2f}" for x in runs)
            exits = ", ".join(f"{x['exec_to_exit_s']:.2f}" for x in runs)
            same = all(x["same_tokens"] for x in runs)
            lines.append(f"| {name} | {canary} | {r[key + '_median_s']:.2f} | {exits} | {same} |")
    if "cold_start_s" in r:
        lines.append(f"| cold start of the workload, cache dropped | {r['cold_start_s']:.2f} | | | |")
    return "\n".join(lines)


def draw(r: dict[str, Any], png: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    g = r["registry"]
    figure, (rates, times) = plt.subplots(1, 2, figsize=(11, 3.4))
    names = ["cp", "cp+sync", "publish", "pull", "disk O_DIRECT read"]
    values = [g["cp_gb_s"], g["cp_sync_gb_s"], g["publish_gb_s"], g["pull_gb_s"], r["disk"]["odirect_read_gb_s"]]
    rates.bar(names, values, color=["#999999", "#bbbbbb", "#3b75af", "#519e3e", "#777777"])
    rates.axhline(0.8 * g["cp_gb_s"], color="#cc3333", linestyle="--", linewidth=1, label="0.8 × cp")
    rates.set_ylabel("GB/s")
    rates.legend(fontsize=8)
    rates.tick_params(axis="x", labelsize=7)
    labels, seconds = [], []
    for key, name in (("fresh_node_median_s", "fresh node\n(oci://, cold)"), ("cold_disk_median_s", "cold disk"),
                      ("cold_start_s", "cold start\n(cache dropped)")):
        if key in r:
            labels.append(name)
            seconds.append(r[key])
    times.barh(labels, seconds, color=["#d62728" if "cold start" not in n else "#999999" for n in labels])
    for y, value in enumerate(seconds):
        times.text(value, y, f" {value:.2f} s", va="center", fontsize=8)
    times.set_xlabel("seconds, exec → first validated token (median)")
    times.invert_yaxis()
    figure.suptitle(f"{g['artifact_bytes'] / 1e9:.1f} GB artifact, {r['cpus']} CPUs", fontsize=9)
    figure.tight_layout()
    figure.savefig(png, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="1b", choices=["tiny", "1b"], help="reference workload size (default 1b)")
    parser.add_argument("--dir", type=Path, required=True, help="work folder on the disk under test")
    parser.add_argument("--out", type=Path, required=True, help="folder for fresh-node.json, .md and .png")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--registry-storage", type=Path, default=Path("/dev/shm/coldsnap-fresh-registry"))
    parser.add_argument("--keep", action="store_true", help="keep WORK's artifact afterwards")
    parser.add_argument("--artifact", type=Path, help="an earlier run's artifact of this --size (kept with --keep): "
                        "measured again without a new capture")
    args = parser.parse_args()
    if os.geteuid() != 0:
        parser.error("needs root (CRIU, page-cache drops)")
    from coldsnap.activation.canary import ask_canary
    from coldsnap.demo import CHECK_PROMPT, cold_start
    from tests.helpers import free_port

    work = args.dir.absolute()
    work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    artifact = args.artifact.absolute() if args.artifact else work / "artifact"
    port = (json.loads((artifact / "request.json").read_text())["units"][0]["serving_port"] if args.artifact
            else free_port())
    command = [sys.executable, "-m", "coldsnap.workloads.torch_lm", "--size", args.size, "--device", "cpu", "--port", str(port)]
    try:
        log(f"cold start{'' if args.artifact else ' and capture'} of the {args.size} reference workload")
        _, expected = cold_start(command, port)
        if not args.artifact:
            shutil.rmtree(artifact, ignore_errors=True)
            coldsnap("capture", "--out", str(artifact), "--", *command,
                     env={"COLDSNAP_STATE_DIR": str(work / "state-capture")})
        result = measure(artifact, work, args.registry_storage, args.repeat,
                         lambda: ask_canary(port, CHECK_PROMPT, 8).token_ids == expected)
        drop_caches()
        result["cold_start_s"], tokens = cold_start(command, port)
        result["cold_start_same_tokens"] = tokens == expected
        result["size"] = args.size
    finally:
        for name in ("copy", "pulled", "state-capture", "state-fresh", *(() if args.keep or args.artifact else ("artifact",))):
            shutil.rmtree(work / name, ignore_errors=True)
    (args.out / "fresh-node.json").write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    text = table(result)
    (args.out / "fresh-node.md").write_text(text + "\n")
    print(text)
    draw(result, args.out / "fresh-node.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())

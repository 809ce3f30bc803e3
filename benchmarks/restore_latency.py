"""Restore latency: cold start of a server vs coldsnap restore of its capture, side by side.

    python -m benchmarks.restore_latency --size tiny --device cpu --repeat 3 --out restore.json [--png restore.png]
    python -m benchmarks.restore_latency --size 8b --device cuda --tp 2 --out tp2.json   # two GPUs
    python -m benchmarks.restore_latency --engine vllm --out vllm.json     # = benchmarks/vllm_startup.py

Engines as in ``coldsnap demo``: the reference workload (torch-lm), or ``vllm serve`` of a tiny Llama on
vLLM's CPU build (cold start with vLLM's own loader; the capture with ``--load-format coldsnap``).
Cold start: process start → first token. Restore: the `coldsnap restore` process's exec → the canary's match
(the first validated token), with its phases on the wall clock and what follows (receipt, process exit).
With ``--standby``: `coldsnap warm` parks a standby, then the `coldsnap wake` process's exec → the canary's
match, with its phases, as a row of its own. With ``--n580 ABI[:PRELOAD]`` (repeatable): the same command
also captured with the n580 snapshot driver (the pre-CUDA template of that placement ABI, importing
PRELOAD — default: the engine adapter's list), and its `coldsnap restore` timed the same way beside
n610's (``--n580-gpu N``: onto GPU N, ``--gpu N`` of the restore).
Both are measured with the page cache warm (repeated) and, when caches can be dropped (root), cold.
Writes JSON (every run with its phases), prints a table, and draws a phase chart when matplotlib is
installed. Needs root (CRIU) and torch.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (cold_start_figure, drop_caches, pyplot, receipt_timeline, results_argument, run_folder,
                               write_figures)
from coldsnap.contracts.placement import PLACEMENT_ABI_ENV, PRELOAD_ENV
from coldsnap.demo import cold_start, engine_commands, run_demo, scratch_env
from coldsnap.contracts.receipt import restored_pid
from coldsnap.snapshot.process_tree import kill_tree


def run_operation(operation: str, request: dict, work: Path, index: int,
                  extra: tuple[str, ...] = ()) -> tuple[dict, int, int]:
    """One `coldsnap restore|warm|wake DIR` as a user runs it (a new process: interpreter start and
    imports count): its receipt, and the wall clock at its exec and its exit."""
    receipt_path = work / f"{operation}-{index}.json"
    receipt_path.unlink(missing_ok=True)
    exec_ns = time.time_ns()
    done = subprocess.run([sys.executable, "-m", "coldsnap", operation, request["artifact"], "--operation-id",
                           f"bench-{operation}-{index}", "--receipt-json", str(receipt_path), *extra], capture_output=True)
    exit_ns = time.time_ns()
    if done.returncode != 0:
        raise RuntimeError(f"{operation} failed: {done.stderr.decode().strip().splitlines()[-1:]}")
    return json.loads(receipt_path.read_text()), exec_ns, exit_ns


def kill_restored(receipt: dict) -> None:
    """Kill the tree a restore (or warm) receipt says it restored: its CRIU step's ``pid``, as this host
    sees it (each restore runs in pid namespaces of its own)."""
    pid = restored_pid(receipt)
    if pid is not None:
        kill_tree(pid)


def restore_once(request: dict, work: Path, index: int, extra: tuple[str, ...] = ()) -> tuple[float, dict[str, float]]:
    """One `coldsnap restore`: seconds from its exec to the canary's match (what the user waits for), and
    its timeline (:func:`receipt_timeline`); the tree is killed afterwards."""
    receipt, exec_ns, exit_ns = run_operation("restore", request, work, index, extra)
    kill_restored(receipt)
    timeline = receipt_timeline(receipt, exec_ns, exit_ns)
    return timeline.pop("exec → canary matched"), timeline


def standby_once(request: dict, work: Path, index: int) -> tuple[float, float, dict[str, float]]:
    """`coldsnap warm` (exec → exit: the standby parked), then `coldsnap wake` of it: seconds from the
    wake's exec to the canary's match, and the wake's timeline; the tree is killed afterwards."""
    warmed, exec_ns, exit_ns = run_operation("warm", request, work, index)
    warm_s = (exit_ns - exec_ns) / 1e9
    receipt, exec_ns, exit_ns = run_operation("wake", request, work, index)
    kill_restored(warmed)
    timeline = receipt_timeline(receipt, exec_ns, exit_ns)
    return warm_s, timeline.pop("exec → canary matched"), timeline


def replicas_at_once(request: dict, work: Path, count: int, index: int, gpus: list[str]) -> dict[str, Any]:
    """``count`` `coldsnap restore --port P` processes of one capsule started at once, each on a port of its
    own (and GPU ``gpus[i]`` where given): the wall time from the first exec to the last exit (every canary
    matched), each one's own exec → exit, and their roots' host pids; the replicas are killed afterwards."""
    ports = []
    while len(ports) < count:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            if probe.getsockname()[1] not in ports:
                ports.append(probe.getsockname()[1])
    results: dict[int, tuple[dict, int, int]] = {}
    errors: list[BaseException] = []

    def one(number: int) -> None:
        extra = ("--port", str(ports[number]), *(("--gpu", gpus[number]) if gpus else ()))
        try:
            results[number] = run_operation("restore", request, work, index * 100 + number, extra)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(number,)) for number in range(count)]
    started_ns = time.time_ns()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    finished_ns = time.time_ns()
    for receipt, _, _ in results.values():
        kill_restored(receipt)
    if errors:
        raise RuntimeError(f"a replica failed: {errors[0]}")
    return {"replicas": count, "wall_s": round((finished_ns - started_ns) / 1e9, 3), "ports": ports, "gpus": gpus,
            "each_s": [round((exit_ns - exec_ns) / 1e9, 3) for _, exec_ns, exit_ns in
                       (results[number] for number in range(count))]}


def capture_n580(request: dict, work: Path, variant: str) -> dict[str, Any]:
    """The n610 capture's request again, with the n580 driver and ``variant`` (``ABI[:PRELOAD]``), into
    ``work/artifact-n580-abi<ABI>[-<N>mod]``: its label, request, capture seconds and phases, template image bytes and
    its receipt's warnings."""
    abi, _, preload = variant.partition(":")
    env = {**request["units"][0].get("env", {}), PLACEMENT_ABI_ENV: abi}
    if ":" in variant:
        env[PRELOAD_ENV] = preload
    name = f"n580-abi{abi}" + (f"-{len(preload.split(',')) if preload else 0}mod" if ":" in variant else "")
    label = f"restore n580 ABI {abi} (preload {preload or 'nothing'})" if ":" in variant else f"restore n580 ABI {abi}"
    n580 = {**request, "snapshot_driver": "n580", "operation_id": f"bench-capture-{name}",
            "artifact": str(work / f"artifact-{name}"), "units": [{**request["units"][0], "env": env}]}
    path = work / f"capture-{name}.json"
    path.write_text(json.dumps(n580))
    receipt_path = work / f"capture-{name}-receipt.json"
    receipt_path.unlink(missing_ok=True)
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "coldsnap", "capture", "--request-json", str(path),
                           "--receipt-json", str(receipt_path)], capture_output=True)
    if done.returncode != 0:
        raise RuntimeError(f"n580 capture {variant} failed: {done.stderr.decode().strip().splitlines()[-1:]}")
    receipt = json.loads(receipt_path.read_text())
    images = Path(n580["artifact"]) / "units"
    return {"label": label, "variant": variant, "request": {**n580, "operation": "restore"},
            "capture_s": round(time.perf_counter() - started, 3),
            "capture_phases_s": {s["name"]: round(s["duration_ns"] / 1e9, 3) for s in receipt["timing"]["spans"]},
            "template_image_bytes": sum(p.stat().st_size for p in images.rglob("*") if p.is_file()),
            "capture_warnings": receipt.get("warnings", [])}


def medians(timelines: list[dict[str, float]]) -> dict[str, float]:
    """Each phase's median over the runs that have it."""
    names = list(dict.fromkeys(name for timeline in timelines for name in timeline))
    return {name: round(statistics.median(t[name] for t in timelines if name in t), 4) for name in names}


# One color per phase, whichever operation's row it is in (restore.resume and wake.resume alike).
_PHASE_COLORS = {"exec → admission start": "#1f77b4", "admission": "#ff7f0e", "criu_restore": "#2ca02c",
                 "lease": "#17becf", "cuda_restore": "#9467bd", "stage_wait": "#8c564b", "resume": "#e377c2",
                 "canary": "#7f7f7f", "place": "#bcbd22", "engine_start": "#d6616b"}


AFTER_THE_GOAL = ("canary → receipt", "receipt → process exit")  # a bar ends at the canary's match
SPANNING = ("exec → CRIU start",)  # a sum of the phases before CRIU, not a phase of its own: not drawn


def _phase_row(axis: Any, row: str, phases: list[tuple[str, float]], operation: str, shown: set[str]) -> None:
    """One bar of consecutive phases (``operation.`` dropped from their names), each phase in the legend once."""
    left = 0.0
    for name, value in phases:
        if name in AFTER_THE_GOAL:
            continue
        phase = name.removeprefix(f"{operation}.")
        axis.barh([row], [value], left=left, color=_PHASE_COLORS.get(phase), label=None if phase in shown else phase)
        shown.add(phase)
        left += value


def draw_phase_chart(document: dict, png: Path) -> bool:
    """Cold start beside restore's phases (page cache warm); False when matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return False
    summary = document["summary"]
    phases = dict(document.get("phases_last_restore", {}))
    # The launcher hydrates the weights beside CRIU + CUDA restore: its own row, from CRIU's start.
    # (one row per rank under tensor parallel: the longest is drawn)
    staged_ranks = [phases.pop(n) for n in [n for n in phases if n.startswith("restore.stage_weights")]]
    staged = max(staged_ranks) if staged_ranks else None
    order = ["exec → admission start", "restore.admission", "restore.criu_restore", "restore.lease", "restore.cuda_restore",
             "restore.stage_wait", "restore.resume", "restore.canary"]
    sequential = [(n, phases[n]) for n in order if n in phases] + [(n, v) for n, v in phases.items()
                                                                    if n not in order and n not in SPANNING]
    n580 = document.get("n580") or []
    figure, axis = plt.subplots(figsize=(10, 3.6 + 0.7 * len(n580)))
    axis.barh(["cold start"], [summary.get("cold start (warm)", 0)], color="#999999", label="cold start")
    shown: set[str] = set()
    _phase_row(axis, "restore (n610)" if n580 else "restore", sequential, "restore", shown)
    wake = [(n, v) for n, v in document.get("wake_phase_medians_warm", {}).items() if n not in AFTER_THE_GOAL]
    _phase_row(axis, "wake\n(warm standby)", wake, "wake", shown)  # the standby's wake, its own row (medians)
    if staged is not None:
        before = phases.get("exec → admission start", 0.0) + phases.get("restore.admission", 0.0)
        axis.barh(["n610 weights staged\n(in parallel)" if n580 else "weights staged\n(in parallel)"],
                  [staged], left=before, color="#d62728",
                  label="stage_weights (launcher)")
    for variant in n580:  # each n580 capture's restore, its own row (medians)
        _phase_row(axis, variant["label"].removeprefix("restore ").replace(" (", "\n("),
                   list(variant.get("phase_medians_warm", {}).items()), "restore", shown)
    axis.invert_yaxis()
    axis.set_xlabel("seconds (page cache warm)")
    tp = f" TP{document['tp']}" if document.get("tp", 1) > 1 else ""
    axis.set_title(f"{document.get('engine', 'torch-lm')} {document['size']}{tp} on {document['device']}: "
                   "cold start vs coldsnap restore" + (" and wake" if wake else "")
                   + (" (n610 and n580)" if n580 else ""), fontsize=9)
    axis.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    figure.tight_layout()
    figure.savefig(png, dpi=120)
    return True


def main(engine: str = "torch-lm") -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", default=engine, choices=["torch-lm", "vllm"])
    parser.add_argument("--size", default="tiny", choices=["tiny", "1b", "8b"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tp", type=int, default=1, help="torch-lm: tensor-parallel ranks, one GPU each (default 1)")
    parser.add_argument("--compile", action="store_true", help="vllm: keep torch.compile on (default --enforce-eager)")
    parser.add_argument("--repeat", type=int, default=3, help="warm runs of each (default 3)")
    parser.add_argument("--standby", action="store_true", help="also warm a standby and time its wake, --repeat times")
    parser.add_argument("--n580", action="append", default=[], metavar="ABI[:PRELOAD]",
                        help="also capture with the n580 snapshot driver, a template of placement ABI 1 or 2 importing "
                        "PRELOAD (comma-separated; default the engine's list), and time its restores beside n610's "
                        "(repeatable)")
    parser.add_argument("--n580-gpu", metavar="N", help="restore the n580 capture onto GPU N (its --gpu)")
    parser.add_argument("--replicas", type=int, default=0, metavar="N",
                        help="also restore N replicas of the capsule at once (each on its own port), --repeat times")
    parser.add_argument("--replica-gpus", metavar="G0,G1,...", help="the GPU of each replica (its --gpu)")
    parser.add_argument("--out", default="restore_latency.json")
    results_argument(parser)
    parser.add_argument("--png", help="draw the phase chart here (needs matplotlib)")
    parser.add_argument("--dir", help="work directory, kept (default: a temporary one, removed at the end)")
    parser.add_argument("--png-from", metavar="JSON", help="only draw --png from an earlier run's JSON (e.g. one brought "
                        "back from a GPU host without matplotlib)")
    args = parser.parse_args()
    args.run_folder = None
    if args.results:
        try:
            args.run_folder = run_folder(args.engine, args.results)
        except ValueError as error:
            parser.error(str(error))
        args.out = str(args.run_folder / Path(args.out).name)
    if args.png_from:
        if not args.png:
            parser.error("--png-from needs --png")
        return 0 if draw_phase_chart(json.loads(Path(args.png_from).read_text()), Path(args.png)) else 1
    if args.dir:
        return measure(args, Path(args.dir))
    with tempfile.TemporaryDirectory(prefix="coldsnap-restore-bench-", ignore_cleanup_errors=True) as work:  # (1.3 GB for vLLM's CPU tree)
        return measure(args, Path(work))


def measure(args: argparse.Namespace, work: Path) -> int:
    """The runs ``args`` ask for, in ``work``; writes ``args.out`` and prints the table."""
    eager = not args.compile
    demo = run_demo(args.size, args.device, work, quiet=True, engine=args.engine, eager=eager, tp=args.tp)  # capture + one of each
    request = json.loads((work / "artifact" / "request.json").read_text())
    port = request["units"][0]["serving_port"]
    command, _, env, _ = engine_commands(args.engine, args.size, args.device, port, work, eager, args.tp)
    env = scratch_env(env, work)  # (as the demo's cold start: the killed servers' files out of /tmp)
    # The demo's own restore ran inside this process; every restore below is a `coldsnap restore` process.
    runs = [{"kind": "cold start", "cache": "warm", "seconds": demo["cold_start_to_first_token_s"]}]
    n580 = [capture_n580(request, work, variant) for variant in args.n580]
    n580_extra = ("--gpu", args.n580_gpu) if args.n580_gpu is not None else ()
    for index in range(args.repeat):
        if index:
            runs.append({"kind": "cold start", "cache": "warm", "seconds": round(cold_start(command, port, env=env)[0], 3)})
        seconds, phases = restore_once(request, work, index)
        runs.append({"kind": "restore", "cache": "warm", "seconds": round(seconds, 3), "phases": phases})
        for number, variant in enumerate(n580):
            seconds, phases = restore_once(variant["request"], work, 100 * (number + 1) + index, n580_extra)
            runs.append({"kind": variant["label"], "cache": "warm", "seconds": round(seconds, 3), "phases": phases})
    for index in range(args.repeat if args.standby else 0):
        warm_s, seconds, phases = standby_once(request, work, index)
        runs.append({"kind": "warm (to standby)", "cache": "warm", "seconds": round(warm_s, 3)})
        runs.append({"kind": "wake", "cache": "warm", "seconds": round(seconds, 3), "phases": phases})
    replica_gpus = args.replica_gpus.split(",") if args.replica_gpus else []
    replicas = [replicas_at_once(request, work, args.replicas, 900 + index, replica_gpus)
                for index in range(args.repeat if args.replicas > 1 else 0)]
    if drop_caches():
        runs.append({"kind": "cold start", "cache": "cold", "seconds": round(cold_start(command, port, env=env)[0], 3)})
        drop_caches()
        seconds, phases = restore_once(request, work, 999)
        runs.append({"kind": "restore", "cache": "cold", "seconds": round(seconds, 3), "phases": phases})

    last = next((r for r in reversed(runs) if r.get("phases") and r["kind"] == "restore" and r["cache"] == "warm"), None)
    phase_medians, wake_medians = (medians([r["phases"] for r in runs if r["kind"] == kind and r["cache"] == "warm"])
                                   for kind in ("restore", "wake"))
    for variant in n580:
        variant["phase_medians_warm"] = medians([r["phases"] for r in runs if r["kind"] == variant["label"]])
    summary = {}
    for kind in ("cold start", "restore", *(v["label"] for v in n580), "warm (to standby)", "wake"):
        for cache in ("warm", "cold"):
            values = [r["seconds"] for r in runs if r["kind"] == kind and r["cache"] == cache]
            if values:
                summary[f"{kind} ({cache})"] = round(statistics.median(values), 3)
    document = {"benchmark": "restore_latency", "engine": args.engine, "size": demo["size"], "device": args.device,
                "tp": args.tp,
                "eager": eager,
                "restore_measured": "the coldsnap restore process from its exec to the canary's match (its exit after that "
                                    "is the 'receipt → process exit' phase)",
                "phases_last_restore": (last or {}).get("phases", {}), "phase_medians_warm": phase_medians,
                "wake_measured": "the coldsnap wake process from its exec to the canary's match, the standby parked "
                                 "by coldsnap warm before (warm: its process's exec → exit)" if args.standby else None,
                "wake_phase_medians_warm": wake_medians,
                "n580_measured": "each n580 capture's coldsnap restore process (its template restored by CRIU, placed, "
                                 "the engine's startup with the native pack hydrated at load time) from its exec to the "
                                 "canary's match" if n580 else None,
                "n580_gpu": args.n580_gpu,
                "n580": [{k: v for k, v in variant.items() if k != "request"} for variant in n580],
                "replicas_measured": f"{args.replicas} coldsnap restore processes of the capsule started at once on "
                                     "ports of their own: first exec → last exit (every canary matched)"
                                     if replicas else None,
                "replicas": replicas,
                "runs": runs, "summary": summary,
                "capture_phases_s": demo["capture_phases_s"], "image_bytes": demo["image_bytes"],
                "non_model_bytes": demo["non_model_bytes"], "image_to_non_model_rss": demo["image_to_non_model_rss"],
                "payload_bytes": demo["payload_bytes"], "same_tokens_as_cold_start": demo["same_tokens_as_cold_start"]}
    Path(args.out).write_text(json.dumps(document, indent=2) + "\n")
    width = max(24, *(len(name) for name in summary))
    print(f"{'what':<{width}} {'median s':>9}")
    for name, value in summary.items():
        print(f"{name:<{width}} {value:>9.3f}")
    def seconds(kind: str, cache: str) -> list[float]:
        return [r["seconds"] for r in runs if r.get("kind") == kind and r.get("cache") == cache]

    for cache in ("warm", "cold"):
        for kind in ("restore", *(v["label"] for v in n580), "wake"):
            if f"cold start ({cache})" in summary and f"{kind} ({cache})" in summary:
                n = len(seconds("cold start", cache))  # the ratio says how many cold starts it divides by
                print(f"speedup of {kind} ({cache}): {summary[f'cold start ({cache})'] / summary[f'{kind} ({cache})']:.2f}x "
                      f"(÷ {f'the median of {n} cold starts' if n > 1 else '1 cold start'})")
    if args.run_folder:
        workload = (f"{'reference workload' if args.engine == 'torch-lm' else 'vLLM CPU build'}, {args.size}"
                    + (f" at TP {args.tp}" if args.tp > 1 else ""))
        write_figures(args.run_folder, [cold_start_figure(workload, kind, seconds(kind, "warm"), seconds("cold start", "warm"))
                                        for kind in ("restore", "wake") if seconds(kind, "warm")])
    print(f"process image {document['image_bytes'] / 2**20:.1f} MiB = {document['image_to_non_model_rss']}x the "
          f"non-model memory ({document['non_model_bytes'] / 2**20:.1f} MiB); payload {document['payload_bytes'] / 2**30:.2f} GiB")
    if replicas:
        wall = statistics.median(r["wall_s"] for r in replicas)
        document["summary"][f"{args.replicas} replicas at once (warm)"] = wall
        print(f"{args.replicas} replicas at once: median wall {wall:.3f} s = "
              f"{wall / summary['restore (warm)']:.2f}x one restore (runs: {[r['wall_s'] for r in replicas]})")
        Path(args.out).write_text(json.dumps(document, indent=2) + "\n")
    for kind, values in (("restore", phase_medians), *((v["label"], v["phase_medians_warm"]) for v in n580),
                         ("wake", wake_medians)):
        if values:
            print(f"{kind} phases (medians, page cache warm; exec → canary matched is the {kind}):")
            for name, value in values.items():
                print(f"  {name:<28} {value:8.3f} s")
    if args.png:
        draw_phase_chart(document, Path(args.png))
    return 0


if __name__ == "__main__":
    sys.exit(main())

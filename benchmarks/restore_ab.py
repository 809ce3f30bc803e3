"""Two ways of restoring one artifact, interleaved: `coldsnap restore` as it is, and with some environment.

    sudo python -m benchmarks.restore_ab --artifact DIR --b CRIU_KDAT_DIR= [--b KEY=VALUE ...] [--restores 10]
                                         [--out ab.json]

Each run is a `coldsnap restore DIR` process as a user runs it (benchmarks.restore_latency's
``run_operation``), timed from its exec to the canary's match, its phases read from its receipt; the
restored tree is killed after each. The runs alternate A (this environment) and B (this environment plus
every ``--b KEY=VALUE``; an empty VALUE sets the variable empty), after one unmeasured round, so both
meet the host's noise alike. Writes ``--out`` (JSON: every run, the medians) and prints the medians of
exec → canary and of every phase, A against B.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.common import check_artifact, finish, receipt_timeline
from benchmarks.restore_latency import kill_restored, run_operation


def measure(artifact: Path, b_environment: dict[str, str], restores: int) -> dict:
    ways = {"A": {}, "B": b_environment}
    runs: dict[str, list[dict[str, float]]] = {"A": [], "B": []}
    saved = {key: os.environ.get(key) for key in b_environment}
    with tempfile.TemporaryDirectory(prefix="coldsnap-restore-ab-") as work:
        try:
            for index in range(restores + 1):
                for number, (way, environment) in enumerate(ways.items()):
                    for key in b_environment:  # (run_operation's process inherits this one's environment)
                        os.environ.pop(key, None)
                    os.environ.update(environment)
                    receipt, exec_ns, exit_ns = run_operation("restore", {"artifact": str(artifact)}, Path(work),
                                                              2 * index + number)
                    kill_restored(receipt)
                    if index:
                        runs[way].append(receipt_timeline(receipt, exec_ns, exit_ns))
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
    medians = {way: {name: round(statistics.median(t[name] for t in timelines), 4) for name in timelines[0]}
               for way, timelines in runs.items()}
    return {"benchmark": "restore_ab", "artifact": str(artifact), "b_environment": b_environment, "restores": restores,
            "runs_s": runs, "median_s": medians}


def table(result: dict) -> str:
    b = " ".join(f"{key}={value}" for key, value in result["b_environment"].items())
    lines = [f"coldsnap restore, A against B ({b}), {result['restores']} runs each, medians in ms",
             f"  {'':32s} {'A':>8s} {'B':>8s} {'B - A':>8s}"]
    a_medians, b_medians = result["median_s"]["A"], result["median_s"]["B"]
    for name in ["exec → canary matched", *(n for n in a_medians if n != "exec → canary matched")]:
        if name in b_medians:
            a, b_value = a_medians[name] * 1000, b_medians[name] * 1000
            lines.append(f"  {name:32s} {a:8.1f} {b_value:8.1f} {b_value - a:+8.1f}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", type=Path, required=True, help="a captured artifact directory")
    parser.add_argument("--b", action="append", default=[], metavar="KEY=VALUE", required=True,
                        help="B's environment on top of A's (repeatable)")
    parser.add_argument("--restores", type=int, default=10, help="measured restores of each way (default 10)")
    parser.add_argument("--out", type=Path, help="write the JSON result here")
    args = parser.parse_args()
    check_artifact(parser, args.artifact)
    if any("=" not in item or not item.partition("=")[0] for item in args.b):
        parser.error("--b takes KEY=VALUE")
    if args.restores < 1:
        parser.error("--restores must be at least 1")
    result = measure(args.artifact, dict(item.partition("=")[::2] for item in args.b), args.restores)
    return finish(result, args.out, table(result))


if __name__ == "__main__":
    sys.exit(main())

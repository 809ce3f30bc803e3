"""Coordinator barrier latency on loopback: 2, 8 and 64 ranks (threads, one client each).

    python -m benchmarks.coordinator --ranks 2,8,64 --rounds 50 --out coordinator.json

Latency is the time from the last rank entering a barrier until every rank has left it, taken as the
spread between the latest entry and the latest exit of each round; the table shows median and p99.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

from coldsnap.coord import Coordinator, CoordinatorClient


def run(ranks: int, rounds: int) -> dict:
    token = os.urandom(32)
    server = Coordinator("127.0.0.1:0", token, ranks, ttl=600)
    serving = threading.Thread(target=server.serve, daemon=True)
    serving.start()
    entered = [[0.0] * ranks for _ in range(rounds)]
    left = [[0.0] * ranks for _ in range(rounds)]
    ready = threading.Barrier(ranks)

    def rank(r: int) -> None:
        with CoordinatorClient(server.endpoint, token, r) as client:
            ready.wait()
            for i in range(rounds):
                entered[i][r] = time.perf_counter()
                client.barrier("round", timeout=60)
                left[i][r] = time.perf_counter()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    serving.join(10)
    latencies = sorted((max(left[i]) - max(entered[i])) * 1e3 for i in range(rounds))
    return {"ranks": ranks, "rounds": rounds, "median_ms": round(statistics.median(latencies), 3),
            "p99_ms": round(latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))], 3),
            "max_ms": round(latencies[-1], 3)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="2,8,64")
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--out", default="coordinator.json")
    args = parser.parse_args()
    results = [run(int(n), args.rounds) for n in args.ranks.split(",")]
    with open(args.out, "w") as handle:
        json.dump({"benchmark": "coordinator", "cpus": os.cpu_count(), "results": results}, handle, indent=2)
    print(f"{'ranks':>5} {'median ms':>10} {'p99 ms':>8} {'max ms':>8}")
    for r in results:
        print(f"{r['ranks']:>5} {r['median_ms']:>10.3f} {r['p99_ms']:>8.3f} {r['max_ms']:>8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Two launch units: a two-unit restore vs a one-unit restore of the same model vs the two-node cold start (CPU,
simulated hosts, real CRIU; root).

    sudo .venv/bin/python -m benchmarks.two_units --repeat 3 --out two-units.json [--png two-units.png]

The reference workload (``coldsnap.workloads.torch_lm``, ``--size``) at tensor-parallel size 2, three ways:

  cold start     its two ranks on two simulated hosts (``--nnodes 2``), timed from the two execs to the first
                 completion answered at node 0's address
  one unit       both ranks on one host (``--tp 2``), captured as one unit; ``coldsnap restore`` on another
                 host, timed from its exec to its exit (the canary matched)
  two units      captured unit by unit on two hosts (``--units 2 --unit K``, unit 0 serving the coordinator),
                 restored onto two other hosts with other addresses: from the two execs to the last exit
  wake           each of the two captures warmed into standbys (untimed), then ``coldsnap wake`` of each
                 unit at once, timed as a restore is

Every restore is then asked the same prompts as the cold start (greedy token ids must be equal). Each host
is a network, UTS and mount namespace of its own (tests/simulated_hosts.py): a second machine is what this
one cannot have; the kernel, CRIU and TCP between the hosts are real. Writes ``--out`` (JSON: every run),
prints a table, draws ``--png`` where matplotlib is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import draw_medians  # noqa: E402
from coldsnap.atomic import write_atomic  # noqa: E402
from tests.simulated_hosts import simulated_hosts  # noqa: E402

PORT, MASTER_PORT, RENDEZVOUS_PORT = 18701, 29521, 29610
PROMPTS = ["hello world", "The history of the river is",
           "A longer prompt, so that the prefill crosses more of the cache: " + "the quick brown fox jumps over it; " * 8]


class Bench:
    def __init__(self, args: argparse.Namespace, work: Path, hosts):
        self.args, self.work = args, work
        self.a, self.b, self.c, self.d, self.client = hosts
        self.token = work / "token"
        self.token.write_text(secrets.token_hex(32))
        self.runs: list[dict] = []
        self.expected: list[list[int]] | None = None

    def engine(self, *extra: str) -> list[str]:
        return [sys.executable, "-m", "coldsnap.workloads.torch_lm", "--size", self.args.size, "--tp", "2",
                "--host", "0.0.0.0", "--port", str(PORT), *extra]

    def node(self, k: int) -> list[str]:
        return self.engine("--nnodes", "2", "--node-rank", str(k), "--master-addr", self.a.address,
                           "--master-port", str(MASTER_PORT))

    def env(self, host) -> dict[str, str]:
        return {**os.environ, "PYTHONPATH": str(REPO), "COLDSNAP_STATE_DIR": str(self.work / f"state-{host.hostname}")}

    def start(self, host, argv: list[str], log: str) -> subprocess.Popen:
        return subprocess.Popen(host.command(argv), stdout=open(self.work / log, "w"), stderr=subprocess.STDOUT,
                                env=self.env(host))

    def ask(self, address: str, prompt: str, timeout: float = 60) -> list[int] | None:
        body = json.dumps({"prompt": prompt, "max_tokens": 16, "temperature": 0})
        done = subprocess.run(["nsenter", f"--net=/var/run/netns/{self.client.namespace}", sys.executable, "-c",
                               "import sys, urllib.request; print(urllib.request.urlopen(urllib.request.Request("
                               f"'http://{address}:{PORT}/v1/completions', data=sys.argv[1].encode()), "
                               f"timeout={timeout}).read().decode())", body], capture_output=True, text=True,
                              timeout=timeout + 30)
        return json.loads(done.stdout)["choices"][0]["token_ids"] if done.returncode == 0 else None

    def kill_all(self, *hosts) -> None:
        for host in hosts:
            listed = subprocess.run(["ip", "netns", "pids", host.namespace], capture_output=True, text=True)
            for pid in map(int, listed.stdout.split()):
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
        time.sleep(0.5)

    def record(self, kind: str, seconds: float, tokens: list[list[int]] | None) -> None:
        run = {"kind": kind, "seconds": round(seconds, 3),
               "same_tokens": self.expected is None or tokens == self.expected}
        self.runs.append(run)
        print(json.dumps(run), flush=True)

    def cold_start(self) -> None:
        started = time.monotonic()
        nodes = [self.start(h, self.node(k), f"cold-{len(self.runs)}-{k}.log") for k, h in enumerate((self.a, self.b))]
        try:
            while (first := self.ask(self.a.address, PROMPTS[0], timeout=2)) is None:
                if any(p.poll() is not None for p in nodes) or time.monotonic() - started > 600:
                    raise SystemExit("the cold start did not answer")
                time.sleep(0.05)
            seconds = time.monotonic() - started
            tokens = [first] + [self.ask(self.a.address, p) for p in PROMPTS[1:]]
            if self.expected is None:
                self.expected = tokens  # type: ignore[assignment]
            self.record("cold start, two nodes", seconds, tokens)  # type: ignore[arg-type]
        finally:
            self.kill_all(self.a, self.b)

    def capture(self, label: str, units: list, argv_of) -> None:
        started = time.monotonic()
        processes = [self.start(h, argv_of(k, h), f"capture-{label}-{k}.log") for k, h in enumerate(units)]
        if [p.wait(timeout=900) for p in processes] != [0] * len(units):
            raise SystemExit(f"capture {label} failed: see {self.work}/capture-{label}-*.log")
        print(json.dumps({"capture": label, "seconds": round(time.monotonic() - started, 2)}), flush=True)

    def restore(self, kind: str, units: list, argv_of, warm_argv_of=None) -> None:
        """``argv_of`` timed on every unit at once (a restore, or a wake of the standbys ``warm_argv_of``
        parked first, untimed)."""
        index = len(self.runs)
        receipts = [self.work / f"restore-{index}-{k}.json" for k in range(len(units))]
        if warm_argv_of is not None:
            warms = [self.start(h, warm_argv_of(k, h), f"warm-{index}-{k}.log") for k, h in enumerate(units)]
            if [p.wait(timeout=300) for p in warms] != [0] * len(units):
                self.kill_all(*units)
                raise SystemExit(f"{kind}: warm failed: see {self.work}/warm-{index}-*.log")
        started = time.monotonic()
        processes = [self.start(h, [*argv_of(k, h), "--receipt-json", str(receipts[k])], f"restore-{index}-{k}.log")
                     for k, h in enumerate(units)]
        codes = [p.wait(timeout=300) for p in processes]
        seconds = time.monotonic() - started
        try:
            if codes != [0] * len(units):
                raise SystemExit(f"{kind}: restore failed: see {self.work}/restore-{index}-*.log")
            self.record(kind, seconds, [self.ask(self.c.address, p) for p in PROMPTS])
            # each unit's own clock (its receipt): the controller's span and its longest phases
            self.runs[-1]["units"] = [_phases(json.loads(r.read_text())) for r in receipts]
        finally:
            self.kill_all(*units)

    def unit_flags(self, k: int, host, leader) -> list[str]:
        flags = ["--units", "2", "--unit", str(k), "--rendezvous", f"{leader.address}:{RENDEZVOUS_PORT}",
                 "--rendezvous-token-file", str(self.token), "--address", host.address]
        return flags + (["--serve-rendezvous", f"0.0.0.0:{RENDEZVOUS_PORT}"] if k == 0 else [])

    def run(self) -> dict:
        coldsnap = [sys.executable, "-m", "coldsnap"]
        for _ in range(self.args.repeat):
            self.cold_start()
        self.capture("one-unit", [self.a], lambda k, h: [*coldsnap, "capture", "--out", str(self.work / "one-unit"),
                                                          "--", *self.engine()])
        self.capture("two-units", [self.a, self.b], lambda k, h: [
            *coldsnap, "capture", "--out", str(self.work / f"two-units-{k}"), *self.unit_flags(k, h, self.a), "--",
            *self.node(k)])
        for _ in range(self.args.repeat):
            self.restore("restore, one unit (both ranks on one host)", [self.c],
                         lambda k, h: [*coldsnap, "restore", str(self.work / "one-unit")])
            self.restore("restore, two units on two other hosts", [self.c, self.d], lambda k, h: [
                *coldsnap, "restore", str(self.work / f"two-units-{k}"), *self.unit_flags(k, h, self.c)])
        for _ in range(self.args.repeat):  # warm standbys (parked untimed), then the wake timed
            self.restore("wake, one unit", [self.c], lambda k, h: [*coldsnap, "wake", str(self.work / "one-unit")],
                         lambda k, h: [*coldsnap, "warm", str(self.work / "one-unit")])
            self.restore("wake, two units", [self.c, self.d], lambda k, h: [
                *coldsnap, "wake", str(self.work / f"two-units-{k}"), *self.unit_flags(k, h, self.c)],
                lambda k, h: [*coldsnap, "warm", str(self.work / f"two-units-{k}"), *self.unit_flags(k, h, self.c)])
        groups: dict[str, list[float]] = {}
        for run in self.runs:
            groups.setdefault(run["kind"], []).append(run["seconds"])
        summary = {kind: round(statistics.median(values), 3) for kind, values in groups.items()}
        one, two = (summary.get("restore, one unit (both ranks on one host)"),
                    summary.get("restore, two units on two other hosts"))
        woke_one, woke_two = summary.get("wake, one unit"), summary.get("wake, two units")
        ratios = {"two units / one unit": round(two / one, 2) if one and two else None,
                  "wake: two units / one unit": round(woke_two / woke_one, 2) if woke_one and woke_two else None,
                  "cold start / two units": round(summary["cold start, two nodes"] / two, 1) if two else None}
        return {"benchmark": "two_units", "size": self.args.size, "repeat": self.args.repeat, "runs": self.runs,
                "summary": summary, "ratios": ratios, "cpus": os.cpu_count(),
                "same_tokens": all(r["same_tokens"] for r in self.runs)}


def _phases(receipt: dict) -> dict[str, float]:
    """A unit's receipt: its controller span and each top-level phase, seconds on that unit's clock."""
    return {s["name"]: round(s["duration_ns"] / 1e9, 3) for s in receipt["timing"]["spans"]
            if s.get("duration_ns") and s["clock_id"] == "controller" and (s["name"].startswith("controller.") or s["name"].count(".") == 1
                                         or ".units." in s["name"])}


def render(result: dict) -> str:
    lines = [f"two launch units, reference workload {result['size']} at TP 2, CPU ({result['cpus']} cores), simulated "
             "hosts: median seconds"]
    for kind, value in result["summary"].items():
        values = [r["seconds"] for r in result["runs"] if r["kind"] == kind]
        lines.append(f"  {kind:<46} {value:>8}  (n={len(values)}, {min(values)}–{max(values)})")
    lines += [f"  {name}: {value}" for name, value in result["ratios"].items()]
    lines.append("  every restore's greedy token ids = the cold start's" if result["same_tokens"] else
                 "  WARNING: a restore's tokens differ from the cold start's")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3, help="cold starts and restores of each kind (default 3)")
    parser.add_argument("--size", default="tiny", choices=["tiny", "1b"], help="the reference workload's size")
    parser.add_argument("--dir", help="work directory (default: a temporary one, removed)")
    parser.add_argument("--out", help="write the JSON here")
    parser.add_argument("--png", help="draw the medians here (needs matplotlib)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        parser.error("needs root (network namespaces and CRIU)")
    with tempfile.TemporaryDirectory(prefix="coldsnap-two-units-") as scratch:
        work = Path(args.dir or scratch)
        work.mkdir(parents=True, exist_ok=True)
        with simulated_hosts(5) as hosts:
            result = Bench(args, work, hosts).run()
    if args.out:
        write_atomic(Path(args.out), (json.dumps(result, indent=1) + "\n").encode())
    print(render(result))
    if args.png:
        draw_medians(result["summary"], "two launch units vs one vs the two-node cold start (CPU)", Path(args.png))
    return 0 if result["same_tokens"] else 1


if __name__ == "__main__":
    sys.exit(main())

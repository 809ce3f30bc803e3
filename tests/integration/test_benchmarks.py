"""The restore benchmark's CPU mode (the reference workload, real CRIU): it runs, and its figures add up —
the restore is the `coldsnap restore` process's exec → canary match, its phases placed on the wall clock;
with --standby, the wake of a warm standby the same way."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytestmark = [pytest.mark.criu, pytest.mark.skipif(os.geteuid() != 0, reason="CRIU needs root")]

ROOT = Path(__file__).resolve().parents[2]
BEFORE_THE_CANARY = ("exec → CRIU start", "restore.criu_restore", "restore.lease", "restore.resume", "restore.canary")
"""One after another: CRIU starts at the program's entry, and the admission runs while CRIU restores."""


def test_restore_latency_cpu_mode(tmp_path):
    out = tmp_path / "restore.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.restore_latency", "--size", "tiny", "--device",
                           "cpu", "--repeat", "2", "--standby", "--n580", "2", "--replicas", "2", "--out", str(out), "--dir",
                           str(tmp_path / "work")],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    document = json.loads(out.read_text())
    assert document["same_tokens_as_cold_start"] is True
    restores = [r for r in document["runs"] if r["kind"] == "restore" and r["cache"] == "warm"]
    assert len(restores) == 2
    for run in restores:
        phases = run["phases"]
        assert all(name in phases for name in (*BEFORE_THE_CANARY, "exec → admission start", "restore.admission",
                                               "canary → receipt", "receipt → process exit"))
        assert phases["exec → admission start"] < phases["exec → CRIU start"]  # (the entry's own checks)
        before = sum(phases[name] for name in BEFORE_THE_CANARY)
        # the phases before the canary's match lie inside exec → match (steps between spans are not phases)
        assert 0.5 * run["seconds"] <= before <= run["seconds"] + 0.005, (before, run)
    assert document["summary"]["restore (warm)"] > 0 and document["phase_medians_warm"]["exec → admission start"] > 0
    assert "restore phases (medians, page cache warm" in done.stdout
    wakes = [r for r in document["runs"] if r["kind"] == "wake"]
    assert len(wakes) == 2 and len([r for r in document["runs"] if r["kind"] == "warm (to standby)"]) == 2
    for run in wakes:  # the wake of a standby: no CRIU, no CUDA restore in it
        before = sum(run["phases"][name] for name in ("exec → admission start", "wake.admission", "wake.lease",
                                                      "wake.resume", "wake.canary"))
        assert 0.5 * run["seconds"] <= before <= run["seconds"] + 0.005, (before, run)
        assert "wake.criu_restore" not in run["phases"]
    assert document["summary"]["wake (warm)"] > 0 and "speedup of wake (warm)" in done.stdout
    n580 = [r for r in document["runs"] if r["kind"] == "restore n580 ABI 2"]  # the template, placed
    assert len(n580) == 2 and all({"restore.place", "restore.engine_start"} <= set(r["phases"]) for r in n580)
    assert document["n580"][0]["capture_warnings"] == [] and document["summary"]["restore n580 ABI 2 (warm)"] > 0
    replicas = document["replicas"]  # two restores at once, each on its own port, both served
    assert len(replicas) == 2 and all(len(set(r["ports"])) == 2 and max(r["each_s"]) <= r["wall_s"] for r in replicas)
    assert document["summary"]["2 replicas at once (warm)"] > 0 and "2 replicas at once: median wall" in done.stdout


def test_fresh_node_benchmark_cpu_mode(tmp_path):
    """The fresh-node benchmark end to end on the tiny workload: a real registry, pulls, restores from oci:// with
    nothing on the host and the page cache dropped, cold-disk restores; every restore the cold start's tokens."""
    from tests.registry_server import missing_tools

    if missing_tools():
        pytest.skip(f"needs {', '.join(missing_tools())} (scripts/install-registry.sh)")
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "benchmarks.fresh_node", "--size", "tiny", "--repeat", "1", "--dir",
                           str(tmp_path / "work"), "--out", str(out), "--registry-storage", str(tmp_path / "registry")],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((out / "fresh-node.json").read_text())
    assert [r["same_tokens"] for r in result["fresh_node"] + result["cold_disk"]] == [True, True]
    fresh = result["fresh_node"][0]
    assert "restore.pack_arrival" in fresh["phases"] or fresh["pull_line"], fresh  # pulled while it restored
    assert result["registry"]["republish"]["bytes_sent"] == 0 and result["disk"]["odirect_read_gb_s"] > 0
    assert "fresh node" in (out / "fresh-node.md").read_text()
    assert not (tmp_path / "work" / "artifact").exists()  # the benchmark removes what it made

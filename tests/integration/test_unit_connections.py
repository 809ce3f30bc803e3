"""A TCP connection between two launch units' trees, dumped established on two simulated hosts
(tests/simulated_hosts.py) and restored on two *other* hosts with other addresses, real CRIU: both ends
rewritten for the new addresses (every unit's captured → new one), and CRIU held at post-restore, the
connection in repair mode, until both trees are back — the second unit's restore 2 s after the first's,
so an unheld first one would have sent into a host with no socket yet and been reset. A hold that fails
kills the restored tree."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.simulated_hosts import simulated_hosts

pytestmark = [
    pytest.mark.criu,
    pytest.mark.skipif(os.geteuid() != 0, reason="CRIU and network namespaces need root"),
    pytest.mark.skipif(shutil.which("ip") is None or shutil.which("nsenter") is None, reason="no iproute2 / nsenter"),
]
REPO = Path(__file__).resolve().parents[2]
WORKLOAD = str(Path(__file__).with_name("echo_pair_workload.py"))
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def _run(host, *argv: str) -> subprocess.Popen:
    return subprocess.Popen(host.command([sys.executable, WORKLOAD, *argv]), env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _echoes(log: Path) -> list[str]:
    return [line for line in log.read_text().splitlines() if line.startswith("echo ")]


@pytest.fixture
def dumped_pair(tmp_path):
    with simulated_hosts(4) as (a, b, c, d):
        server = _run(a, "dump", "server", a.address, "7000", str(tmp_path / "server.log"), str(tmp_path / "unit0"), "2.5")
        time.sleep(0.5)
        client = _run(b, "dump", "client", a.address, "7000", str(tmp_path / "client.log"), str(tmp_path / "unit1"), "1.5")
        assert [server.wait(60), client.wait(60)] == [0, 0], server.stdout.read() + client.stdout.read()
        before = _echoes(tmp_path / "client.log")
        assert before and not (tmp_path / "client.log").read_text().count("client:")
        yield tmp_path, (a, b, c, d), before


def test_a_connection_between_units_survives_a_restore_onto_two_other_addresses(dumped_pair):
    work, (a, b, c, d), before = dumped_pair
    moved = json.dumps({a.address: c.address, b.address: d.address})
    (work / "barrier").mkdir()
    first = _run(d, "restore", str(work / "unit1"), str(work / "state-d"), moved, str(work / "barrier"))
    time.sleep(2)
    second = _run(c, "restore", str(work / "unit0"), str(work / "state-c"), moved, str(work / "barrier"))
    outputs = [p.communicate(timeout=60)[0] for p in (first, second)]
    assert [first.returncode, second.returncode] == [0, 0], outputs
    log = (work / "client.log").read_text()
    assert "client:" not in log, log[-500:]  # never reset
    after = _echoes(work / "client.log")[len(before):]
    assert len(after) >= 5 and after[0] == f"echo {len(before) + 1}", after  # the counter goes on where it was
    assert not list((work / "state-c" / "criu").glob("unlock-*"))  # the hold's FIFOs removed


def test_a_hold_that_fails_kills_the_restored_tree(dumped_pair):
    work, (a, b, c, d), before = dumped_pair
    moved = json.dumps({a.address: c.address, b.address: d.address})
    (work / "barrier").mkdir()
    failed = _run(d, "restore", str(work / "unit1"), str(work / "state-d"), moved, str(work / "barrier"), "abort")
    output = failed.communicate(timeout=60)[0]
    assert failed.returncode == 3 and "aborted: the other unit failed" in output, output
    time.sleep(0.5)
    assert len(_echoes(work / "client.log")) == len(before)  # the restored client never ran
    listed = subprocess.run(["ip", "netns", "pids", d.namespace], capture_output=True, text=True, timeout=30)
    assert listed.stdout.split() == []  # nothing left on host D

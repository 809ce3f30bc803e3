"""Two launch units on simulated hosts (tests/simulated_hosts.py), real CRIU: the reference workload's two
ranks on two hosts (``--tp 2 --nnodes 2``), captured unit by unit (``coldsnap capture --units 2 --unit K``)
meeting at the coordinator unit 0 serves, and restored onto two *other* hosts with other addresses. The
restored pair answers as a cold start of the pair; a unit that fails, is killed or finds its port taken
fails both within ~2 s, named, and leaves nothing running on any host."""

import json
import os
import secrets
import shutil
import signal
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
pytest.importorskip("zmq")
pytest.importorskip("torch")
REPO = Path(__file__).resolve().parents[2]
PORT, MASTER_PORT, RENDEZVOUS_PORT = 18601, 29511, 29600
PROMPTS = ["hello world", "The history of the river is",
           "A longer prompt, so that the prefill crosses more of the cache: " + "the quick brown fox jumps over it; " * 8]


def _engine(node: int, master: str) -> list[str]:
    return [sys.executable, "-m", "coldsnap.workloads.torch_lm", "--size", "tiny", "--tp", "2", "--nnodes", "2",
            "--node-rank", str(node), "--master-addr", master, "--master-port", str(MASTER_PORT), "--host", "0.0.0.0",
            "--port", str(PORT)]


def _env(work: Path, host) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "COLDSNAP_STATE_DIR": str(work / f"state-{host.hostname}")}


def _unit_flags(k: int, host, leader, token: Path) -> list[str]:
    flags = ["--units", "2", "--unit", str(k), "--rendezvous", f"{leader.address}:{RENDEZVOUS_PORT}",
             "--rendezvous-token-file", str(token), "--address", host.address]
    return flags + (["--serve-rendezvous", f"0.0.0.0:{RENDEZVOUS_PORT}"] if k == 0 else [])


def _start(work: Path, label: str, hosts, argv_of) -> list[subprocess.Popen]:
    return [subprocess.Popen(h.command(argv_of(k, h)), stdout=open(work / f"{label}-{k}.log", "w"),
                             stderr=subprocess.STDOUT, env=_env(work, h)) for k, h in enumerate(hosts)]


def _receipt(work: Path, name: str) -> dict:
    return json.loads((work / name).read_text())


def _ask(client, address: str, prompt: str) -> list[int]:
    body = json.dumps({"prompt": prompt, "max_tokens": 16, "temperature": 0})
    done = subprocess.run(["nsenter", f"--net=/var/run/netns/{client.namespace}", sys.executable, "-c",
                           "import sys, urllib.request; print(urllib.request.urlopen(urllib.request.Request("
                           f"'http://{address}:{PORT}/v1/completions', data=sys.argv[1].encode()), timeout=60).read()"
                           ".decode())", body], capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)["choices"][0]["token_ids"]


def _wait_for_http(client, address: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        probe = subprocess.run(["nsenter", f"--net=/var/run/netns/{client.namespace}", sys.executable, "-c",
                                f"import socket; socket.create_connection(('{address}', {PORT}), timeout=1)"],
                               capture_output=True)
        if probe.returncode == 0:
            return
        time.sleep(0.3)
    raise AssertionError(f"nothing answered on {address}:{PORT}")


def _namespace_pids(host) -> list[int]:
    listed = subprocess.run(["ip", "netns", "pids", host.namespace], capture_output=True, text=True, timeout=30)
    return [int(p) for p in listed.stdout.split()]


def _namespace_pids_gone(host, timeout: float) -> list[int]:
    """The processes still in the host's namespace once they are gone or ``timeout`` passed."""
    deadline = time.monotonic() + timeout
    while (left := _namespace_pids(host)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


@pytest.fixture(scope="module")
def two_units(tmp_path_factory):
    """Six hosts: A and B run the cold start and the capture, C and D the restores, E the failure cases'
    second pair, and a client. The cold pair's answers to PROMPTS, and the capture's two artifact
    directories (one per host, as on two machines)."""
    work = tmp_path_factory.mktemp("two-units")
    token = work / "token"
    token.write_text(secrets.token_hex(32))
    with simulated_hosts(6) as (a, b, c, d, e, client):
        cold = _start(work, "cold", [a, b], lambda k, h: _engine(k, a.address))
        try:
            _wait_for_http(client, a.address)
            expected = [_ask(client, a.address, prompt) for prompt in PROMPTS]
        finally:
            for process in cold:
                process.kill()
                process.wait()
        started = time.monotonic()
        capture = _start(work, "capture", [a, b], lambda k, h: [
            sys.executable, "-m", "coldsnap", "capture", "--out", str(work / f"artifact-unit{k}"),
            *_unit_flags(k, h, a, token), "--receipt-json", str(work / f"capture-{k}.json"), "--",
            *_engine(k, a.address)])
        codes = [p.wait(timeout=600) for p in capture]
        logs = "\n".join((work / f"capture-{k}.log").read_text()[-3000:] for k in range(2))
        assert codes == [0, 0], logs
        yield {"work": work, "token": token, "hosts": (a, b, c, d, e, client), "expected": expected,
               "capture_s": time.monotonic() - started}


def _unit_argv(work: Path, token: Path, leader, operation: str, label: str, extra=()):
    """``coldsnap OPERATION`` of unit K's artifact directory on host h, unit 0 at ``leader``."""
    return lambda k, h: [sys.executable, "-m", "coldsnap", operation, str(work / f"artifact-unit{k}"),
                         *_unit_flags(k, h, leader, token), "--receipt-json", str(work / f"{label}-receipt-{k}.json"),
                         *extra]


def _restore_argv(work: Path, token: Path, leader, label: str, extra=()):
    return _unit_argv(work, token, leader, "restore", label, extra)


def test_two_units_restored_on_two_other_hosts_answer_as_the_cold_pair(two_units):
    work, token, expected = two_units["work"], two_units["token"], two_units["expected"]
    a, b, c, d, e, client = two_units["hosts"]
    descriptor = json.loads((work / "artifact-unit0" / "artifact.json").read_text())
    assert [u["unit_id"] for u in descriptor["units"]] == ["unit-0", "unit-1"]
    assert (work / "artifact-unit1" / "artifact.json").read_bytes() == (work / "artifact-unit0" / "artifact.json").read_bytes()
    assert not (work / "artifact-unit0" / "units" / "unit-1").exists()  # each host holds its own unit's capsule
    captured = [_receipt(work, f"capture-{k}.json") for k in range(2)]
    assert all(r["state"] == "succeeded" for r in captured)
    spans = {s["name"] for s in captured[1]["timing"]["spans"]}
    assert {"capture.units.ready", "capture.units.dumped", "capture.units.verified"} <= spans

    started = time.monotonic()
    restores = _start(work, "restore", [c, d], _restore_argv(work, token, c, "restore"))
    codes = [p.wait(timeout=300) for p in restores]
    seconds = time.monotonic() - started
    print(f"per-unit commands: both units restored in {seconds:.2f} s")  # (pytest -s shows it)
    logs = "\n".join((work / f"restore-{k}.log").read_text()[-3000:] for k in range(2))
    assert codes == [0, 0], logs
    try:
        receipts = [_receipt(work, f"restore-receipt-{k}.json") for k in range(2)]
        assert [r["state"] for r in receipts] == ["succeeded", "succeeded"]
        for receipt in receipts:  # one clock per unit: each unit's own receipt times its own steps
            names = {s["name"] for s in receipt["timing"]["spans"]}
            assert {"restore.criu_restore", "restore.units.network_unlock", "restore.units.released"} <= names
        # ... and unit 0's carries unit 1's too, on unit 1's clock (its own Unix origin) (receipt format 2's clocks)
        clocks = {c["clock_id"]: c for c in receipts[0]["timing"]["clocks"]}
        (unit_1_clock,) = [c for c in receipts[1]["timing"]["clocks"] if c["clock_id"] == "controller"]
        assert clocks["unit-1"]["owner"] == "unit" and clocks["unit-1"]["unix_origin_ns"] == unit_1_clock["unix_origin_ns"]
        assert "restore.criu_restore" in {s["name"] for s in receipts[0]["timing"]["spans"] if s["clock_id"] == "unit-1"}
        assert [_ask(client, c.address, prompt) for prompt in PROMPTS] == expected  # at host C's address
        assert seconds < 60
    finally:
        for host in (c, d):
            for pid in _namespace_pids(host):
                os.kill(pid, signal.SIGKILL)


def test_two_units_warmed_on_two_other_hosts_wake_together_and_answer_as_the_cold_pair(two_units):
    """``coldsnap warm`` of each unit parks both trees (their communicator rebuilt across the hosts at warm);
    ``coldsnap wake`` of each makes the pair serve: unit 0's canary, then the cold pair's tokens."""
    work, token, expected = two_units["work"], two_units["token"], two_units["expected"]
    a, b, c, d, e, client = two_units["hosts"]
    try:
        warms = _start(work, "warm", [c, d], _unit_argv(work, token, c, "warm", "warm", ["--ttl", "300"]))
        codes = [p.wait(timeout=300) for p in warms]
        assert codes == [0, 0], "\n".join((work / f"warm-{k}.log").read_text()[-3000:] for k in range(2))
        for k, host in enumerate((c, d)):
            names = {s["name"] for s in _receipt(work, f"warm-receipt-{k}.json")["timing"]["spans"]}
            assert {"warm.units.admitted", "warm.units.network_unlock", "warm.standby", "warm.units.parked"} <= names
            # (in the host's network namespace: the agents' control sockets are abstract, one set per namespace)
            listed = subprocess.run(host.command([sys.executable, "-m", "coldsnap", "status", "--json"]),
                                    capture_output=True, text=True, timeout=60, env=_env(work, host))
            assert [s["state"] for s in json.loads(listed.stdout)["standbys"]] == ["standby"], listed.stdout
        again = _start(work, "warm-again", [c, d], _unit_argv(work, token, c, "warm", "warm-again"))
        assert [p.wait(timeout=120) for p in again] == [0, 0]  # convergent: every unit's standby is there
        assert all("already runs" in " ".join(_receipt(work, f"warm-again-receipt-{k}.json")["warnings"]) for k in range(2))
        plain = subprocess.run([sys.executable, "-m", "coldsnap", "wake", str(work / "artifact-unit0")],
                               capture_output=True, text=True, timeout=60, env=_env(work, c))
        assert plain.returncode == 2 and "2 launch units" in plain.stderr and "Traceback" not in plain.stderr
        wakes = _start(work, "wake", [c, d], _unit_argv(work, token, c, "wake", "wake"))
        codes = [p.wait(timeout=300) for p in wakes]
        assert codes == [0, 0], "\n".join((work / f"wake-{k}.log").read_text()[-3000:] for k in range(2))
        for k in range(2):
            names = {s["name"] for s in _receipt(work, f"wake-receipt-{k}.json")["timing"]["spans"]}
            assert {"wake.units.admitted", "wake.resume", "wake.units.released"} <= names
        assert [_ask(client, c.address, prompt) for prompt in PROMPTS] == expected
    finally:
        for host in (c, d):
            for pid in _namespace_pids(host):
                os.kill(pid, signal.SIGKILL)


def test_restoring_a_subset_of_the_units_is_refused_before_anything_starts(two_units):
    work, token = two_units["work"], two_units["token"]
    a, b, c, d, e, client = two_units["hosts"]
    plain = subprocess.run([sys.executable, "-m", "coldsnap", "restore", str(work / "artifact-unit0")],
                           capture_output=True, text=True, timeout=60, env=_env(work, c))
    assert plain.returncode == 2 and "2 launch units" in plain.stderr and "Traceback" not in plain.stderr
    wrong = subprocess.run([sys.executable, "-m", "coldsnap", "restore", str(work / "artifact-unit0"), "--units", "3",
                            "--unit", "0", "--rendezvous", "127.0.0.1:1", "--rendezvous-token-file", str(token)],
                           capture_output=True, text=True, timeout=60, env=_env(work, c))
    assert wrong.returncode == 2 and "artifact of 2 launch unit(s)" in wrong.stderr


def _failed_within(work: Path, processes, victim_index: int, label: str) -> tuple[list[int], float]:
    """Wait for the launchers; the survivors' exit time after the victim's, in seconds."""
    victim = processes[victim_index]
    victim.wait(timeout=120)
    gone = time.monotonic()
    codes = [p.wait(timeout=120) for p in processes]
    return codes, time.monotonic() - gone


def test_a_unit_whose_port_is_taken_fails_both_named(two_units):
    work, token = two_units["work"], two_units["token"]
    a, b, c, d, e, client = two_units["hosts"]
    blocker = subprocess.Popen(c.command([sys.executable, "-c", (
        f"import socket, time; s = socket.create_server(('0.0.0.0', {PORT})); print('bound', flush=True); time.sleep(300)")]),
        stdout=subprocess.PIPE, text=True)
    try:
        assert blocker.stdout.readline().strip() == "bound"
        processes = _start(work, "port-taken", [c, e], _restore_argv(work, token, c, "port-taken"))
        codes, after = _failed_within(work, processes, 0, "port-taken")
        assert codes == [1, 1]
        mine = _receipt(work, "port-taken-receipt-0.json")["error"]
        theirs = _receipt(work, "port-taken-receipt-1.json")["error"]
        assert mine["code"] == "admission.port"
        assert theirs["code"] == "unit.rendezvous" and "unit 0" in theirs["message"] and "admission.port" in theirs["message"]
        assert after < 2.5
        assert _namespace_pids(e) == []  # nothing restored on the other host
    finally:
        blocker.kill()
        blocker.wait()


@pytest.mark.parametrize("victim", [0, 1], ids=["the unit serving the coordinator", "the other unit"])
def test_a_unit_killed_mid_restore_fails_the_other_within_two_seconds(two_units, victim):
    work, token = two_units["work"], two_units["token"]
    a, b, c, d, e, client = two_units["hosts"]
    hosts = (c, e)
    processes = _start(work, f"killed-{victim}", hosts, _restore_argv(work, token, c, f"killed-{victim}"))
    logs = [work / f"killed-{victim}-{k}.log" for k in range(2)]
    deadline = time.monotonic() + 60  # both joined: then the victim is killed during its admission or restore
    while not all("joined the coordinator" in log.read_text() for log in logs) and time.monotonic() < deadline:
        time.sleep(0.02)
    processes[victim].send_signal(signal.SIGKILL)  # (the host's sh exec'd into the launcher)
    codes, after = _failed_within(work, processes, victim, f"killed-{victim}")
    survivor = 1 - victim
    assert codes[survivor] == 1, (work / f"killed-{victim}-{survivor}.log").read_text()[-2000:]
    error = _receipt(work, f"killed-{victim}-receipt-{survivor}.json")["error"]
    assert error["code"] == "unit.rendezvous"
    assert ("unit 1 stopped responding" if victim == 1 else "went away") in error["message"]
    assert after < 2.5
    # A restored tree whose launcher died follows it: at once once the lease was taken, and within the agents'
    # lease wait (15 s, as captured) when the kill landed while CRIU ran (a slow machine's join comes late).
    for host in hosts:
        assert _namespace_pids_gone(host, 25) == [], f"left running on {host.hostname}"


def test_a_coordinator_that_never_answers_fails_the_unit_named(two_units):
    work, token = two_units["work"], two_units["token"]
    a, b, c, d, e, client = two_units["hosts"]
    started = time.monotonic()
    alone = subprocess.run(e.command([sys.executable, "-m", "coldsnap", "restore", str(work / "artifact-unit1"),
                                      "--units", "2", "--unit", "1", "--rendezvous", f"{c.address}:{RENDEZVOUS_PORT}",
                                      "--rendezvous-token-file", str(token), "--rendezvous-timeout", "2",
                                      "--receipt-json", str(work / "alone-receipt.json")]),
                           capture_output=True, text=True, timeout=60, env=_env(work, e))
    assert alone.returncode == 1 and time.monotonic() - started < 15
    error = _receipt(work, "alone-receipt.json")["error"]
    assert error["code"] == "unit.rendezvous" and f"{c.address}:{RENDEZVOUS_PORT}" in error["message"]
    assert _namespace_pids(e) == []


def _provider_hosts(work: Path, hosts) -> Path:
    """hosts.toml for the reference provider: each simulated host a ``local`` host whose prefix places a command
    there (its network, hostname, /dev/shm) with its unit's artifact directory at one path, ``work/artifact``, as
    two machines would hold it."""
    (work / "artifact").mkdir(exist_ok=True)
    lines = []
    for k, host in enumerate(hosts):
        setup = (f"hostname {host.hostname} && mount -t tmpfs -o mode=1777 tmpfs /dev/shm && "
                 f"mount --bind {work / f'artifact-unit{k}'} {work / 'artifact'} && exec \"$@\"")
        prefix = ["nsenter", f"--net=/var/run/netns/{host.namespace}", "unshare", "--uts", "--mount", "--propagation",
                  "private", "sh", "-c", setup, "simulated-host"]
        lines += [f"[hosts.{host.hostname}]", 'transport = "local"', f"prefix = {json.dumps(prefix)}",
                  f'env = {{ COLDSNAP_STATE_DIR = "{work / f"state-{host.hostname}"}", PYTHONPATH = "{REPO}" }}', ""]
    path = work / "provider-hosts.toml"
    path.write_text("\n".join(lines))
    return path


def test_one_command_restores_both_units_through_the_host_provider(two_units):
    """``coldsnap provider serve --hosts ... -- coldsnap restore DIR --unit-hosts C,D``: each unit restored on its
    host through the provider, unit 0's receipt for the pair, the pair answering as the cold pair; then the same
    with host E's unit failing (its port taken): the command fails naming unit 1, within 2 s, nothing left."""
    work, expected = two_units["work"], two_units["expected"]
    a, b, c, d, e, client = two_units["hosts"]
    hosts = _provider_hosts(work, [c, d])
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "coldsnap", "provider", "serve", "--hosts", str(hosts), "--",
                           sys.executable, "-m", "coldsnap", "restore", str(work / "artifact"), "--unit-hosts",
                           f"{c.hostname},{d.hostname}", "--receipt-json", str(work / "provider-receipt.json")],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    seconds = time.monotonic() - started
    print(f"one command through the provider: both units restored in {seconds:.2f} s "  # (pytest -s shows it)
          f"({' '.join(line for line in done.stderr.splitlines() if 'succeeded in' in line)})")
    try:
        assert done.returncode == 0, done.stderr[-4000:]
        receipt = _receipt(work, "provider-receipt.json")
        assert receipt["state"] == "succeeded"
        assert {c["clock_id"] for c in receipt["timing"]["clocks"]} >= {"controller", "unit-1"}  # every unit's spans
        assert [_ask(client, c.address, prompt) for prompt in PROMPTS] == expected
        assert seconds < 60
    finally:
        for host in (c, d):
            for pid in _namespace_pids(host):
                os.kill(pid, signal.SIGKILL)
    blocker = subprocess.Popen(e.command([sys.executable, "-c", (
        f"import socket, time; s = socket.create_server(('0.0.0.0', {PORT})); print('bound', flush=True); time.sleep(300)")]),
        stdout=subprocess.PIPE, text=True)
    try:
        assert blocker.stdout.readline().strip() == "bound"
        hosts = _provider_hosts(work, [c, e])
        done = subprocess.run([sys.executable, "-m", "coldsnap", "provider", "serve", "--hosts", str(hosts), "--",
                               sys.executable, "-m", "coldsnap", "restore", str(work / "artifact"), "--unit-hosts",
                               f"{c.hostname},{e.hostname}"], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
        assert done.returncode == 1 and f"unit 1 on host {e.hostname}" in done.stderr, done.stderr[-3000:]
        assert "Traceback" not in done.stderr
        assert _namespace_pids_gone(c, 25) == []  # unit 0's launcher cancelled: its tree followed it
        assert set(_namespace_pids(e)) <= {blocker.pid}
    finally:
        blocker.kill()
        blocker.wait()

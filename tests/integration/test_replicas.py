"""Replicas of one capsule with real CRIU on the reference workload: `coldsnap restore DIR --port P` run
twice at once gives two servers, each on its requested port (the capture's listening socket moved by
the port generation in a per-restore copy of files.img), each in pid namespaces of its own (both keep
the captured pids), each with its own state directory and agent socket; both give the cold start's
greedy tokens; the artifact's bytes never change; a taken port is refused at admission with nothing
started."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from coldsnap.activation.restore_place import port_free
from coldsnap.contracts.receipt import restored_pid
from coldsnap.demo import CHECK_PROMPT, cold_start
from coldsnap.activation.canary import ask_canary
from coldsnap.snapshot.process_tree import namespace_pid
from tests.helpers import coldsnap_receipt, file_digests, free_port
from tests.processes import capsule_root_pid, kill_replicas, replica_members

pytestmark = [
    pytest.mark.criu,
    pytest.mark.skipif(os.geteuid() != 0, reason="CRIU dump/restore needs root"),
]
pytest.importorskip("torch")


def _free_ports(count: int) -> list[int]:
    """``count`` different ports free now, and free with the next one each (a replica's port and a neighbour)."""
    ports: list[int] = []
    while len(ports) < count:
        if (port := free_port()) not in ports:
            ports.append(port)
    return ports


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    work = tmp_path_factory.mktemp("replicas")
    [port] = _free_ports(1)
    command = [sys.executable, "-m", "coldsnap.workloads.torch_lm", "--size", "tiny", "--device", "cpu", "--port", str(port)]
    _, tokens = cold_start(command, port)
    done, receipt = coldsnap_receipt("capture", "--out", str(work / "artifact"), "--", *command)
    assert done.returncode == 0, done.stderr[-3000:]
    yield work / "artifact", port, tokens
    kill_replicas(work / "artifact")


def _spans(receipt: dict) -> dict[str, dict]:
    return {s["name"]: s.get("attributes", {}) for s in receipt["timing"]["spans"]}


def test_two_replicas_restored_at_once_serve_on_their_own_ports(captured):
    artifact, captured_port, tokens = captured
    before = file_digests(artifact)
    try:
        for round_ in range(2):  # twice: a replica's second restore on its port replaces nothing of the other's
            ports = _free_ports(2)
            results: dict[int, tuple[subprocess.CompletedProcess, dict]] = {}
            threads = [threading.Thread(target=lambda p=p: results.update({p: coldsnap_receipt("restore", str(artifact),
                                                                                         "--port", str(p))}))
                       for p in ports]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            pids = []
            for port in ports:
                done, receipt = results[port]
                assert done.returncode == 0, done.stderr[-3000:]
                spans = _spans(receipt)
                assert spans["restore.admission.port"] == {"serving_port": port, "port_shift": port - captured_port,
                                                      "early_restore": True}  # (CRIU started at the entry)
                assert Path(spans["restore.criu_restore"]["state_dir"]).name == f"port-{port}"
                pids.append(restored_pid(receipt))
            # both alive at once, each its captured root pid in a pid namespace of its own
            assert len(set(pids)) == 2 and {namespace_pid(pid) for pid in pids} == {capsule_root_pid(artifact)}
            assert sorted(replica_members(artifact)) == sorted(pids)
            for port in ports:
                assert ask_canary(port, CHECK_PROMPT, 8).token_ids == tokens
            assert port_free(captured_port)  # nothing listens where the capture did
            assert kill_replicas(artifact) == []
    finally:
        kill_replicas(artifact)
    assert file_digests(artifact) == before  # many replicas later, not a byte of the artifact changed


def test_a_requested_port_that_is_taken_is_refused_at_admission(captured):
    artifact, _, _ = captured
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done, receipt = coldsnap_receipt("restore", str(artifact), "--port", str(port))
    assert done.returncode == 1 and receipt["error"]["code"] == "admission.port", done.stderr[-2000:]
    assert f"tcp 127.0.0.1:{port}" in receipt["error"]["message"] and "Traceback" not in done.stderr
    assert "restore.criu_restore" not in _spans(receipt) and replica_members(artifact) == []  # nothing started


def test_restores_racing_for_one_port_give_one_winner(captured):
    """Two, then three, restores of one capsule onto one port at once, ten times: exactly one serves the
    cold start's tokens; every other fails at admission with ``admission.port`` — the port's lock, naming
    the winner's operation id and launcher pid (or another racer's, holding the lock at that moment: the
    winner takes it at its program's entry and may be done before a loser's full admission), or, when it
    came after the winner was done, the port taken — and ran nothing past admission."""
    artifact, _, tokens = captured
    try:
        for round_ in range(10):
            for racers in (2, 3):
                [port] = _free_ports(1)
                launchers = [subprocess.Popen([sys.executable, "-m", "coldsnap", "restore", "--receipt-json", "-",
                                               str(artifact), "--port", str(port)],
                                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                             for _ in range(racers)]
                outcomes = [(launcher.pid, *launcher.communicate(timeout=300), launcher.returncode)
                            for launcher in launchers]
                receipts = [json.loads(out) for _, out, _, _ in outcomes]
                won = [i for i, r in enumerate(receipts) if r["state"] == "succeeded"]
                assert len(won) == 1, [(r["state"], r.get("error")) for r in receipts]
                winner_pid, winner_id = outcomes[won[0]][0], receipts[won[0]]["operation_id"]
                for (_, _, err, status), receipt in zip(outcomes, receipts):
                    if receipt["state"] == "succeeded":
                        continue
                    assert status == 1 and receipt["error"]["code"] == "admission.port", err[-2000:]
                    message = receipt["error"]["message"]
                    assert (f"restore {winner_id}" in message and f"pid {winner_pid})" in message
                            or f"tcp 127.0.0.1:{port}" in message
                            or any(f"(pid {pid})" in message for pid, *_ in outcomes)), message
                    assert not [s for s in _spans(receipt) if ".admission." not in s and s != "controller.restore"]
                    assert "Traceback" not in err
                assert ask_canary(port, CHECK_PROMPT, 8).token_ids == tokens, f"round {round_}, {racers} racers"
                assert len(replica_members(artifact)) >= 1 and kill_replicas(artifact) == []
    finally:
        kill_replicas(artifact)


def test_a_gpu_without_room_is_refused_at_admission_standin(captured):
    """GPU memory admission, on a machine without a GPU: COLDSNAP_STANDIN_GPU_FREE_BYTES makes the capsule's
    host-backed regions a stand-in GPU's needs. Too little free: prepare-only and restore both refuse
    with ``admission.gpu_memory`` (needed vs free) and start nothing; enough: prepare-only admits."""
    artifact, _, _ = captured
    capsule = json.loads((artifact / "units" / "unit-0" / "capsule.json").read_text())
    needed = sum(r["high_water"] for w in capsule["metadata"]["workers"] for r in w["regions"].values())
    assert needed > 0
    for free, prepare_only in ((needed - 1, True), (needed - 1, False), (needed, True)):
        [port] = _free_ports(1)
        env = {**os.environ, "COLDSNAP_STANDIN_GPU_FREE_BYTES": str(free)}
        done, receipt = coldsnap_receipt("restore", str(artifact), "--port", str(port),
                                         *(["--prepare-only"] if prepare_only else []), env=env)
        if free < needed:
            assert done.returncode == 1 and receipt["error"]["code"] == "admission.gpu_memory", done.stderr[-2000:]
            assert receipt["error"]["message"].startswith("not enough GPU memory: stand-in GPU (host memory) needs")
            assert "restore.criu_restore" not in _spans(receipt) and replica_members(artifact) == []
        else:
            assert done.returncode == 0, done.stderr[-2000:]
            assert _spans(receipt)["restore.admission.gpu_memory"] == {
                "stand-in GPU (host memory).need_bytes": needed, "stand-in GPU (host memory).free_bytes": needed}

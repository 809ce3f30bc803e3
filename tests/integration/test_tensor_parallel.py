"""Tensor parallel (TP2) capture and restore on the CPU: the reference workload's two ranks all-reduce
over loopback TCP communicators that are torn down before the dump and rebuilt after restore through
the activation's coordinator — the NCCL sequence, with the host backend standing in for NCCL."""

import importlib
import json
import os
import sys
import time

import pytest

pytest.importorskip("torch")
pytest.importorskip("zmq")
pytestmark = [
    pytest.mark.criu,
    pytest.mark.skipif(os.geteuid() != 0, reason="CRIU needs root"),
]

from tests.integration.test_capture_restore import (  # noqa: E402
    PROMPT_2, cold_start_tokens, coldsnap, complete)
from tests.helpers import free_port  # noqa: E402
from tests.processes import (capsule_root_pid, group_members, kill_group, kill_replicas, launched_pid,  # noqa: E402
                             replica_members)


def workload(port: int) -> list[str]:
    return [sys.executable, "-m", "coldsnap.workloads.torch_lm", "--size", "tiny", "--device", "cpu", "--tp", "2",
            "--port", str(port)]


@pytest.fixture(scope="module")
def tp_captured(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-capture")
    port = free_port()
    expected = cold_start_tokens(workload(port), port)
    artifact = root / "artifact"
    result = coldsnap("capture", "--out", str(artifact), "--receipt-json", str(root / "capture-receipt.json"),
                      "--", *workload(port))
    assert result.returncode == 0, result.stderr.decode()
    engine = launched_pid(json.loads((root / "capture-receipt.json").read_text()))
    assert engine == capsule_root_pid(artifact)  # the restored tree's process group is the captured one's
    assert group_members(engine) == []
    yield artifact, port, expected, root
    kill_group(engine)


def test_tp2_capture_records_a_worker_per_rank(tp_captured):
    artifact, _, _, root = tp_captured
    assert coldsnap("validate", "artifact", str(artifact / "artifact.json")).returncode == 0
    descriptor = json.loads((artifact / "artifact.json").read_text())
    workers = descriptor["units"][0]["workers"]
    assert [w["rank"] for w in workers] == [0, 1]
    assert workers[0]["payload"]["path"] != workers[1]["payload"]["path"]  # each rank its own shard
    capsule = json.loads((artifact / "units" / "unit-0" / "capsule.json").read_text())["metadata"]
    assert [w["control"].endswith(".rank1") for w in capsule["workers"]] == [False, True]
    prepare = next(s for s in json.loads((root / "capture-receipt.json").read_text())["timing"]["spans"]
                   if s["name"] == "capture.prepare")["attributes"]
    for rank_prefix in ("", "rank1."):  # both ranks drained in order and tore their communicator down
        assert {f"{rank_prefix}drain_barrier_ns", f"{rank_prefix}teardown_ns"} <= set(prepare)


def test_tp2_restore_twice_gives_the_cold_start_tokens(tp_captured):
    artifact, port, expected, root = tp_captured
    for attempt in range(2):
        receipt_path = root / f"restore-{attempt}.json"
        result = coldsnap("restore", str(artifact), "--receipt-json", str(receipt_path))
        assert result.returncode == 0, result.stderr.decode()
        assert b"canary matched" in result.stderr
        assert complete(port, PROMPT_2) == expected  # rank 1 follows again over a rebuilt communicator
        assert len(replica_members(artifact)) == 3  # the supervisor and both ranks
        assert coldsnap("validate", "receipt", str(receipt_path)).returncode == 0
        resume = next(s for s in json.loads(receipt_path.read_text())["timing"]["spans"]
                      if s["name"] == "restore.resume")["attributes"]
        for rank_prefix in ("", "rank1."):
            assert resume[f"{rank_prefix}source"] == "native"
            assert {f"{rank_prefix}rebuild_ns", f"{rank_prefix}resumed_barrier_ns"} <= set(resume)
        kill_replicas(artifact)


def test_two_tp2_replicas_restored_at_once_each_keep_their_ranks_connections(tp_captured, tmp_path):
    """The TP2 tree's ranks talk over TCP (the rank channels, restored connected by CRIU's TCP repair):
    two replicas at once on ports of their own move both ends of every such connection by their port
    generation, so each replica's ranks stay joined to each other, and both serve the cold start's tokens."""
    import threading

    artifact, _, expected, _ = tp_captured
    ports = [free_port(), free_port()]
    results: dict[int, object] = {}
    threads = [threading.Thread(target=lambda p=p: results.update({p: coldsnap("restore", str(artifact), "--port", str(p))}))
               for p in ports]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for port in ports:
            assert results[port].returncode == 0, results[port].stderr.decode()[-3000:]
        assert [complete(port, PROMPT_2) for port in ports] == [expected, expected]
        assert len(replica_members(artifact)) == 6  # each replica: the supervisor and both ranks
    finally:
        kill_replicas(artifact)


def test_tp2_warm_rebuilds_nccl_and_wake_serves_the_cold_start_tokens(tp_captured, tmp_path, monkeypatch):
    """Both ranks park together (their communicator rebuilt at warm), and wake together without rebuilding it."""
    artifact, port, expected, _ = tp_captured
    monkeypatch.setenv("COLDSNAP_STATE_DIR", str(tmp_path / "state"))
    try:
        result = coldsnap("warm", str(artifact), "--receipt-json", str(tmp_path / "warm.json"))
        assert result.returncode == 0, result.stderr.decode()
        standby = next(s for s in json.loads((tmp_path / "warm.json").read_text())["timing"]["spans"]
                       if s["name"] == "warm.standby")["attributes"]
        for rank_prefix in ("", "rank1."):
            assert {f"{rank_prefix}rebuild_ns", f"{rank_prefix}standby_barrier_ns"} <= set(standby)
        assert len(replica_members(artifact)) == 3
        result = coldsnap("wake", str(artifact), "--receipt-json", str(tmp_path / "wake.json"))
        assert result.returncode == 0, result.stderr.decode()
        assert complete(port, PROMPT_2) == expected
        resume = next(s for s in json.loads((tmp_path / "wake.json").read_text())["timing"]["spans"]
                      if s["name"] == "wake.resume")["attributes"]
        for rank_prefix in ("", "rank1."):
            assert resume[f"{rank_prefix}source"] == "native"
            assert f"{rank_prefix}rebuild_ns" not in resume  # rebuilt at warm already
    finally:
        kill_replicas(artifact)


def _in_process(argv: list[str]) -> int:
    from coldsnap.cli import main

    return main(argv)


def test_one_rank_failing_its_resume_fails_both_at_once(tp_captured, tmp_path, monkeypatch):
    """Rank 1's agent refuses its resume (wrong layout digest): the launcher aborts the coordinator, so
    rank 0 — hydrated and waiting to rebuild NCCL — fails at once too; the receipt names rank 1, nothing
    is left running, the artifact is untouched."""
    restore_module = importlib.import_module("coldsnap.activation.restore_steps")

    artifact, port, _, _ = tp_captured
    class Rank1Refused(restore_module.AgentClient):
        def resume(self, command, **kwargs):
            if self.control.endswith(".rank1"):
                command = command.model_copy(update={"layout_digest": "0" * 64})
            return super().resume(command, **kwargs)

    monkeypatch.setattr(restore_module, "AgentClient", Rank1Refused)
    before = (artifact / "artifact.json").read_bytes()
    receipt = tmp_path / "receipt.json"
    started = time.monotonic()
    assert _in_process(["restore", str(artifact), "--receipt-json", str(receipt)]) == 1
    assert time.monotonic() - started < 30  # not the 300 s rebuild barrier timeout
    error = json.loads(receipt.read_text())["error"]
    assert error["code"] == "restore.resume" and "rank 1" in error["message"] and "layout digest" in error["message"]
    assert replica_members(artifact) == []
    assert (artifact / "artifact.json").read_bytes() == before


def test_one_rank_failing_its_prepare_commits_nothing(tmp_path, monkeypatch):
    capture_module = importlib.import_module("coldsnap.activation.capture_steps")

    port = free_port()
    class Rank1CannotWrite(capture_module.AgentClient):
        def prepare(self, command, **kwargs):
            if self.control.endswith(".rank1"):  # not a directory anyone can create
                command = command.model_copy(update={"pack_dir": "/proc/version/payload"})
            return super().prepare(command, **kwargs)

    monkeypatch.setattr(capture_module, "AgentClient", Rank1CannotWrite)
    out = tmp_path / "artifact"
    receipt = tmp_path / "receipt.json"
    assert _in_process(["capture", "--out", str(out), "--receipt-json", str(receipt), "--", *workload(port)]) == 1
    document = json.loads(receipt.read_text())
    error = document["error"]
    assert error["code"] == "capture.prepare" and "rank 1" in error["message"]
    assert not (out / "artifact.json").exists() and group_members(launched_pid(document)) == []


def test_capture_refuses_a_rank_count_the_engine_does_not_run(tmp_path):
    port = free_port()
    result = coldsnap("capture", "--out", str(tmp_path / "a"), "--ranks", "1", "--receipt-json", "-", "--", *workload(port))
    assert result.returncode == 1
    receipt = json.loads(result.stdout)
    error = receipt["error"]
    assert error["code"] == "capture.topology" and "2 rank(s)" in error["message"]
    assert group_members(launched_pid(receipt)) == []

"""Warm standby of the reference workload on CPU, with real CRIU: `coldsnap warm`, `status`, `wake`."""

import json
import os
import signal
import threading
import time

import pytest

from tests.integration.test_capture_restore import PROMPT_2, captured, coldsnap, complete  # noqa: F401 (fixture)
from coldsnap.snapshot.process_tree import namespace_pid
from tests.processes import capsule_root_pid, kill_replicas, replica_members, restore_killed_at, wait_replicas_gone

pytest.importorskip("torch")
pytestmark = [
    pytest.mark.criu,
    pytest.mark.skipif(os.geteuid() != 0, reason="CRIU needs root"),
]


@pytest.fixture
def state_dir(tmp_path, monkeypatch):
    """Each test its own state directory: its standby registry is the test's alone."""
    state = tmp_path / "state"
    monkeypatch.setenv("COLDSNAP_STATE_DIR", str(state))
    return state


def standbys() -> list[dict]:
    result = coldsnap("status", "--json")
    assert result.returncode == 0, result.stderr.decode()
    return json.loads(result.stdout)["standbys"]


def spans(receipt_path) -> dict[str, dict]:
    return {s["name"]: s for s in json.loads(receipt_path.read_text())["timing"]["spans"]}


def test_warm_parks_a_standby_that_wake_makes_serve_the_cold_start_tokens(captured, state_dir, tmp_path):  # noqa: F811
    artifact, port, expected, _ = captured
    root = capsule_root_pid(artifact)
    try:
        result = coldsnap("warm", str(artifact), "--receipt-json", str(tmp_path / "warm.json"))
        assert result.returncode == 0, result.stderr.decode()
        assert coldsnap("validate", "receipt", str(tmp_path / "warm.json")).returncode == 0
        warm = spans(tmp_path / "warm.json")
        assert {"warm.admission.capsule", "warm.criu_restore", "warm.lease", "warm.standby"} <= set(warm)
        assert "warm.resume" not in warm and "warm.canary" not in warm  # no weights, no serving yet
        listed = standbys()
        assert [(s["state"], namespace_pid(s["pid"]), s["serving_port"], s["artifact"]) for s in listed] == [
            ("standby", root, port, str(artifact))]  # its root: the captured pid in its own namespace
        assert (state_dir / listed[0]["standby_id"] / "standby.json").exists()
        assert replica_members(artifact)  # nobody holds it, and it lives on

        # The port is bound already: a request sent now waits for the wake, then gets its answer.
        early: dict = {}
        asker = threading.Thread(target=lambda: early.update(tokens=complete(port, PROMPT_2)))
        asker.start()
        time.sleep(0.5)
        assert asker.is_alive(), "a standby answered before it was woken"

        restore = coldsnap("restore", str(artifact))  # the standby holds the port: refused, and said why
        assert restore.returncode == 1 and b"held by a warm standby" in restore.stderr

        result = coldsnap("wake", listed[0]["standby_id"], "--receipt-json", str(tmp_path / "wake.json"))
        assert result.returncode == 0, result.stderr.decode()
        assert b"canary matched" in result.stderr
        assert coldsnap("validate", "receipt", str(tmp_path / "wake.json")).returncode == 0
        wake = spans(tmp_path / "wake.json")
        assert wake["wake.resume"]["attributes"]["source"] == "native" and wake["wake.resume"]["attributes"]["bytes"] > 0
        assert wake["wake.canary"]["attributes"]["checked"].startswith("prompt argmax at")
        assert "wake.criu_restore" not in wake  # the standby was restored at warm
        asker.join(30)
        assert early.get("tokens") == expected  # the early request, served after the wake
        assert complete(port, PROMPT_2) == expected
        assert standbys() == [] and not (state_dir / listed[0]["standby_id"] / "standby.json").exists()

        again = coldsnap("wake", str(artifact), "--receipt-json", str(tmp_path / "wake-again.json"))
        assert again.returncode == 1
        assert json.loads((tmp_path / "wake-again.json").read_text())["error"]["code"] == "wake.standby"
        assert complete(port, PROMPT_2) == expected  # a refused wake leaves the server alone
    finally:
        kill_replicas(artifact)


def test_warm_is_convergent_and_a_killed_standby_leaves_nothing(captured, state_dir, tmp_path):  # noqa: F811
    artifact, _, _, _ = captured
    try:
        assert coldsnap("warm", str(artifact)).returncode == 0
        second = coldsnap("warm", str(artifact), "--receipt-json", str(tmp_path / "second.json"))
        assert second.returncode == 0, second.stderr.decode()
        receipt = json.loads((tmp_path / "second.json").read_text())
        assert receipt["replay_semantics"] == "convergent"
        assert any("already runs" in w for w in receipt["warnings"])
        assert len(standbys()) == 1

        assert kill_replicas(artifact) == []
        assert standbys() == []  # the stale record is found and removed
        assert list(state_dir.glob("*/standby.json")) == []
        assert replica_members(artifact) == []
        assert coldsnap("wake", str(artifact)).returncode == 1
        assert coldsnap("restore", str(artifact), "--prepare-only").returncode == 0  # the port is free again
    finally:
        kill_replicas(artifact)


def test_a_standby_nobody_wakes_stops_itself_and_removes_its_record(captured, state_dir):  # noqa: F811
    artifact, _, _, _ = captured
    try:
        result = coldsnap("warm", str(artifact), "--ttl", "2")
        assert result.returncode == 0, result.stderr.decode()
        assert replica_members(artifact)
        assert wait_replicas_gone(artifact, 15) == []
        assert list(state_dir.glob("*/standby.json")) == []  # removed by the standby itself
        assert standbys() == []
    finally:
        kill_replicas(artifact)


def test_a_wake_killed_mid_resume_stops_the_standby(captured, state_dir, tmp_path):  # noqa: F811
    """The wake's launcher holds the standby's lease from its first step: killed mid-wake, the
    half-woken standby stops (no state worth keeping) and nothing is left."""
    artifact, _, _, _ = captured
    try:
        assert coldsnap("warm", str(artifact)).returncode == 0
        launcher = restore_killed_at(artifact, "wake.resume", tmp_path / "wake.json", operation="wake")
        assert launcher.returncode == -signal.SIGKILL, "the wake ended before its resume started"
        assert wait_replicas_gone(artifact, 15) == []
        assert standbys() == []
    finally:
        kill_replicas(artifact)


def test_warm_and_wake_refuse_bad_input_without_a_traceback(tmp_path, state_dir):
    for args in (["wake", "no-such-standby"], ["warm", str(tmp_path)], ["warm", "--ttl", "0", str(tmp_path)]):
        result = coldsnap(*args)
        assert result.returncode == 2 and b"Traceback" not in result.stderr, args

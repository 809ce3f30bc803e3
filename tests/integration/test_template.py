"""The n580 template (`python -m coldsnap.agent.template`) with real CRIU: the reference workload's
launcher stopped at the pre-CUDA boundary (torch and the model code imported), dumped, restored twice from
one image, each time placed on another serving port, and serving the cold start's greedy tokens; a
placement of another ABI is refused and the template keeps waiting; the template holds no NVIDIA
userspace-driver state. (`coldsnap capture/restore --driver n580` drive it: tests/integration/test_n580.py.)"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from coldsnap.activation.canary import ask_canary
from coldsnap.snapshot.criu import CriuSnapshotter
from coldsnap.snapshot.nvidia_mappings import nvidia_userspace_state
from coldsnap.snapshot.process_tree import kill_tree, tree_pids
from tests.helpers import free_port

pytestmark = [
    pytest.mark.criu,
    pytest.mark.skipif(os.geteuid() != 0, reason="CRIU dump/restore needs root"),
]
pytest.importorskip("torch")
REPO = Path(__file__).resolve().parents[2]
PROMPT = "The template's prompt."



def _ask(control: str, request: dict, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
                client.connect("\0" + control[1:])
                client.sendall(json.dumps(request).encode() + b"\n")
                answer = json.loads(client.makefile().readline())
                if request["op"] == "place" and answer.get("ok"):
                    client.sendall(b"handover\n")  # the test holds the engine from here
                return answer
        except (ConnectionRefusedError, FileNotFoundError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _tokens(port: int, timeout: float = 60.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return ask_canary(port, PROMPT, 8, timeout=30).token_ids
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _workload(port: int) -> list[str]:
    return [sys.executable, "-m", "coldsnap.workloads.torch_lm", "--size", "tiny", "--device", "cpu", "--port", str(port)]


def test_a_restored_template_is_placed_on_another_port_and_serves_the_cold_starts_tokens(tmp_path):
    cold_port = free_port()
    cold = subprocess.Popen(_workload(cold_port), cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        expected = _tokens(cold_port)
    finally:
        kill_tree(cold.pid)
        cold.wait(timeout=10)

    control = f"@coldsnap-template-test-{uuid.uuid4().hex[:12]}"
    log = open(tmp_path / "template.log", "ab")
    template = subprocess.Popen(
        [sys.executable, "-m", "coldsnap.agent.template", "--control", control,
         "--preload", "torch,coldsnap.workloads.torch_lm.serve", "--", *_workload(cold_port)],
        cwd=REPO, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    roots = [template.pid]
    try:
        status = _ask(control, {"op": "status"}, timeout=120)
        assert status == {"state": "boundary", "abi": 2, "pid": template.pid,
                          "preloaded": ["torch", "coldsnap.workloads.torch_lm.serve"]}
        assert nvidia_userspace_state(tree_pids(template.pid)) == []
        images = tmp_path / "images"
        snapshotter = CriuSnapshotter()
        snapshotter.dump(template.pid, images)
        template.wait(timeout=10)  # reap: the restore reuses its pid

        for attempt in range(2):  # one template image, two placements
            restored = snapshotter.restore(images, tmp_path / f"restore-{attempt}")
            roots.append(restored.pid)
            refused = _ask(control, {"op": "place", "placement": {"abi": 1, "serving_port": 1}})
            assert refused["ok"] is False and "placement ABI 1 sent to a template of placement ABI 2" in refused["error"]
            port = free_port()
            placed = _ask(control, {"op": "place", "placement": {"abi": 2, "serving_port": port,
                                                                  "env": {"COLDSNAP_TEMPLATE_TEST": "1"}}})
            assert placed == {"ok": True}
            assert _tokens(port) == expected
            kill_tree(restored.pid)
    finally:
        for root in roots:
            kill_tree(root)
        log.close()


def test_nvidia_driver_libraries_and_devices_are_found_in_a_process(tmp_path):
    fake = tmp_path / "libnvidia-fake.so.580"
    fake.write_bytes(b"\0" * 4096)
    holder = subprocess.Popen([sys.executable, "-c", "import mmap, sys, time\nf = open(sys.argv[1], 'rb')\n"
                               "m = mmap.mmap(f.fileno(), 4096, prot=mmap.PROT_READ)\nprint('mapped', flush=True)\n"
                               "time.sleep(60)", str(fake)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "mapped"
        found = nvidia_userspace_state([holder.pid, os.getpid()])
        assert found == [f"{holder.pid}: {fake}"]
    finally:
        holder.kill()
        holder.wait()



def test_a_placed_template_dies_with_the_launcher_that_placed_it_before_the_handover(tmp_path):
    from coldsnap.agent.client import TemplateClient

    control = f"@coldsnap-template-test-{uuid.uuid4().hex[:12]}"
    port = free_port()
    template = subprocess.Popen(
        [sys.executable, "-m", "coldsnap.agent.template", "--control", control, "--preload", "torch", "--",
         *_workload(port)], cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, start_new_session=True)
    try:
        _ask(control, {"op": "status"}, timeout=120)
        link = TemplateClient(control).place({"abi": 2, "serving_port": port})
        link.close()  # the launcher is gone before it took the engine over
        assert template.wait(timeout=30) == -9
        assert b"the launcher went away before it took the engine over" in template.stderr.read()
    finally:
        kill_tree(template.pid)

"""Captures that cannot succeed fail early and say why: a server with no coldsnap agent, a command that
exits at once, a tree holding connections to peers outside it. None of them reaches CRIU."""

import importlib
import json
import re
import socket
import sys
import textwrap
import time

import pytest

from tests.helpers import coldsnap_receipt, free_port
from tests.processes import group_members, kill_group, launched_pid


def _in_process(argv: list[str]) -> int:
    from coldsnap.cli import main

    return main(argv)


def test_a_server_without_a_coldsnap_agent_fails_once_its_http_answers(tmp_path, monkeypatch, capsys):
    """``python3 -m http.server`` (vLLM started without ``--load-format coldsnap`` looks the same): its port
    answers, no agent ever will; the capture says so within the agent's grace, not after 900 s."""
    capture_module = importlib.import_module("coldsnap.activation.capture_state")
    monkeypatch.setattr(capture_module, "AGENT_AFTER_HTTP_S", 2.0)
    port = free_port()
    out, receipt = tmp_path / "artifact", tmp_path / "receipt.json"
    started = time.monotonic()
    # (--reference none: a plain start of a server that never answers /health with 200 would wait out its timeout)
    status = _in_process(["capture", "--engine", "vllm", "--reference", "none", "--out", str(out), "--receipt-json", str(receipt), "--port",
                          str(port), "--", sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)])
    document = json.loads(receipt.read_text())
    try:
        assert status == 1 and time.monotonic() - started < 60
        error = document["error"]
        assert error["code"] == "capture.agent", error
        assert f"port {port} answers HTTP, but no coldsnap agent answered" in error["message"]
        assert "`--load-format coldsnap`" in error["message"] and "Python environment" in error["message"]
        progress = capsys.readouterr().err
        assert f"waiting for its coldsnap agent and for HTTP on port {port}" in progress
        assert f"HTTP answers on port {port}; waiting for the coldsnap agent (at most 2 s more)" in progress
        assert group_members(launched_pid(document)) == [] and not out.exists()
    finally:
        kill_group(launched_pid(document))


@pytest.mark.parametrize("code, ended", [
    ("print('cannot load the model: no such file'); sys.exit(3)", "the command exited with status 3"),
    ("print('out of memory', flush=True); os.kill(os.getpid(), signal.SIGKILL)",
     "the command was killed by signal 9 (SIGKILL)"),
])
def test_a_command_that_exits_at_once_is_reported_with_its_exit_status_and_last_line(tmp_path, code, ended):
    port = free_port()
    done, receipt = coldsnap_receipt("capture", "--engine", "torch-lm", "--out", str(tmp_path / "artifact"), "--",
                                     sys.executable, "-c", f"import os, signal, sys; {code}", "--port", str(port),
                                     timeout=120)
    assert done.returncode == 1, done.stderr
    error = receipt["error"]
    last_line = code.split("'")[1]
    assert error["code"] == "capture.launch"
    assert error["message"] == (f"the serving process exited before its coldsnap agent answered: {ended} "
                                f"| engine log: {last_line}")
    assert f"capture failed; the engine's last lines:\n{last_line}" in done.stderr
    assert not (tmp_path / "artifact").exists()


def test_a_capture_into_a_taken_port_is_refused_before_anything_starts(tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        done, receipt = coldsnap_receipt("capture", "--engine", "torch-lm", "--out", str(tmp_path / "artifact"), "--",
                                         sys.executable, "-c", "pass", "--port", str(port), timeout=120)
    assert done.returncode == 1
    assert receipt["error"] == {"code": "capture.port", "message": f"serving port {port} is taken: stop what listens "
                                "there, or serve on another port"}
    assert launched_pid(receipt) is None and not (tmp_path / "artifact").exists()


def test_a_tree_holding_a_connection_to_a_peer_outside_is_refused_before_the_checkpoint(tmp_path):
    """The reference workload, started by a wrapper that first connects to this test (a peer outside the
    tree): the capture names the connection and fails before the CUDA checkpoint and the CRIU dump."""
    pytest.importorskip("torch")
    # (`python -c`, as `python -m` in the other tests, imports the coldsnap of the working directory)
    wrapper = textwrap.dedent("""\
        import runpy, socket, sys

        peer = socket.create_connection(("127.0.0.1", int(sys.argv.pop(1))))  # held while serving
        runpy.run_module("coldsnap.workloads.torch_lm", run_name="__main__", alter_sys=True)
    """)
    port = free_port()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        peer_port = listener.getsockname()[1]
        done, receipt = coldsnap_receipt("capture", "--engine", "torch-lm", "--out", str(tmp_path / "artifact"), "--",
                                         sys.executable, "-c", wrapper, str(peer_port), "--size", "tiny", "--device",
                                         "cpu", "--port", str(port), timeout=300)
    pid = launched_pid(receipt)
    try:
        assert done.returncode == 1, done.stderr[-3000:]
        error = receipt["error"]
        assert error["code"] == "capture.connections", error
        held = re.findall(r"pid \d+ holds \S+ -> [^;\s]+", error["message"])
        assert len(held) == 1 and re.fullmatch(rf"pid {pid} holds 127\.0\.0\.1:\d+ -> 127\.0\.0\.1:{peer_port}",
                                               held[0]), error["message"]
        spans = {s["name"] for s in receipt["timing"]["spans"]}
        assert "capture.prepare" in spans and not spans & {"capture.cuda_checkpoint", "capture.criu_dump"}
        assert group_members(pid) == [] and not (tmp_path / "artifact").exists()
    finally:
        if pid is not None:
            kill_group(pid)

"""Placement ABI 2 (coldsnap.contracts.placement) and how the n580 template applies a placement."""

import os

import pytest

from coldsnap.contracts.base import ContractError, decode_document
from coldsnap.contracts.placement import PlacementRecord, PlacementRefused, check_placement_abi


def test_a_placement_sets_the_environment_and_the_serving_port(monkeypatch):
    from coldsnap.agent.template import apply_placement, entry

    monkeypatch.delenv("COLDSNAP_TEMPLATE_TEST", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    record = PlacementRecord(abi=2, serving_port=9001, visible_devices="1", env={"COLDSNAP_TEMPLATE_TEST": "1"})
    assert apply_placement(["python", "-m", "m", "--port", "8000", "--port=8001", "--portal", "x"], record) == [
        "python", "-m", "m", "--port", "9001", "--port=9001", "--portal", "x"]
    assert os.environ["COLDSNAP_TEMPLATE_TEST"] == "1" and os.environ["CUDA_VISIBLE_DEVICES"] == "1"
    assert apply_placement(["x", "--port", "8000"], PlacementRecord(abi=2)) == ["x", "--port", "8000"]
    with pytest.raises(ValueError, match="cannot run '/bin/true' in the template's process"):
        entry(["/bin/true"])


def test_placements_a_template_cannot_take_are_refused():
    check_placement_abi(2, PlacementRecord(abi=2, env={"NCCL_SOCKET_IFNAME": "eth0"}))
    with pytest.raises(PlacementRefused, match="placement ABI 3 sent to a template of placement ABI 2"):
        check_placement_abi(2, PlacementRecord(abi=3))
    with pytest.raises(PlacementRefused, match="is not an environment variable name"):
        check_placement_abi(2, PlacementRecord(abi=2, env={"A=B": "1"}))
    # An ABI-1 template may map the NVIDIA userspace driver's libraries: only its captured driver takes it.
    check_placement_abi(1, PlacementRecord(abi=1), captured_driver="580.159.04", host_driver="580.159.04")
    for host in ("580.82.07", "610.1", None):
        with pytest.raises(PlacementRefused, match="captured under driver 580.159.04 cannot be restored under"):
            check_placement_abi(1, PlacementRecord(abi=1), captured_driver="580.159.04", host_driver=host)
    check_placement_abi(2, PlacementRecord(abi=2), captured_driver="580.159.04", host_driver="610.1")  # portable


@pytest.mark.parametrize("document, problem", [
    ({"abi": "2"}, "abi"),
    ({"abi": 2, "serving_port": 70000}, "serving_port"),
    ({"abi": 2, "visible_devices": "0; rm -rf"}, "visible_devices"),
    ({"abi": 2, "hosts": []}, "hosts"),
])
def test_placement_records_decode_strictly(document, problem):
    with pytest.raises(ContractError) as caught:
        decode_document(PlacementRecord, document, "placement")
    assert problem in str(caught.value)


# ---- what an n580 restore hands its template (coldsnap.activation.n580.template_placement) ----------------

def _restore_scene(tmp_path, abi=2, driver="580.159.04", port=9100, env=None, graphs="recreate"):
    from types import SimpleNamespace as NS

    template = NS(placement_abi=abi, nvidia_driver=driver, control="@t")
    capsule = NS(metadata=NS(template=template, serving_port=8000))
    worker = NS(rank=0, payload=NS(path="payload/abc.pack"))
    descriptor = NS(units=[NS(workers=[worker])])
    unit = NS(serving_port=port, env=env or {})
    context = NS(request=NS(units=[unit], unit=None, policy=NS(graphs=NS(mode=graphs)), api_key_file=None))
    return context, NS(root=tmp_path), descriptor, capsule


def test_an_n580_placement_carries_the_port_the_gpu_the_units_env_and_the_pack(tmp_path, monkeypatch):
    from coldsnap.activation import n580

    monkeypatch.setattr(n580, "nvidia_kernel_driver", lambda: "590.1")  # ABI 2: any driver
    scene = _restore_scene(tmp_path, env={"CUDA_VISIBLE_DEVICES": "1", "HF_HUB_OFFLINE": "1",
                                          "COLDSNAP_TEMPLATE_PRELOAD": "torch", "COLDSNAP_PLACEMENT_ABI": "2"})
    record = n580.template_placement(*scene, {0: "native"}, "@agent", 9100)
    assert record.abi == 2 and record.serving_port == 9100 and record.visible_devices == "1"
    assert record.env == {"HF_HUB_OFFLINE": "1", "COLDSNAP_CONTROL": "@agent", "COLDSNAP_WEIGHTS_MODE": "native",
                          "COLDSNAP_NATIVE_PACK": str(tmp_path / "payload" / "abc.pack"),
                          "COLDSNAP_GRAPHS": "after-ready"}  # graph policy recreate: eager first
    recovery = n580.template_placement(*_restore_scene(tmp_path, port=None, graphs="retain"), {0: "recovery"}, "@agent",
                                       8000)
    assert recovery.serving_port == 8000 and recovery.visible_devices is None  # the captured port
    assert recovery.env == {"COLDSNAP_CONTROL": "@agent", "COLDSNAP_WEIGHTS_MODE": "recovery"}  # the engine loads


@pytest.mark.parametrize("abi, host, problem", [
    (3, "580.159.04", "the template speaks placement ABI 3; this build speaks 1, 2"),
    (1, "580.82.07", "captured under driver 580.159.04 cannot be restored under 580.82.07"),
])
def test_an_n580_placement_the_template_cannot_take_is_refused_at_admission(tmp_path, monkeypatch, abi, host, problem):
    from coldsnap.activation import n580
    from coldsnap.operation import OperationFailed

    monkeypatch.setattr(n580, "nvidia_kernel_driver", lambda: host)
    with pytest.raises(OperationFailed) as caught:
        n580.template_placement(*_restore_scene(tmp_path, abi=abi), {0: "native"}, "@agent", 9100)
    assert caught.value.code == "admission.placement" and problem in caught.value.message


def test_the_template_runs_with_the_commands_own_python(tmp_path):
    from coldsnap.activation.n580 import interpreter_of

    python = tmp_path / "venv" / "bin" / "python3.12"
    python.parent.mkdir(parents=True)
    script = python.parent / "vllm"
    script.write_text(f"#!{python}\nimport sys\n")
    assert interpreter_of([str(script), "serve", "m"]) == str(python)
    assert interpreter_of([str(python), "-m", "m"]) == str(python)
    env_script = tmp_path / "tool"
    env_script.write_text("#!/usr/bin/env python3\n")
    assert os.path.basename(interpreter_of([str(env_script)])).startswith("python")
    shell = tmp_path / "run.sh"
    shell.write_text("#!/bin/sh\n")
    import sys

    assert interpreter_of([str(shell)]) == sys.executable  # nothing says: this Python


def test_a_template_answers_malformed_requests_and_keeps_waiting_for_its_placement():
    import json
    import socket
    import threading
    import uuid

    from coldsnap.agent.client import TemplateClient
    from coldsnap.agent.addresses import address
    from coldsnap.agent.template import _listen, wait_for_placement

    control = f"@coldsnap-template-unit-{uuid.uuid4().hex[:12]}"
    server = _listen(control)
    placed: list = []
    waiter = threading.Thread(target=lambda: placed.append(wait_for_placement(server, ["m"])), daemon=True)
    waiter.start()
    try:
        for line, error in ((b"[1, 2]\n", "not a JSON object"), (b"{nope\n", "not a JSON line"),
                            (b'{"op": "sleep"}\n', "unknown op 'sleep'")):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
                client.connect(address(control))
                client.sendall(line)
                assert json.loads(client.makefile().readline()) == {"ok": False, "error": error}
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:  # a client that goes away unanswered
            client.connect(address(control))
        assert TemplateClient(control).status()["state"] == "boundary"
        link = TemplateClient(control).place({"abi": 2, "serving_port": 9000})
        waiter.join(timeout=10)
        record, connection = placed[0]
        assert record.serving_port == 9000
        link.handover()
        assert connection.recv(100) == b"handover\n"
        connection.close()
    finally:
        server.close()

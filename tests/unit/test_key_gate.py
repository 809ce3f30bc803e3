"""The key gate's protocol (coldsnap/agent/api_key.py): every HTTP process of an engine (one gate listener each,
at the control's gate names in turn) is told; hold, open and a key change what the gate hands requests to.
The engines' own middlewares behind it: tests/integration/test_vllm_cpu.py, test_sglang_hooks.py."""

import socket
import threading
import uuid

import pytest

from coldsnap.agent import api_key
from coldsnap.agent.addresses import address, key_gate_control
from coldsnap.agent.client import KeyGateError, KeyGateMissing, install_api_key, key_gate


def test_every_http_process_of_an_engine_is_told(monkeypatch):
    control = f"@coldsnap-agent-{uuid.uuid4().hex[:16]}"
    for index in range(2):  # what two API server processes of one vLLM bind (their gates share this module here)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(address(key_gate_control(control, index)))
        listener.listen(4)
        threading.Thread(target=api_key._serve, args=(listener,), daemon=True).start()
    gate = api_key.KeyGate(None, "the stack", lambda app, stack, key: ("guarded", stack, key))
    monkeypatch.setattr(api_key, "_gates", [gate])
    monkeypatch.setattr(api_key, "_key", None)
    assert key_gate(control, {"hold": True}) == {"ok": True, "gates": 2, "processes": 2}
    held = gate.current
    assert held[:2] == ("guarded", "the stack") and len(held[2]) >= 32  # a key nobody was told
    key_gate(control, {"open": True})
    assert gate.current == "the stack"
    assert install_api_key(control, "s3cret")["processes"] == 2 and gate.current == ("guarded", "the stack", "s3cret")
    with pytest.raises(KeyGateError, match="want"):
        key_gate(control, {"api-key": "misspelt"})
    with pytest.raises(KeyGateMissing, match="no key gate answered"):
        key_gate(f"@coldsnap-agent-{uuid.uuid4().hex[:16]}", {"open": True})
    assert key_gate_control(control) == control + ".http" and key_gate_control(control, 2) == control + ".http.2"

"""The launcher ↔ agent protocol: strict messages both ways, failures as codes (issue 13, item 1)."""

import threading
import uuid

import pytest

from coldsnap.agent.client import AgentClient, AgentError
from coldsnap.agent.memory import ModelMemoryError
from coldsnap.agent.protocol import (
    Prepare,
    ProtocolError,
    Reply,
    Resume,
    ResumeReply,
    StatusReply,
    decode_command,
    decode_reply,
)
from coldsnap.agent.failures import CommandFailed, failure_of
from coldsnap.agent.server import AgentServer


@pytest.mark.parametrize("line, problem", [
    (b'{"command": "resume"}', "resume.layout_digest: Field required"),
    (b'{"command": "resume", "layout_digest": "d", "colour": 1}', "resume.colour: Extra inputs are not permitted"),
    (b'{"command": "prepare", "pack_dir": 7}', "prepare.pack_dir"),
    (b'{"command": "prepare", "pack_dir": null, "graph_policy": "keep"}', "prepare.graph_policy"),
    (b'{"command": "sleep"}', "does not match any of the expected tags"),
    (b"not json", "Invalid JSON"),
])
def test_a_command_of_another_build_is_refused_by_name(line, problem):
    with pytest.raises(ProtocolError, match=problem):
        decode_command(line)


def test_commands_round_trip():
    command = Resume(layout_digest="d" * 64, adopted={"weights": 3}, staged={"bytes": 9, "direct": True})
    assert decode_command(command.model_dump_json().encode()) == command
    assert decode_command(b'{"command": "prepare", "pack_dir": null}') == Prepare(pack_dir=None)


def test_a_reply_of_the_wrong_kind_is_a_protocol_error():
    line = Reply(ok=True, reply=ResumeReply(rank=0, hydrate={"source": "none"}, seconds={}, graphs_recaptured=[]))
    with pytest.raises(ProtocolError, match="answered ResumeReply, not StatusReply"):
        decode_reply(line.model_dump_json().encode(), StatusReply)
    with pytest.raises(ProtocolError, match="failed without saying why"):
        decode_reply(b'{"ok": false}', StatusReply)


def test_failures_cross_as_codes():
    class TeardownError(RuntimeError):
        failure_code = "agent.collectives"

    assert failure_of(CommandFailed("agent.state", "no")).code == "agent.state"
    assert failure_of(ModelMemoryError("digest")).code == "agent.memory"
    assert failure_of(TeardownError("abort hung")).model_dump() == {
        "code": "agent.collectives", "type": "TeardownError", "message": "abort hung"}
    assert failure_of(KeyError("x")).code == "agent.internal"


def test_an_agent_refuses_a_command_its_state_does_not_allow():
    control = f"@coldsnap-test-protocol-{uuid.uuid4().hex[:12]}"
    agent = AgentServer(control, memory=None, serving_lock=threading.Lock()).start()
    with pytest.raises(AgentError) as refused:
        AgentClient(control, timeout=5).resume(Resume(layout_digest="d" * 64))
    assert refused.value.code == "agent.state" and "resume needs state prepared or standby, not serving" in str(refused.value)
    agent.state = "prepared"
    with pytest.raises(AgentError) as refused:
        AgentClient(control, timeout=5).prepare(Prepare(pack_dir=None))
    assert refused.value.code == "agent.state"


def test_an_agent_that_is_not_there_is_an_os_error():
    with pytest.raises(OSError):
        AgentClient(f"@coldsnap-test-nobody-{uuid.uuid4().hex[:8]}", timeout=1).status()  # connection refused


def test_the_early_wake_sends_the_protocols_prefill_line():
    """early_wake writes Prefill by hand (it may not import pydantic): the same bytes as the protocol's."""
    from coldsnap.activation.early_wake import PREFILL_LINE
    from coldsnap.agent.protocol import Prefill, decode_command, encode

    assert PREFILL_LINE == encode(Prefill()) and isinstance(decode_command(PREFILL_LINE), Prefill)


def test_the_early_wake_reads_only_the_plain_wake():
    from coldsnap.activation.early_wake import start_prefill

    for arguments in (["--weights", "native", "DIR"], ["--request-json", "-"], [], ["a", "b"], ["--help"]):
        assert start_prefill(arguments) == 0  # nothing to do, nothing raised


def test_the_early_wake_imports_no_pydantic():
    import subprocess
    import sys

    code = "import sys, coldsnap.activation.early_wake; sys.exit('pydantic' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0

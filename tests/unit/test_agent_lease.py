"""The restore lease: until the canary matched, a restored process tree lives only as long as the
`coldsnap restore` launcher that restored it (issue 13: a launcher SIGKILLed mid-restore left the
engine running, unowned, holding its port and GPU memory)."""

import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

import pytest

from coldsnap.agent.client import Lease
from coldsnap.agent.addresses import address
from coldsnap.agent.protocol import LeaseTaken, Reply
from coldsnap.agent.server import AgentServer, hold_lease
from coldsnap.agent.switch_interval import AGENT_SWITCH_INTERVAL_S

AGENT = """
import sys, threading, time
from coldsnap.agent.server import AgentServer
AgentServer(sys.argv[1], memory=None, serving_lock=threading.Lock()).start()
print("agent ready", flush=True)
time.sleep(120)
"""

LAUNCHER = """
import sys, time
from coldsnap.agent.client import Lease
lease = Lease([sys.argv[1]])
if sys.argv[2] == "release":
    lease.release()
print("leased", flush=True)
time.sleep(120)
"""


def _control() -> str:
    return f"@coldsnap-test-lease-{uuid.uuid4().hex[:12]}"


def test_a_released_lease_is_kept_and_a_dropped_one_is_lost():
    for ending, released in (("release", True), ("close", False)):
        agent_end, launcher_end = socket.socketpair()
        lost = []
        holder = threading.Thread(target=lambda: lost.append(not hold_lease(agent_end, lambda: lost.append("lost"))))
        holder.start()
        assert LeaseTaken.model_validate_json(launcher_end.makefile("rb").readline()) == LeaseTaken()
        if ending == "release":
            launcher_end.sendall(b"release\n")
        launcher_end.close()
        holder.join(5)
        assert lost == ([False] if released else ["lost", True])


def test_the_agent_hands_the_lease_to_its_own_thread_and_keeps_serving():
    control = _control()
    agent = AgentServer(control, memory=None, serving_lock=threading.Lock())
    lost = threading.Event()
    agent.on_lease_lost = lost.set
    agent.start()
    lease = Lease([control])
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:  # served while the lease is held
        connection.settimeout(5)
        connection.connect(address(control))
        connection.sendall(b'{"command": "no-such-command"}\n')
        reply = Reply.model_validate_json(connection.makefile("rb").readline())
    assert not reply.ok and reply.failure.code == "agent.command"
    lease.close()  # the launcher died before the canary
    assert lost.wait(5)


SWITCH_INTERVALS = """
import socket, sys, threading, time
from coldsnap.agent.client import Lease
from coldsnap.agent.addresses import address
from coldsnap.agent.server import AgentServer
control = sys.argv[1]
agent = AgentServer(control, memory=None, serving_lock=threading.Lock())
agent.on_lease_lost = lambda: None
agent.start()
def settled():
    time.sleep(0.3)  # (the agent's thread puts the interval back after its reply or the lease's end)
    return sys.getswitchinterval()
seen = [sys.getswitchinterval()]
lease = Lease([control])
seen.append(sys.getswitchinterval())
lease.release()
seen.append(settled())
with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
    connection.connect(address(control))
    connection.sendall(b'{"command": "no-such-command"}\\n')
    connection.makefile("rb").readline()
seen.append(settled())
print(*seen)
"""


def test_the_agent_gets_the_gil_back_promptly_only_while_it_works():
    """While a lease is held (a restore's resume and canary) the interpreter's switch interval is the
    agent's 0.1 ms: an engine loop that spins holding the GIL (SGLang's scheduler) then hands it to the
    agent's thread after at most that, not after CPython's 5 ms at every blocking call. The engine's own
    interval is back once the lease ends, and after a command served without a lease. (A process of its
    own: the interval is the whole interpreter's, and this one runs other tests' agents.)"""
    seen = subprocess.run([sys.executable, "-c", SWITCH_INTERVALS, _control()], capture_output=True, text=True,
                          timeout=60)
    assert seen.returncode == 0, seen.stderr
    before, leased, released, served = map(float, seen.stdout.split())
    assert leased == pytest.approx(AGENT_SWITCH_INTERVAL_S) and before > leased
    assert released == before and served == before


@pytest.mark.parametrize("ending", ["killed", "release"])
def test_a_restored_tree_dies_with_its_launcher_until_released(tmp_path, ending):
    """Real processes: the agent's process group is SIGKILLed when the launcher holding its lease is;
    a released lease leaves it running."""
    control = _control()
    agent = subprocess.Popen([sys.executable, "-c", AGENT, control], stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    launcher = None
    try:
        assert agent.stdout.readline().strip() == "agent ready"
        launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, control, ending], stdout=subprocess.PIPE, text=True)
        assert launcher.stdout.readline().strip() == "leased"
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(10)
        if ending == "killed":
            assert agent.wait(10) == -signal.SIGKILL
        else:
            time.sleep(1.0)
            assert agent.poll() is None  # on its own after the canary
    finally:
        for process in (agent, launcher):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait(10)

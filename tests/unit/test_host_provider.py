"""The manager host-provider protocol (coldsnap.provider): coldsnap's client against the reference provider over
a real Unix socket, hosts reached by the ``local`` transport (``nsenter``: tests/integration/test_host_provider.py).

Every failure is a named code, ends within 2 s and leaves nothing running: a wrong token, a second client, a
message too large or malformed, a provider that dies mid-request, a client that goes away, a cancel, a timeout."""

from __future__ import annotations

import json
import os
import shlex
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from coldsnap.provider.client import HostProvider, ProviderError
from coldsnap.provider.hosts import Host, HostsError, read_hosts
from coldsnap.provider.messages import MAX_MESSAGE_BYTES, receive_message
from coldsnap.provider.server import ProviderServer

TOKEN = "t" * 32


@pytest.fixture
def served(tmp_path):
    path = tmp_path / "provider.sock"
    server = ProviderServer(path, TOKEN, {"here": Host(name="here", transport="local")}).start()
    yield path, server
    server.close()


def _until(condition, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def _written(pidfile: Path) -> bool:
    return pidfile.exists() and bool(pidfile.read_text().strip())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_every_operation_round_trips(served, tmp_path):
    path, _ = served
    with HostProvider(str(path), TOKEN) as provider:
        assert provider.welcome.hosts == ["here"] and "exec" in provider.welcome.operations
        result = provider.exec("here", ["sh", "-c", 'echo "$GREETING"; cat; echo err >&2; exit 3'],
                               env={"GREETING": "hi there"}, stdin=b"from stdin\n")
        assert (result.status, result.stdout, result.stderr) == (3, b"hi there\nfrom stdin\n", b"err\n")
        argv = ["printf", "%s|", "two words", "$HOME", "'quoted'", "*"]  # exact argv: no shell touches it
        assert provider.exec("here", argv).stdout == b"two words|$HOME|'quoted'|*|"
        assert provider.probe("here", ["true"]).status == 0
        data = os.urandom(1_300_000)  # three chunks
        done = provider.put("here", str(tmp_path / "file.bin"), data, mode=0o600)
        assert done.size == len(data) and (tmp_path / "file.bin").read_bytes() == data
        assert (tmp_path / "file.bin").stat().st_mode & 0o777 == 0o600
        assert provider.get("here", str(tmp_path / "file.bin")) == data
        identity = provider.whoami()
        assert (identity.uid, identity.gid) == (int(os.environ.get("SUDO_UID") or os.getuid()),
                                                int(os.environ.get("SUDO_GID") or os.getgid()))


def test_requests_run_at_once_and_answer_by_id(served):
    path, _ = served
    with HostProvider(str(path), TOKEN) as provider:
        started = time.monotonic()
        slow = provider.start_exec("here", ["sh", "-c", "sleep 1; echo slow"])
        assert provider.exec("here", ["echo", "fast"]).stdout == b"fast\n"  # (not behind the slow one)
        assert time.monotonic() - started < 0.9
        assert slow.wait(timeout=5).stdout == b"slow\n"


def test_failures_are_named(served, tmp_path):
    path, _ = served
    with HostProvider(str(path), TOKEN) as provider:
        for call, code in [(lambda: provider.exec("elsewhere", ["true"]), "provider.host"),
                           (lambda: provider.exec("here", ["/nonexistent/binary"]), "provider.exec"),
                           (lambda: provider.get("here", str(tmp_path / "missing")), "provider.io"),
                           (lambda: provider.exec("here", ["sleep", "30"], timeout_s=0.3), "provider.timeout")]:
            started = time.monotonic()
            with pytest.raises(ProviderError) as failed:
                call()
            assert failed.value.code == code and time.monotonic() - started < 2, failed.value
        assert provider.exec("here", ["true"]).status == 0  # (the connection outlives its requests' failures)


def test_a_cancel_kills_the_whole_process_group(served, tmp_path):
    path, _ = served
    pidfile = tmp_path / "child.pid"
    with HostProvider(str(path), TOKEN) as provider:
        running = provider.start_exec("here", ["sh", "-c", f"sleep 60 & echo $! > {pidfile}; wait"])
        _until(lambda: _written(pidfile), 5, "the exec never started its child")
        running.cancel()
        with pytest.raises(ProviderError) as failed:
            running.wait(timeout=2)
        assert failed.value.code == "provider.cancelled"
    child = int(pidfile.read_text())
    _until(lambda: not _alive(child), 2, "the exec's child outlived its cancel")


def test_a_client_that_goes_away_leaves_nothing_running(served, tmp_path):
    """The client is a process of its own, killed mid-exec: the provider kills what it started for it."""
    path, _ = served
    pidfile = tmp_path / "child.pid"
    code = (f"from coldsnap.provider.client import HostProvider; import time; "
            f"p = HostProvider({str(path)!r}, {TOKEN!r}); "
            f"p.start_exec('here', ['sh', '-c', 'sleep 60 & echo $! > {pidfile}; wait']); time.sleep(60)")
    client = subprocess.Popen([sys.executable, "-c", code])
    try:
        _until(lambda: _written(pidfile) or client.poll() is not None, 10, "the client never started its exec")
    finally:
        client.kill()
        client.wait()
    child = int(pidfile.read_text())
    _until(lambda: not _alive(child), 2, "what the client started outlived its connection")
    with HostProvider(str(path), TOKEN) as provider:  # (and the provider serves the next client)
        assert provider.exec("here", ["true"]).status == 0


def test_a_wrong_token_a_second_client_and_a_bad_format_are_refused(served):
    path, _ = served
    with pytest.raises(ProviderError) as failed:
        HostProvider(str(path), "x" * 32)
    assert failed.value.code == "provider.token"
    with HostProvider(str(path), TOKEN):
        with pytest.raises(ProviderError) as failed:
            HostProvider(str(path), TOKEN)
        assert failed.value.code == "provider.busy"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(str(path))
        body = json.dumps({"type": "hello", "format": 2, "token": TOKEN, "client": "x"}).encode()
        sock.sendall(struct.pack(">I", len(body)) + body)
        assert json.loads(receive_message(sock) or b"{}")["code"] == "provider.format"


@pytest.mark.parametrize("frame", [
    struct.pack(">I", MAX_MESSAGE_BYTES + 1),                                   # too large
    struct.pack(">I", 9) + b"not json!",                                        # not JSON
    struct.pack(">I", 2) + b"[]",                                               # not an object
    (lambda b: struct.pack(">I", len(b)) + b)(b'{"type": "launch", "id": 1}'),  # not one of the protocol's
    (lambda b: struct.pack(">I", len(b)) + b)(b'{"type": "whoami", "id": 1, "id": 2}'),  # a duplicate key
    (lambda b: struct.pack(">I", len(b)) + b)(b'{"type": "whoami", "id": 1, "sudo": true}'),  # an unknown field
])
def test_a_malformed_or_oversized_message_closes_the_connection_with_its_code(served, frame):
    path, _ = served
    with HostProvider(str(path), TOKEN) as provider:
        started = time.monotonic()
        provider._sock.sendall(frame)
        with pytest.raises(ProviderError) as failed:
            provider.whoami()
        assert failed.value.code == "provider.lost" and "provider.message" in failed.value.message
        assert time.monotonic() - started < 2
    with HostProvider(str(path), TOKEN) as provider:  # the provider goes on serving
        assert provider.whoami().uid >= 0


def test_a_provider_that_dies_fails_every_request_under_way_at_once(tmp_path):
    path = tmp_path / "provider.sock"
    code = (f"from coldsnap.provider.server import ProviderServer; from coldsnap.provider.hosts import Host; "
            f"import time; ProviderServer(__import__('pathlib').Path({str(path)!r}), {TOKEN!r}, "
            f"{{'here': Host(name='here', transport='local')}}).start(); time.sleep(60)")
    server = subprocess.Popen([sys.executable, "-c", code])
    try:
        _until(path.exists, 10, "the provider never served its socket")
        provider = HostProvider(str(path), TOKEN)
        running = provider.start_exec("here", ["sleep", "30"])
        server.kill()
        started = time.monotonic()
        with pytest.raises(ProviderError) as failed:
            running.wait(timeout=5)
        assert failed.value.code == "provider.lost" and time.monotonic() - started < 2
        with pytest.raises(ProviderError):
            provider.exec("here", ["true"])
        provider.close()
    finally:
        server.kill()
        server.wait()


def test_no_socket_named_is_no_provider_and_a_dead_one_is_named(monkeypatch, tmp_path):
    from coldsnap.provider.client import provider_status

    monkeypatch.delenv("COLDSNAP_HOST_PROVIDER_SOCKET", raising=False)
    assert HostProvider.from_settings() is None
    assert provider_status().given is False
    monkeypatch.setenv("COLDSNAP_HOST_PROVIDER_SOCKET", str(tmp_path / "nothing-here"))
    monkeypatch.setenv("COLDSNAP_HOST_PROVIDER_TOKEN", TOKEN)
    status = provider_status()
    assert status.given and not status.connected and "provider.connect" in (status.problem or "")


def test_capabilities_report_the_provider_it_was_given(tmp_path):
    hosts = tmp_path / "hosts.toml"
    hosts.write_text('[hosts.here]\ntransport = "local"\n')
    done = subprocess.run([sys.executable, "-m", "coldsnap", "provider", "serve", "--hosts", str(hosts), "--",
                           sys.executable, "-m", "coldsnap", "capabilities"], capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr.decode()
    capabilities = json.loads(done.stdout)
    assert capabilities["protocol"]["host_provider_format"] == 1
    assert capabilities["host_provider"] == {"given": True, "connected": True, "provider": "coldsnap provider serve",
                                             "operations": ["exec", "probe", "put", "get", "whoami"],
                                             "hosts": ["here"], "problem": None}
    assert not list(Path(os.environ.get("TMPDIR", "/tmp")).glob("coldsnap-provider-*/socket"))  # (its socket removed)


@pytest.mark.parametrize("text, problem", [
    ("", "want one table [hosts.NAME] per host"),
    ("[hosts.a]\ntransport = 'telnet'\n", "[hosts.a]: transport must be one of local, nsenter, ssh"),
    ("[hosts.a]\ntransport = 'nsenter'\n", "[hosts.a]: an nsenter host needs netns"),
    ("[hosts.a]\ntransport = 'ssh'\n", "[hosts.a]: an ssh host needs address"),
    ("[hosts.a]\ntransport = 'local'\naddress = 'x'\n", "[hosts.a]: address is not a key of a local host"),
    ("[hosts.a]\ntransport = 'ssh'\naddress = 'x'\nport = 70000\n", "[hosts.a]: port must be a number"),
    ("[hosts.'a b']\ntransport = 'local'\n", "a host's name is letters"),
    ("[hosts.a\n", "not TOML"),
])
def test_a_bad_hosts_file_is_one_line_naming_the_table(tmp_path, text, problem):
    hosts = tmp_path / "hosts.toml"
    hosts.write_text(text)
    with pytest.raises(HostsError) as failed:
        read_hosts(hosts)
    assert problem in str(failed.value)
    done = subprocess.run([sys.executable, "-m", "coldsnap", "provider", "serve", "--hosts", str(hosts), "--", "true"],
                          capture_output=True, timeout=60)
    assert done.returncode == 2 and problem in done.stderr.decode() and b"Traceback" not in done.stderr


def test_an_ssh_host_gets_the_exact_argv_through_the_remote_shell():
    """Over ssh an argv travels as one command line, quoted word by word; the remote shell splits it back."""
    host = Host(name="gpu2", transport="ssh", address="10.0.0.2", identity="/k/id", known_hosts="/k/known")
    command = host.command(["printf", "%s\n", "two words", "$HOME", "a'b"], env={"A": "1 2"})
    assert command[:3] == ["ssh", "-o", "BatchMode=yes"] and "StrictHostKeyChecking=yes" in command
    assert command[command.index("-i") + 1] == "/k/id" and "UserKnownHostsFile=/k/known" in command
    assert command[-3:-1] == ["root@10.0.0.2", "--"]
    assert shlex.split(command[-1]) == ["env", "--", "A=1 2", "printf", "%s\n", "two words", "$HOME", "a'b"]
    nsenter = Host(name="n", transport="nsenter", netns="/var/run/netns/n").command(["ip", "addr"])
    assert nsenter == ["nsenter", "--net=/var/run/netns/n", "--", "ip", "addr"]

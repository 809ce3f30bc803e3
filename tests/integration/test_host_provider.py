"""The reference host provider's ``nsenter`` transport, on two simulated hosts (tests/simulated_hosts.py: network
namespaces of their own, joined by a bridge): an exec runs in its host's network namespace, a probe from the
other host reaches it there, and a cancelled exec leaves nothing running in the host's namespace."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from coldsnap.provider.client import HostProvider, ProviderError
from coldsnap.provider.hosts import Host
from coldsnap.provider.server import ProviderServer
from tests.helpers import free_port
from tests.simulated_hosts import simulated_hosts

pytestmark = pytest.mark.skipif(subprocess.run(["id", "-u"], capture_output=True, text=True).stdout.strip() != "0",
                                reason="simulated hosts need root")
TOKEN = "n" * 32


def _pids_in(namespace: str) -> list[str]:
    return subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout.split()


def test_an_exec_runs_in_its_hosts_network_namespace_and_a_cancel_leaves_nothing_there(tmp_path):
    with simulated_hosts(2) as (a, b):
        hosts = {host.namespace: Host(name=host.namespace, transport="nsenter", netns=f"/var/run/netns/{host.namespace}")
                 for host in (a, b)}
        server = ProviderServer(tmp_path / "provider.sock", TOKEN, hosts).start()
        try:
            with HostProvider(str(tmp_path / "provider.sock"), TOKEN) as provider:
                shown = provider.exec(a.namespace, ["ip", "-4", "-o", "addr", "show"]).stdout.decode()
                assert a.address in shown and b.address not in shown
                port = free_port()
                listener = provider.start_exec(a.namespace, [sys.executable, "-c", (
                    "import socket, time; s = socket.socket(); s.bind((%r, %d)); s.listen(); time.sleep(60)"
                    % (a.address, port))])
                connect = [sys.executable, "-c", f"import socket; socket.create_connection(({a.address!r}, {port}), 2)"]
                deadline = time.monotonic() + 10
                while provider.probe(b.namespace, connect).status != 0:  # from the other host, over the bridge
                    assert time.monotonic() < deadline, "host b never reached host a's listener"
                    time.sleep(0.1)
                assert _pids_in(a.namespace)
                listener.cancel()
                with pytest.raises(ProviderError) as failed:
                    listener.wait(timeout=2)
                assert failed.value.code == "provider.cancelled"
                deadline = time.monotonic() + 2
                while _pids_in(a.namespace):
                    assert time.monotonic() < deadline, f"left running in {a.namespace}: {_pids_in(a.namespace)}"
                    time.sleep(0.05)
                assert provider.probe(b.namespace, connect).status != 0
        finally:
            server.close()


def _sshd_on(host, tmp_path):
    """A real sshd (Debian's openssh-server) on ``host``'s address, its host key and the client's key made here;
    returns (the sshd process, its port, the client's identity file, a known_hosts naming the host's key)."""
    for name in ("host_key", "client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / name)], check=True)
    port = free_port()
    config = tmp_path / "sshd_config"
    config.write_text(f"ListenAddress {host.address}:{port}\nHostKey {tmp_path / 'host_key'}\n"
                      f"AuthorizedKeysFile {tmp_path / 'client_key.pub'}\nPermitRootLogin prohibit-password\n"
                      "PasswordAuthentication no\nKbdInteractiveAuthentication no\nStrictModes no\nUsePAM no\n"
                      f"PidFile {tmp_path / 'sshd.pid'}\n")
    Path("/run/sshd").mkdir(exist_ok=True)  # (its privilege-separation directory)
    sshd = subprocess.Popen(host.command(["/usr/sbin/sshd", "-D", "-e", "-f", str(config)]),
                            stderr=open(tmp_path / "sshd.log", "wb"), start_new_session=True)
    public = (tmp_path / "host_key.pub").read_text().split()
    (tmp_path / "known_hosts").write_text(f"[{host.address}]:{port} {public[0]} {public[1]}\n")
    return sshd, port, tmp_path / "client_key", tmp_path / "known_hosts"


@pytest.mark.skipif(not Path("/usr/sbin/sshd").exists(), reason="no sshd (bash scripts/install-sshd.sh)")
def test_the_ssh_transport_runs_the_exact_argv_on_a_real_sshd(tmp_path):
    """The provider runs on simulated host b and reaches host a through OpenSSH (the host's key checked, a key
    the test made): exec, probe, put and get on a, the argv exact through the remote shell."""
    with simulated_hosts(2) as (a, b):
        sshd, port, identity, known_hosts = _sshd_on(a, tmp_path)
        hosts = tmp_path / "hosts.toml"
        hosts.write_text(f'[hosts.a]\ntransport = "ssh"\naddress = "{a.address}"\nport = {port}\n'
                         f'identity = "{identity}"\nknown_hosts = "{known_hosts}"\n')
        socket_path = tmp_path / "provider.sock"
        code = ("import pathlib, time; from coldsnap.provider.server import ProviderServer; "
                "from coldsnap.provider.hosts import read_hosts; "
                f"ProviderServer(pathlib.Path({str(socket_path)!r}), {TOKEN!r}, read_hosts(pathlib.Path({str(hosts)!r})))"
                ".start(); time.sleep(120)")
        provider_process = subprocess.Popen(b.command([sys.executable, "-c", code]), start_new_session=True)
        try:
            deadline = time.monotonic() + 10
            while not socket_path.exists():
                assert time.monotonic() < deadline and provider_process.poll() is None
                time.sleep(0.05)
            with HostProvider(str(socket_path), TOKEN) as provider:
                deadline = time.monotonic() + 10
                while provider.exec("a", ["true"]).status != 0:  # (sshd listening)
                    assert time.monotonic() < deadline, (tmp_path / "sshd.log").read_text()[-2000:]
                    time.sleep(0.1)
                argv = ["printf", "%s|", "two words", "$HOME", "a'b", "*", ""]
                assert provider.exec("a", argv).stdout == b"two words|$HOME|a'b|*||"
                assert provider.exec("a", ["sh", "-c", 'echo "$X"'], env={"X": "1 2"}).stdout == b"1 2\n"
                assert a.address in provider.probe("a", ["ip", "-4", "-o", "addr", "show"]).stdout.decode()
                data = bytes(range(256)) * 5000
                assert provider.put("a", str(tmp_path / "over-ssh.bin"), data).size == len(data)
                assert provider.get("a", str(tmp_path / "over-ssh.bin")) == data
        finally:
            for process in (provider_process, sshd):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()

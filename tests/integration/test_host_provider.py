"""The reference host provider's ``nsenter`` transport, on two simulated hosts (tests/simulated_hosts.py: network
namespaces of their own, joined by a bridge): an exec runs in its host's network namespace, a probe from the
other host reaches it there, and a cancelled exec leaves nothing running in the host's namespace."""

from __future__ import annotations

import subprocess
import sys
import time

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

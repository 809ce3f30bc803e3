"""The simulated hosts the two-node tests stand on (tests/simulated_hosts.py): what they share and what not."""

import os
import shutil
import subprocess
import sys

import pytest

from tests.simulated_hosts import simulated_hosts

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root"),
              pytest.mark.skipif(shutil.which("ip") is None, reason="no iproute2 (ip)")]

SERVER = """
import os, socket, sys
open("/dev/shm/coldsnap-simulated-marker", "w").close()
listener = socket.create_server((sys.argv[1], 18555))
print("listening", flush=True)
connection, _ = listener.accept()
connection.sendall(socket.gethostname().encode())
connection.close()
"""
CLIENT = """
import os, socket, sys
with socket.create_connection((sys.argv[1], 18555), timeout=10) as connection:
    peer = connection.recv(100).decode()
print(socket.gethostname(), peer, os.path.exists("/dev/shm/coldsnap-simulated-marker"))
"""


def test_two_hosts_talk_over_their_addresses_only_and_are_gone_afterwards():
    with simulated_hosts(2) as (a, b):
        assert a.address != b.address and a.hostname != b.hostname
        server = subprocess.Popen(a.command([sys.executable, "-c", SERVER, a.address]), stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout.readline() == "listening\n"
            client = subprocess.run(b.command([sys.executable, "-c", CLIENT, a.address]), capture_output=True,
                                    text=True, timeout=60)
            assert client.returncode == 0, client.stderr
            # b has its own hostname, reached a's over a's address, and does not see a's /dev/shm file
            assert client.stdout.split() == [b.hostname, a.hostname, "False"]
            assert not os.path.exists("/dev/shm/coldsnap-simulated-marker")  # nor does this machine
            # this machine's loopback is not a's: nothing listens on 127.0.0.1 inside b for a's port
            loopback = subprocess.run(b.command([sys.executable, "-c", CLIENT, "127.0.0.1"]), capture_output=True,
                                      text=True, timeout=60)
            assert loopback.returncode != 0 and "ConnectionRefusedError" in loopback.stderr
        finally:
            server.kill()
            server.wait()
        namespaces = {a.namespace, b.namespace}
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not namespaces & {line.split()[0] for line in listed.splitlines() if line.strip()}
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    assert a.namespace[:-2] not in links  # the bridge and the veth ends

"""Simulated hosts on one machine, for the two-node tests: each host a network namespace of its own (its own
IPv4 address on a veth pair joined to one bridge), a UTS namespace (its own hostname) and a mount namespace
with a private /dev/shm, so engines started on two of them can reach each other only over TCP between
their addresses, as on two machines, and never through shared memory or a shared hostname.

    with simulated_hosts(2) as (a, b):
        server = subprocess.Popen(a.command(["python3", "-m", "http.server", "--bind", a.address, "8000"]))
        subprocess.run(b.command(["curl", f"http://{a.address}:8000/"]))

It stands in for what CI cannot have, a second machine; the kernel's namespaces are real. Needs root and
iproute2 (``ip``) and util-linux (``unshare``). Everything it made is removed on exit, the processes
still running in a host's network namespace killed first.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Iterator

__all__ = ["SimulatedHost", "simulated_hosts"]


@dataclass(frozen=True)
class SimulatedHost:
    namespace: str  # the network namespace's name (ip netns)
    hostname: str
    address: str
    interface: str = ""  # its veth end, its one interface besides lo (what GLOO_SOCKET_IFNAME names)

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run on this host: in its network namespace, with its hostname and a /dev/shm of its own."""
        setup = f'hostname {self.hostname} && mount -t tmpfs -o mode=1777 tmpfs /dev/shm && exec "$@"'
        # nsenter, not `ip netns exec`: that also gives the process a mount namespace whose /run/netns mounts
        # CRIU cannot dump ("unreachable sharing"); this one's only mount is /dev/shm's tmpfs.
        return ["nsenter", f"--net=/var/run/netns/{self.namespace}", "unshare", "--uts", "--mount", "--propagation",
                "private", "sh", "-c", setup, "simulated-host", *argv]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@contextlib.contextmanager
def simulated_hosts(count: int) -> Iterator[list[SimulatedHost]]:
    """``count`` hosts on one bridge; removed (and whatever still runs in them killed) on exit."""
    tag = f"cs{os.getpid() % 100000}"  # (interface names hold 15 characters)
    run = os.getpid() % 200 + 20  # the hosts' subnet, 10.231.RUN.0/24, one per run: hosts at .11, .12, ...
    bridge = f"{tag}br"
    hosts: list[SimulatedHost] = []
    links: list[str] = []  # the veth ends on this side (deleting one deletes its pair)
    made_bridge = False
    try:
        _ip("link", "add", bridge, "type", "bridge")
        made_bridge = True
        _ip("link", "set", bridge, "up")
        for index in range(count):
            host = SimulatedHost(namespace=f"{tag}h{index}", hostname=f"coldsnap-host-{index}",
                                 address=f"10.231.{run}.{11 + index}", interface=f"{tag}v{index}")
            _ip("netns", "add", host.namespace)
            hosts.append(host)
            inside, outside = host.interface, f"{tag}p{index}"
            _ip("link", "add", inside, "type", "veth", "peer", "name", outside)
            links.append(outside)
            _ip("link", "set", inside, "netns", host.namespace)
            _ip("link", "set", outside, "master", bridge)
            _ip("link", "set", outside, "up")
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", inside)
            _ip("-n", host.namespace, "link", "set", inside, "up")
            _ip("-n", host.namespace, "link", "set", "lo", "up")
        yield hosts
    finally:
        for host in hosts:
            _kill_namespace_processes(host.namespace)
        for link in links:  # before the namespaces: a namespace's own end goes only when the kernel tears it down
            subprocess.run(["ip", "link", "del", link], capture_output=True, timeout=30)
        for host in hosts:
            subprocess.run(["ip", "netns", "del", host.namespace], capture_output=True, timeout=30)
        if made_bridge:
            subprocess.run(["ip", "link", "del", bridge], capture_output=True, timeout=30)


def _kill_namespace_processes(namespace: str, timeout: float = 10.0) -> None:
    """SIGKILL every process in the network namespace and wait until none is left (a live one would keep
    the namespace, and its sockets, after ``ip netns del``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        listed = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, timeout=30)
        pids = [int(p) for p in listed.stdout.split()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)

"""The reference provider's hosts (``hosts.toml``) and how an argv reaches each: ``local``, ``nsenter``, ``ssh``.

    [hosts.node0]
    transport = "local"                 # this machine
    prefix = ["nsenter", "--net=/var/run/netns/n0", "--"]   # optional: every argv run after these words
    env = { COLDSNAP_STATE_DIR = "/var/lib/coldsnap" }     # optional, any transport: set for every exec there

    [hosts.node1]
    transport = "nsenter"               # a network namespace of this machine (a simulated host, a pod's netns)
    netns = "/var/run/netns/node1"

    [hosts.gpu2]
    transport = "ssh"                   # OpenSSH's client; the host's key must be known (no prompt, no TOFU)
    address = "10.0.0.2"
    user = "root"                       # default: root
    port = 22                           # default: 22
    identity = "/root/.ssh/id_ed25519"  # default: ssh's own
    known_hosts = "/root/.ssh/known_hosts"  # default: ssh's own

An argv is never given to a shell on this machine; over ssh it travels as one command line quoted word by word
(``shlex.join``), which the remote login shell splits back into the same words.
"""

from __future__ import annotations

import re
import shlex
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

__all__ = ["Host", "HostsError", "read_hosts"]

Transport = Literal["local", "nsenter", "ssh"]
_KEYS = {"local": {"transport", "prefix", "env"}, "nsenter": {"transport", "netns", "env"},
         "ssh": {"transport", "address", "user", "port", "identity", "known_hosts", "env"}}


class HostsError(ValueError):
    """A hosts file that cannot be used (the message says where and why)."""


@dataclass(frozen=True)
class Host:
    name: str
    transport: Transport
    netns: str | None = None
    address: str | None = None
    user: str = "root"
    port: int = 22
    identity: str | None = None
    known_hosts: str | None = None
    options: tuple[str, ...] = field(default=())
    prefix: tuple[str, ...] = field(default=())
    """A local host's argv prefix: what places a command there (a container's exec, a namespace's nsenter)."""
    env: tuple[tuple[str, str], ...] = field(default=())
    """Set for every exec on this host (the manager's choice, under what the request sets)."""

    def command(self, argv: list[str], env: dict[str, str] | None = None, network_only: bool = False) -> list[str]:
        """The argv to run here so that ``argv`` runs on this host with ``env`` set on top of the host's own
        environment. ``network_only``: a probe, which needs only the host's network namespace."""
        env = {**dict(self.env), **(env or {})}
        with_env = ["env", "--", *(f"{name}={value}" for name, value in env.items()), *argv] if env else argv
        if self.transport == "local":
            return [*self.prefix, *with_env]
        if self.transport == "nsenter":
            return ["nsenter", f"--net={self.netns}", "--", *with_env]
        ssh = ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes", "-o", "ConnectTimeout=10",
               "-p", str(self.port)]
        if self.identity:
            ssh += ["-i", self.identity, "-o", "IdentitiesOnly=yes"]
        if self.known_hosts:
            ssh += ["-o", f"UserKnownHostsFile={self.known_hosts}"]
        return [*ssh, *self.options, f"{self.user}@{self.address}", "--", shlex.join(with_env)]


def read_hosts(path: Path) -> dict[str, Host]:
    """The hosts of a ``hosts.toml``; :class:`HostsError` naming the first problem."""
    try:
        document = tomllib.loads(path.read_text())
    except OSError as exc:
        raise HostsError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise HostsError(f"{path}: not TOML: {exc}") from None
    if set(document) != {"hosts"} or not isinstance(document["hosts"], dict) or not document["hosts"]:
        raise HostsError(f"{path}: want one table [hosts.NAME] per host, and nothing else")
    hosts = {}
    for name, entry in document["hosts"].items():
        where = f"{path}: [hosts.{name}]"
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,254}", name):
            raise HostsError(f"{where}: a host's name is letters, digits and . _ : - (what requests name it by)")
        if not isinstance(entry, dict) or entry.get("transport") not in _KEYS:
            raise HostsError(f"{where}: transport must be one of {', '.join(_KEYS)}")
        unknown = set(entry) - _KEYS[entry["transport"]]
        if unknown:
            raise HostsError(f"{where}: {', '.join(sorted(unknown))} is not a key of a {entry['transport']} host")
        if entry["transport"] == "nsenter" and not isinstance(entry.get("netns"), str):
            raise HostsError(f"{where}: an nsenter host needs netns = \"/var/run/netns/NAME\" (or /proc/PID/ns/net)")
        if entry["transport"] == "ssh" and not isinstance(entry.get("address"), str):
            raise HostsError(f"{where}: an ssh host needs address = \"HOST\"")
        if not isinstance(entry.get("port", 22), int) or not 1 <= entry.get("port", 22) <= 65535:
            raise HostsError(f"{where}: port must be a number from 1 to 65535")
        prefix, env = entry.pop("prefix", []), entry.pop("env", {})
        if not isinstance(prefix, list) or not all(isinstance(word, str) for word in prefix):
            raise HostsError(f"{where}: prefix is a list of strings (an argv's first words)")
        if not isinstance(env, dict) or not all(isinstance(v, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k)
                                                for k, v in env.items()):
            raise HostsError(f"{where}: env is a table of NAME = \"value\"")
        if not all(isinstance(value, (str, int)) for value in entry.values()):
            raise HostsError(f"{where}: every value is a string (port: a number)")
        hosts[name] = Host(name=name, prefix=tuple(prefix), env=tuple(env.items()), **entry)
    return hosts

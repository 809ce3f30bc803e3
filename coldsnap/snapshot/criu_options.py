"""The CRIU flags a dump and its restores share: how TCP connections, unix sockets and unlinked files are
taken (:class:`SnapshotOptions`), the key of an external network namespace, and the log level."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from coldsnap.settings import SETTINGS

__all__ = ["EXTERNAL_NETNS_KEY", "SnapshotOptions", "TcpMode", "log_level_args"]

TcpMode = Literal["established", "close", "none"]


EXTERNAL_NETNS_KEY = "coldsnap-netns"
"""CRIU's key for a tree's network namespace dumped as external (``--external net[INODE]:KEY`` at dump,
``--inherit-fd fd[N]:KEY`` at restore)."""


@dataclass(frozen=True)
class SnapshotOptions:
    """How a tree is dumped and restored; the same options must be used for both."""

    tcp: TcpMode = "established"
    """``established``: live TCP connections are dumped and restored (needs a network lock);
    ``close``: they are dropped at dump and restored closed; ``none``: the tree has no connected TCP
    socket (listening ones are fine), so no flag and no network lock — CRIU then neither probes
    nftables nor unlocks anything, ~0.25 s less per dump and per restore. A connection that appears
    anyway makes the dump fail cleanly."""
    network_lock: Literal["nftables", "iptables", "skip"] = "nftables"
    """How established connections are frozen while the tree is dumped; nftables rather than CRIU's default
    iptables, which many hosts lack (and which is iptables-nft where podman is installed). ``skip`` when every
    connection's peer is a socket of the tree itself (frozen with it: nothing moves on them while CRIU reads
    them). CRIU keeps the dump's method in the image and uses it at restore whatever the restore's flag says:
    with ``nftables`` every restore deletes the dump's table (a libnftables context and a ``delete table``,
    which fails after the first restore, that deleted it, and otherwise leaves the table on the capture host);
    with ``skip`` it runs no nftables at all. (On the H200 the time saved was within the noise of SGLang's
    restores.)"""
    external_unix_sockets: bool = True
    """Allow unix sockets connected to peers outside the tree (e.g. a journal or a launcher)."""
    shell_job: bool = False
    """The tree shares the caller's session/terminal (not needed for ``setsid`` trees)."""
    ghost_limit_bytes: int = 256 << 20
    """Largest unlinked-but-open file copied into the image (CRIU's default, 1 MiB, refuses the
    unlinked shared-memory buffers servers keep in /dev/shm)."""

    def args(self) -> list[str]:
        out = ["--file-locks", "--manage-cgroups=ignore", "--ghost-limit", str(self.ghost_limit_bytes)]
        if self.tcp == "established":
            out += ["--tcp-established", "--network-lock", self.network_lock]
        elif self.tcp == "close":
            out += ["--tcp-close"]
        if self.external_unix_sockets:
            out += ["--ext-unix-sk"]
        if self.shell_job:
            out += ["--shell-job"]
        return out


def log_level_args() -> list[str]:
    """``COLDSNAP_CRIU_LOG_LEVEL=4`` (0-4) makes CRIU's logs verbose and timestamped, for diagnosing
    where a dump or restore spends its time; unset, CRIU's default (warnings and errors)."""
    level = SETTINGS.choice("COLDSNAP_CRIU_LOG_LEVEL")
    return [f"-v{level}"] if level is not None else []

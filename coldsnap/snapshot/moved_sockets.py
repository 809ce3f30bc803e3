"""One restore's own copy of a CRIU image's sockets: the port generation and per-replica names.

Several restores of one image may run on a host at once, each on its own serving port. The image
records the ports its sockets were bound to at capture, so a restore on another port restores from a
per-restore image directory: every file of the captured images linked, except ``files.img``, rewritten
(:mod:`coldsnap.snapshot.criu_images`). The committed images are only read.

The **port generation** is the operator contract's "one fixed shift that maps the captured serving port to the
requested port": every local port of the tree (listening TCP, bound UDP, on any address, and the local
ports of its connections) moves by the same shift, so the engine's other listeners (a TCP store, a
metrics port) move with the serving port and two replicas never share one; a connection whose both
ends are in the tree (vLLM's TCP store client, restored by CRIU's TCP repair) moves both ends, so it
still connects the same two sockets (an ephemeral local port wraps around 1024–65535 where the shift
would push it out of range). Every resulting bind is probed before CRIU runs. Abstract unix
sockets named by coldsnap (the agent's and the template's control sockets) get the replica's own names;
they are the only names a launcher connects to by name after the restore. Unix sockets bound to a file
get a path of the replica's own; the CUDA driver's socket, named after its pid namespace, is renamed for
the replica's by :mod:`coldsnap.snapshot.namespace_init`.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import socket
import stat
from dataclasses import dataclass, field
from pathlib import Path

from coldsnap.snapshot.criu_images import FILES_IMAGE, ImageFormatError, InetSocket, read_sockets, rewrite_sockets
from coldsnap.snapshot.namespace_init import is_namespace_socket

__all__ = ["PortGeneration", "connections_to", "port_generation", "probe_binds", "replica_images", "tree_sockets",
           "namespace_sockets", "probe_abstract_names", "path_socket_names",
           "probe_path_sockets"]

_PORT_MAX = 65535
_PORT_MIN = 1024  # where a connection's wrapped local port may land: not a privileged port


@dataclass(frozen=True)
class PortGeneration:
    """Captured serving port → requested one, and what that does to each of the tree's inet sockets."""

    shift: int
    moved: dict[int, int] = field(default_factory=dict)
    """Captured port → its port in this generation, for every local port of the tree."""
    peers: frozenset[tuple[int, int]] = frozenset()
    """(local port, remote port) of every connection of the tree: where both ends are the tree's (the
    reverse pair is there too), the remote port moves with the peer's local one."""

    def port(self, captured: int) -> int:
        return self.moved.get(captured, captured)

    def ports(self, sock: InetSocket) -> tuple[int | None, int | None]:
        """``sock``'s (local, remote) ports in this generation; ``None`` where one stays as captured."""
        local = self.moved.get(sock.src_port) if sock.src_port else None
        inside = sock.dst_port and (sock.dst_port, sock.src_port) in self.peers
        return local, self.moved.get(sock.dst_port) if inside else None


def tree_sockets(images: Path) -> tuple[list[InetSocket], list[bytes]]:
    """From one read of the socket image: the inet sockets of the tree that hold a local port (listeners,
    bound sockets, and connections: their local port moves too, two replicas of one connection inside
    the tree cannot share it), and the names of its unix sockets (abstract ones begin with NUL), each
    once, unnamed ones left out."""
    if not (images / FILES_IMAGE).is_file():
        return [], []
    inet, unix = read_sockets(images)
    return [s for s in inet if s.src_port], sorted({s.name for s in unix if s.name})


def connections_to(images: Path, addresses: set[bytes]) -> list[InetSocket]:
    """The tree's connected inet sockets whose peer is at one of ``addresses`` (packed): its connections to
    other launch units' trees."""
    if not addresses or not (images / FILES_IMAGE).is_file():
        return []
    return [s for s in read_sockets(images)[0] if s.dst_port and s.dst_addr in addresses]


def port_generation(sockets: list[InetSocket], captured_serving: int, serving: int) -> PortGeneration:
    """The generation that moves ``captured_serving`` to ``serving``; ``ValueError`` when it would push
    one of the ports the tree listens on out of range. A connection's own local port (an ephemeral one:
    no listener of the tree holds it) is only a name both ends must agree on, so it wraps around
    1024–65535 instead — the same shift, modulo: distinct ports stay distinct."""
    shift = serving - captured_serving
    listening = {s.src_port for s in sockets if s.bound}
    span = _PORT_MAX + 1 - _PORT_MIN
    moved = {port: port + shift if port in listening or port < _PORT_MIN else _PORT_MIN + (port + shift - _PORT_MIN) % span
             for port in {s.src_port for s in sockets}}
    out_of_range = sorted(p for p, q in moved.items() if not 1 <= q <= _PORT_MAX)
    if out_of_range:
        raise ValueError(f"serving on port {serving} would move the tree's port(s) {out_of_range} out of range "
                         f"(shift {shift:+d})")
    return PortGeneration(shift=shift, moved=moved,
                          peers=frozenset((s.src_port, s.dst_port) for s in sockets if s.dst_port))


def _address(sock: InetSocket) -> tuple[int, str]:
    """The family and address a probe binds for ``sock``: an IPv6 socket's IPv4-mapped address
    (``::ffff:a.b.c.d``, a dual-stack socket talking IPv4) as IPv4, where the port it takes lives."""
    if sock.family == socket.AF_INET6:
        address = ipaddress.IPv6Address(sock.src_addr or bytes(16))
        if address.ipv4_mapped is not None:
            return socket.AF_INET, str(address.ipv4_mapped)
        return socket.AF_INET6, str(address)
    return socket.AF_INET, str(ipaddress.IPv4Address(sock.src_addr or bytes(4)))


def probe_binds(sockets: list[InetSocket], generation: PortGeneration,
                addresses: dict[bytes, bytes] | None = None) -> list[str]:
    """Bind every socket of the generation that the tree binds as a process does (family, type, address,
    port) and say which cannot be bound now; an empty list means all of them can. Listeners set
    ``SO_REUSEADDR`` as servers do, so a port whose last connection lingers in TIME_WAIT counts as free, as
    it will for the tree. A TCP connection is not probed: CRIU restores it in TCP repair mode, whose bind
    forces reuse (a listener, or a TIME_WAIT left by an earlier replica on the same shift, does not stop
    it, while a bare bind would fail: CI refused a replica so), and a live replica on the same shift holds
    the serving port, which is probed. ``addresses``: packed captured → new, the addresses the restore maps
    (a unit placed on another host)."""
    taken = []
    probed: set[tuple[int, int, str, int]] = set()
    for sock in sockets:
        if sock.kind == socket.SOCK_STREAM and not sock.bound:
            continue
        if addresses and sock.src_addr in addresses:
            sock = dataclasses.replace(sock, src_addr=addresses[sock.src_addr])
        port = generation.port(sock.src_port)
        family, address = _address(sock)
        if (family, sock.kind, address, port) in probed:
            continue
        probed.add((family, sock.kind, address, port))
        try:
            with socket.socket(family, sock.kind) as probe:
                if sock.kind == socket.SOCK_STREAM:
                    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                probe.bind((address, port))
                if sock.kind == socket.SOCK_STREAM and sock.bound:
                    probe.listen(1)  # a listener on the wildcard address is seen only by another listen
        except OSError as exc:
            kind = "tcp" if sock.kind == socket.SOCK_STREAM else "udp"
            taken.append(f"{kind} {address}:{port} ({exc.strerror or exc})")
    return taken


def namespace_sockets(images: Path) -> list[bytes] | None:
    """The names of ``images/files.img``'s unix sockets that encode their pid namespace, one per socket:
    what :mod:`coldsnap.snapshot.namespace_init` renames for the replica's namespace (``[]``: none; None: the
    image could not be read here, so namespace_init decodes it and reports what is wrong)."""
    try:
        if b"cuda-uvmfd" not in (images / FILES_IMAGE).read_bytes():
            return []
        return [sock.name for sock in read_sockets(images)[1] if is_namespace_socket(sock.name)]
    except (OSError, ImageFormatError):
        return None


_SUN_PATH_MAX = 107  # sockaddr_un.sun_path holds 108 bytes with the terminating NUL


def path_socket_names(names: list[bytes], replica: str) -> dict[bytes, bytes]:
    """The unix sockets of ``names`` bound to a file (absolute paths: vLLM's ZeroMQ ``ipc://`` endpoints in
    /tmp), renamed ``<path>.<replica>``: two replicas cannot both listen at one path, and the name stays
    the same for every restore of one replica (CRIU replaces its stale file). A name that would not fit
    ``sun_path`` is kept."""
    renamed = {}
    for name in names:
        if name.startswith(b"/"):
            path = name.rstrip(b"\0")
            new = path + b"." + replica.encode()
            if len(new) <= _SUN_PATH_MAX:
                renamed[name] = new
    return renamed


def probe_path_sockets(paths: list[bytes]) -> tuple[list[str], list[Path]]:
    """For socket files a replica will bind: the ones a live listener holds (a connect succeeds) and the
    stale ones a previous incarnation left (nothing listens: CRIU would fail to bind over them)."""
    taken, stale = [], []
    for raw in paths:
        path = Path(raw.rstrip(b"\0").decode(errors="surrogateescape"))
        try:
            if not stat.S_ISSOCK(path.lstat().st_mode):
                continue
        except OSError:
            continue
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(1)
            try:
                probe.connect(str(path))
                taken.append(f"unix {path} (a process listens there)")
            except (ConnectionRefusedError, FileNotFoundError):
                stale.append(path)
            except OSError as exc:
                taken.append(f"unix {path} ({exc.strerror or exc})")
    return taken, stale


def probe_abstract_names(names: list[bytes]) -> list[str]:
    """Which of the abstract unix socket ``names`` another process holds now (an empty list: none)."""
    taken = []
    for name in names:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(name)
            except OSError as exc:
                shown = name[1:].rstrip(b"\0").decode(errors="replace")
                taken.append(f"unix @{shown} ({exc.strerror or exc})")
    return taken


def replica_images(images: Path, target: Path, generation: PortGeneration, unix_names: dict[bytes, bytes],
                   ghost_suffix: bytes = b"", addresses: dict[bytes, bytes] | None = None) -> Path:
    """``target`` holding a link to every file of ``images`` (and nothing else) and a ``files.img`` rewritten
    for this replica (ports moved by ``generation``, inet addresses mapped by ``addresses`` (a unit placed on
    another host), unix sockets renamed by ``unix_names``, the paths of
    files deleted while open suffixed with ``ghost_suffix``: see :func:`rewrite_sockets`).

    A restore runs this before CRIU starts (115 image files for vLLM's CPU build, one per thread among
    them): a link that a previous restore of this replica left, pointing where it must, is kept (a
    ``readlink`` instead of an unlink and a symlink); every other entry goes."""
    target.mkdir(parents=True, exist_ok=True)
    wanted: dict[str, str] = {}
    with os.scandir(images.resolve()) as entries:
        for entry in entries:
            if entry.name != FILES_IMAGE:
                wanted[entry.name] = os.path.realpath(entry.path) if entry.is_symlink() else entry.path
    with os.scandir(target) as present:
        for entry in present:
            if not (entry.is_symlink() and wanted.get(entry.name) == os.readlink(entry.path)):
                os.unlink(entry.path)  # (files.img included: rewritten below, never written through a link)
            else:
                del wanted[entry.name]
    for name, source in wanted.items():
        os.symlink(source, target / name)
    if (images / FILES_IMAGE).is_file():
        rewrite_sockets(images, target, generation.ports, unix_names, ghost_suffix, addresses)
    return target

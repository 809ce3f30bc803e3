"""One restore's replica and its GPUs, planned from plain facts of its image (standard library only).

admission plans its replica from the decoded capsule (:mod:`coldsnap.activation.restore_inputs`);
a restore's first step (:mod:`coldsnap.activation.early_restore`) plans the same one before pydantic is
imported, so that CRIU can start then. Both call :func:`plan`: the serving port and the port generation
that moves the tree's other ports with it, every bind the restored tree will make probed, the agents'
control sockets renamed for this replica, its path-bound sockets moved into its own names. And where the
image's GPU state goes on this host (:func:`gpu_remap`), which the entry's weight staging needs as well.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from coldsnap.agent.addresses import address
from coldsnap.snapshot.namespace_init import namespace_socket_names
from coldsnap.snapshot.moved_sockets import (PortGeneration, path_socket_names, port_generation,
                                       probe_abstract_names, probe_binds, probe_path_sockets, replica_images,
                                       tree_sockets)

__all__ = ["GpuPlacement", "PortsTaken", "Replica", "gpu_remap", "plan", "port_free", "replica_control", "replica_name",
           "write_replica_images"]


@dataclass(frozen=True)
class Replica:
    """What makes one restore of an image its own: where it serves, how its ports move there (the port
    generation), its agents' (and template's) control sockets, and its state directory's name."""

    serving_port: int
    generation: PortGeneration
    controls: dict[int, str]
    """Rank → the agent's control socket in this replica."""
    template_control: str | None
    unix_names: dict[bytes, bytes]
    """Captured abstract socket address → this replica's (the image's copy is rewritten with them)."""

    @property
    def name(self) -> str:
        return replica_name(self.serving_port)


class PortsTaken(Exception):
    """What the replica needs is taken, or its ports cannot move (``str``: the reason, for ``admission.port``).
    ``serving_port_taken``: the serving port is the captured one and a TCP bind of the tree is taken (a warm
    standby of the artifact may hold it)."""

    def __init__(self, message: str, serving_port_taken: bool = False):
        super().__init__(message)
        self.serving_port_taken = serving_port_taken


def port_free(port: int) -> bool:
    """Whether a listener could bind ``port`` on the loopback address now."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def replica_name(serving_port: int) -> str:
    """A replica's name: its directory under the artifact's state directory, the suffix of its
    path-bound sockets; one per serving port."""
    return f"port-{serving_port}"


_CONTROL_ID = re.compile(r"^(@coldsnap-(?:agent|template)-)[0-9a-f]{16}")


def replica_control(control: str, token: str) -> str:
    """``control`` (``@coldsnap-agent-<id>[.rankN]``, as :func:`~coldsnap.activation.engine_process.new_control_name`
    makes them) with this replica's id in place of the captured one; any other name is kept."""
    return _CONTROL_ID.sub(lambda match: match.group(1) + token, control)


def _abstract(control: str) -> bytes:
    named = address(control)
    return named if isinstance(named, bytes) else named.encode()


def plan(images: Path, captured_port: int, port: int, controls: dict[int, str], template_control: str | None,
         moved: dict[bytes, bytes] | None = None, token: Callable[[], str] = lambda: os.urandom(8).hex()) -> Replica:
    """The replica of the tree in ``images`` (captured serving on ``captured_port``, its agents' sockets
    ``controls`` by rank, a template's ``template_control``) that serves on ``port``; raises
    :class:`PortsTaken`. Every port the tree will bind is probed: the serving port itself, and the
    generation's move of each other. ``moved``: one unit of several, every unit's captured address → its
    new one, so the probe binds where the restore will."""
    sockets, tree_names = tree_sockets(images)
    try:
        generation = port_generation(sockets, captured_port, port)
    except ValueError as exc:
        raise PortsTaken(str(exc)) from None
    taken = probe_binds(sockets, generation, moved)
    # A template's engine (or a tree holding no socket of it) binds the serving port only once started.
    listens = template_control is None and any(s.src_port == captured_port for s in sockets)
    if not listens and not port_free(port):
        taken.append(f"tcp 127.0.0.1:{port}")
    if taken:
        shifted = "" if generation.shift == 0 else f" (the capture's ports moved by {generation.shift:+d})"
        raise PortsTaken(f"serving port {port}: the tree's port(s) {', '.join(taken)} are taken{shifted}",
                         serving_port_taken=port == captured_port)
    replica_token = token()
    renamed_controls = {rank: replica_control(control, replica_token) for rank, control in controls.items()}
    renamed_template = replica_control(template_control, replica_token) if template_control is not None else None
    renamed = {controls[rank]: renamed_controls[rank] for rank in controls}
    if template_control is not None and renamed_template is not None:
        renamed[template_control] = renamed_template
    names = {_abstract(old): _abstract(new) for old, new in renamed.items() if old.startswith("@")}
    # any other socket named after an agent's control (the served HTTP process's key gate,
    # coldsnap.agent.api_key) moves with it
    for name in tree_names:
        if name not in names and name.startswith(b"\0coldsnap-agent-"):
            names[name] = _abstract(replica_control("@" + name[1:].decode(errors="replace"), replica_token))
    paths = path_socket_names(tree_names, replica_name(port))
    names.update(paths)  # (the CUDA driver's: by the replica's pid 1)
    # Any other abstract name the tree binds is restored as it is: taken by another process (another
    # replica of an engine that binds a fixed one), CRIU could not bind it.
    fixed = [name for name in tree_names if name[:1] == b"\0" and name not in names
             and not namespace_socket_names([name], 0)]
    taken = probe_abstract_names(fixed) + probe_path_sockets(list(paths.values()))[0]
    if taken:
        raise PortsTaken(f"the tree's unix socket(s) {', '.join(taken)} are taken (by another replica of this "
                         "capsule?)")
    return Replica(port, generation, renamed_controls, renamed_template, names)


def write_replica_images(images: Path, state_dir: Path, replica: Replica, moved: dict[bytes, bytes] | None = None) -> Path:
    """The images CRIU restores ``replica`` from: the capture's ``images``, with ``files.img`` rewritten for
    its ports and sockets in ``state_dir/images`` (the artifact is only read). A previous incarnation's
    socket files at the replica's paths go first (nothing listens there: the plan probed them)."""
    for stale in probe_path_sockets([n for n in replica.unix_names.values() if n.startswith(b"/")])[1]:
        stale.unlink(missing_ok=True)
    return replica_images(images, state_dir / "images", replica.generation, replica.unix_names,
                          f".{replica.name}".encode(), moved)


@dataclass(frozen=True)
class GpuPlacement:
    """Where an n610 image's GPU state goes on this host: each captured GPU by UUID onto one of this
    host's (a bijection over the captured ones; empty when nothing moves), and, for staging, the
    launcher's device ordinal behind each of the engine's."""

    pairs: list[tuple[str, str]]
    launcher_ordinals: dict[int, int]


def _visible(value: str | None, uuids: list[str], where: str) -> list[str]:
    """``CUDA_VISIBLE_DEVICES`` (ordinals or UUIDs, comma-separated) as UUIDs of ``uuids``; all of them
    when unset. ``ValueError`` names a device that is not there."""
    if value is None:
        return list(uuids)
    chosen = []
    for token in (t.strip() for t in value.split(",") if t.strip()):
        if token.isdigit() and int(token) < len(uuids):
            chosen.append(uuids[int(token)])
        elif token in uuids:
            chosen.append(token)
        else:
            raise ValueError(f"GPU {token} is not among the {len(uuids)} GPU(s) {where}")
    if len(set(chosen)) != len(chosen):
        raise ValueError(f"CUDA_VISIBLE_DEVICES={value} names a GPU twice")
    return chosen


def gpu_remap(captured: list[str], captured_visible: str | None, current: list[str],
              requested_visible: str | None) -> GpuPlacement:
    """The engine saw ``captured_visible`` of the capture host's ``captured`` GPUs; it is to see
    ``requested_visible`` of this host's ``current`` ones, in that order (unset: this host's GPUs by
    ordinal, as many as there are). ``ValueError`` when the GPUs asked for cannot be given."""
    used = _visible(captured_visible, captured, "the capture host had")
    target = _visible(requested_visible, current, "this host has")
    if requested_visible is not None and len(target) < len(used):
        raise ValueError(f"the image's engine used {len(used)} GPU(s); {len(target)} placed")
    mapping = dict(zip(used, target))
    spare = [gpu for gpu in current if gpu not in mapping.values()]
    for gpu in captured:  # the driver wants every checkpointed GPU mapped, each onto a GPU of its own
        if gpu not in mapping and spare:
            mapping[gpu] = gpu if gpu in spare else spare[0]
            spare.remove(mapping[gpu])
    pairs = list(mapping.items()) if any(old != new for old, new in mapping.items()) else []
    return GpuPlacement(pairs=pairs, launcher_ordinals={i: current.index(gpu) for i, gpu in enumerate(target)})

"""One restore's place on this host: the replica it is (serving port, port generation, control sockets,
state directory) and the GPUs its ranks go to. Decided at admission, before anything starts; the restore
sequences (:mod:`coldsnap.activation.restore_steps`, :mod:`coldsnap.activation.n580`) carry it out."""

from __future__ import annotations

import json
import re
import socket
import uuid
from dataclasses import dataclass
from typing import Callable

from coldsnap.activation.artifact_dir import ArtifactDir
from coldsnap.activation.state import host_cache_dir
from coldsnap.activation.units import moved_addresses, selected_unit
from coldsnap.agent.protocol import address as socket_address
from coldsnap.contracts.capsule import CapsuleManifest
from coldsnap.operation import OperationContext, OperationFailed
from coldsnap.snapshot.cuda_checkpoint import cuda_devices
from coldsnap.snapshot.replica import (PortGeneration, tree_sockets, namespace_socket_names, path_socket_names,
                                       port_generation, probe_abstract_names, probe_binds, probe_path_sockets)

__all__ = ["Replica", "plan_replica", "GpuPlacement", "gpu_placement", "gpu_remap", "captured_visible_devices",
           "refuse_gpus_for_a_cpu_artifact", "port_free", "serving_port"]


def port_free(port: int) -> bool:
    """Whether a listener could bind ``port`` on the loopback address now."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def serving_port(context: OperationContext, capsule: CapsuleManifest) -> int:
    """Where the restored server will listen: the request's serving port, else the captured one (an n610
    image gets there by its port generation, an n580 template by its placement)."""
    units, selection = context.request.units, context.request.unit
    # (a unit of several that serves nothing moves its ports as unit 0's serving port does)
    asked = units[0].serving_port if selection is None else units[selection.index].serving_port or units[0].serving_port
    return asked or capsule.metadata.serving_port


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


def replica_name(serving_port: int) -> str:
    """A replica's name: its directory under the artifact's state directory, the suffix of its
    path-bound sockets; one per serving port."""
    return f"port-{serving_port}"


_CONTROL_ID = re.compile(r"^(@coldsnap-(?:agent|template)-)[0-9a-f]{16}")


def _replica_control(control: str, token: str) -> str:
    """``control`` (``@coldsnap-agent-<id>[.rankN]``, as :func:`~coldsnap.activation.engine_process.new_control_name`
    makes them) with this replica's id in place of the captured one; any other name is kept."""
    return _CONTROL_ID.sub(lambda match: match.group(1) + token, control)


def plan_replica(context: OperationContext, artifact: ArtifactDir, capsule: CapsuleManifest,
                 standby_pid: Callable[[], int | None] = lambda: None) -> Replica:
    """This restore's :class:`Replica`; ``admission.port`` when a port it needs is taken. Every port the
    tree will bind is probed: the serving port itself, and the generation's move of each other.
    ``standby_pid``: the pid of the artifact's live warm standby, if any (asked only when the captured
    port is taken, to say so)."""
    metadata = capsule.metadata
    port = serving_port(context, capsule)
    sockets, tree_names = tree_sockets(artifact.images(capsule.unit_id))
    try:
        generation = port_generation(sockets, metadata.serving_port, port)
    except ValueError as exc:
        raise OperationFailed("admission.port", str(exc)) from None
    # One unit of several: every unit's captured address → its new one, published here (every unit admits
    # at once), so the probe binds where the restore will.
    moved = moved_addresses(context.units.place(metadata.address)) if context.units is not None else None
    taken = probe_binds(sockets, generation, moved)
    # A template's engine (or a tree holding no socket of it) binds the serving port only once started.
    listens = metadata.template is None and any(s.src_port == metadata.serving_port for s in sockets)
    if not listens and not port_free(port):
        taken.append(f"tcp 127.0.0.1:{port}")
    if taken:
        if port == metadata.serving_port:
            pid = standby_pid()
            if pid is not None:
                raise OperationFailed("admission.port", f"serving port {port} is held by a warm standby of this "
                                      f"artifact (pid {pid}): `coldsnap wake {artifact.root}` makes it serve")
        shifted = "" if generation.shift == 0 else f" (the capture's ports moved by {generation.shift:+d})"
        raise OperationFailed("admission.port", f"serving port {port}: the tree's port(s) {', '.join(taken)} are "
                              f"taken{shifted}")
    token = uuid.uuid4().hex[:16]
    controls = {w.rank: _replica_control(w.control, token) for w in metadata.workers}
    template_control = _replica_control(metadata.template.control, token) if metadata.template is not None else None
    renamed = {w.control: controls[w.rank] for w in metadata.workers}
    if metadata.template is not None and template_control is not None:
        renamed[metadata.template.control] = template_control
    names = {_abstract(old): _abstract(new) for old, new in renamed.items() if old.startswith("@")}
    paths = path_socket_names(tree_names, replica_name(port))
    names.update(paths)  # (the CUDA driver's: by the replica's pid 1)
    # Any other abstract name the tree binds is restored as it is: taken by another process (another
    # replica of an engine that binds a fixed one), CRIU could not bind it.
    fixed = [name for name in tree_names if name[:1] == b"\0" and name not in names
             and not namespace_socket_names([name], 0)]
    taken = probe_abstract_names(fixed) + probe_path_sockets(list(paths.values()))[0]
    if taken:
        raise OperationFailed("admission.port", f"the tree's unix socket(s) {', '.join(taken)} are taken "
                              "(by another replica of this capsule?)")
    return Replica(port, generation, controls, template_control, names)


def _abstract(control: str) -> bytes:
    address = socket_address(control)
    return address if isinstance(address, bytes) else address.encode()


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


def captured_visible_devices(artifact: ArtifactDir, unit: int = 0) -> str | None:
    """The ``CUDA_VISIBLE_DEVICES`` the capture gave the engine (None: unset, or no readable request)."""
    try:
        captured_request = json.loads(artifact.request_path.read_text())
        return (captured_request.get("units") or [{}])[unit].get("env", {}).get("CUDA_VISIBLE_DEVICES")
    except (OSError, ValueError, AttributeError):
        return None


def refuse_gpus_for_a_cpu_artifact(context: OperationContext, artifact: ArtifactDir, gpu_model: str | None) -> None:
    """``admission.gpu`` when the request places the engine on GPUs (``--gpu``: a ``CUDA_VISIBLE_DEVICES``
    other than the capture's) and the artifact was captured without a GPU (no ``gpu_model`` recorded):
    nothing of it would run there, so admitting it would promise what the restore does not do."""
    index = selected_unit(context.request) or 0
    asked = context.request.units[index].env.get("CUDA_VISIBLE_DEVICES")
    if gpu_model is None and asked is not None and asked != captured_visible_devices(artifact, index):
        raise OperationFailed("admission.gpu", f"GPU {asked} asked for (--gpu), but {artifact.root} was captured "
                              "without a GPU: it restores on the CPU, as captured; restore it without --gpu")


def gpu_placement(context: OperationContext, artifact: ArtifactDir, capsule: CapsuleManifest) -> GpuPlacement:
    """This restore's :class:`GpuPlacement` (``admission.gpu`` when the request's GPUs are not there):
    the request's ``CUDA_VISIBLE_DEVICES`` (``--gpu``) against the capture's."""
    metadata = capsule.metadata
    if not metadata.gpu_pids:
        return GpuPlacement(pairs=[], launcher_ordinals={})
    try:
        index = selected_unit(context.request) or 0
        return gpu_remap(metadata.gpu_uuids, captured_visible_devices(artifact, index),
                         [d["uuid"] for d in cuda_devices(host_cache_dir())],
                         context.request.units[index].env.get("CUDA_VISIBLE_DEVICES"))
    except ValueError as exc:
        raise OperationFailed("admission.gpu", str(exc)) from None

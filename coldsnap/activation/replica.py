"""One restore's place on this host: the replica it is (serving port, port generation, control sockets,
state directory) and the GPUs its ranks go to. Decided at admission, before anything starts; the restore
sequences (:mod:`coldsnap.activation.restore_steps`, :mod:`coldsnap.activation.n580`) carry it out."""

from __future__ import annotations

import json
from typing import Callable

from coldsnap.activation.artifact_dir import ArtifactDir
from coldsnap.activation.replica_plan import GpuPlacement, PortsTaken, Replica, gpu_remap, plan, port_free
from coldsnap.activation.state import host_cache_dir
from coldsnap.activation.units import moved_addresses, selected_unit
from coldsnap.contracts.capsule import CapsuleManifest
from coldsnap.operation import OperationContext, OperationFailed
from coldsnap.snapshot.cuda_checkpoint import cuda_devices

__all__ = ["Replica", "plan_replica", "GpuPlacement", "gpu_placement", "gpu_remap", "captured_visible_devices",
           "refuse_gpus_for_a_cpu_artifact", "port_free", "serving_port"]


def serving_port(context: OperationContext, capsule: CapsuleManifest) -> int:
    """Where the restored server will listen: the request's serving port, else the captured one (an n610
    image gets there by its port generation, an n580 template by its placement)."""
    units, selection = context.request.units, context.request.unit
    # (a unit of several that serves nothing moves its ports as unit 0's serving port does)
    asked = units[0].serving_port if selection is None else units[selection.index].serving_port or units[0].serving_port
    return asked or capsule.metadata.serving_port


def plan_replica(context: OperationContext, artifact: ArtifactDir, capsule: CapsuleManifest,
                 standby_pid: Callable[[], int | None] = lambda: None) -> Replica:
    """This restore's :class:`Replica` (:func:`coldsnap.activation.replica_plan.plan`); ``admission.port``
    when a port it needs is taken. ``standby_pid``: the pid of the artifact's live warm standby, if any
    (asked only when the captured port is taken, to say so)."""
    metadata = capsule.metadata
    port = serving_port(context, capsule)
    # One unit of several: every unit's captured address → its new one, published here (every unit admits
    # at once), so the probe binds where the restore will.
    moved = moved_addresses(context.units.place(metadata.address)) if context.units is not None else None
    try:
        return plan(artifact.images(capsule.unit_id), metadata.serving_port, port,
                    {w.rank: w.control for w in metadata.workers},
                    metadata.template.control if metadata.template is not None else None, moved)
    except PortsTaken as exc:
        pid = standby_pid() if exc.serving_port_taken else None
        if pid is not None:
            raise OperationFailed("admission.port", f"serving port {port} is held by a warm standby of this "
                                  f"artifact (pid {pid}): `coldsnap wake {artifact.root}` makes it serve") from None
        raise OperationFailed("admission.port", str(exc)) from None


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

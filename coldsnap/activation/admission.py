"""Restore admission: every check a restore (or warm) makes before it starts anything.

In order: the descriptor (strict; the request's engine and snapshot driver), the platform (architecture;
the kernel with ``compatibility.kernel=exact``), the capsule manifest and every CRIU image in it against
its SHA-256, the host files the captured tree maps or holds open (``admission.files``), each rank's
weight source (native pack, or the pinned safetensors: :func:`weight_sources`), the GPU (driver floors,
model, checkpoint API), CRIU (version, ``criu check``), then the serving port: its lock (one operation per
port, :mod:`coldsnap.activation.operation_locks`) and every bind the restored tree will make
(:meth:`~coldsnap.activation.restore_inputs.RestoreInputs.replica`). What the restore brings back and where
(the unit, the port, the weights' mode, the GPUs) is decided by :mod:`coldsnap.activation.restore_inputs`, the
rules the program's fast entry decided with (:mod:`coldsnap.activation.early_restore`): a tree the entry
started is adopted where it decided the same, and abandoned, saying how it differed, where not.
``criu check`` and the CUDA probe run in threads while the images are checked. What a driver admits on top (n610: the GPUs and their free memory; n580: the
template's placement) is the driver's (:mod:`coldsnap.activation.drivers`).
"""

from __future__ import annotations

import json
import os
import platform
import stat
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

from coldsnap.activation.artifact_dir import ArtifactDir
from coldsnap.activation.early_restore import NOT_RUN, EarlyRestore, FastEntry
from coldsnap.activation.operation_locks import hold_port
from coldsnap.activation.qualification import check_driver_floor, require_implemented_driver
from coldsnap.activation.ranks import rank_prefix
from coldsnap.activation.restore_place import GpuPlacement, PortsTaken, Replica
from coldsnap.activation.restore_inputs import RestoreInputs, decide, differences
from coldsnap.activation.units import moved_addresses
from coldsnap.activation.staging import stages_rank
from coldsnap.activation.standby import live_standby
from coldsnap.activation.state import artifact_id, host_cache_dir
from coldsnap.contracts.artifact import ArtifactDescriptor, UnitRecord, WorkerRecord
from coldsnap.contracts.base import ContractError
from coldsnap.contracts.capsule import CapsuleManifest
from coldsnap.host import nvidia_kernel_driver
from coldsnap.operation import OperationContext, OperationFailed
from coldsnap.payload.arrival import arrival_for
from coldsnap.payload.errors import PackError
from coldsnap.payload.validation import verify_file, verify_files
from coldsnap.snapshot.criu_binary import MINIMUM_VERSION, CriuError, checked_criu
from coldsnap.snapshot.criu_images import ImageFormatError
from coldsnap.snapshot.cuda_checkpoint import cached_probe_cuda, cuda_devices
from coldsnap.snapshot.host_files import changed_host_files
from coldsnap.snapshot.thp import ThpError, host_thp_requested, thp_mode

__all__ = ["Admitted", "WeightSource", "admit", "gpu_placement", "launcher_stages", "restore_inputs", "weight_sources"]


@dataclass(frozen=True)
class Admitted:
    """What admission found: the artifact's descriptor and capsule, each rank's weight source, and this
    restore's place on the host."""

    descriptor: ArtifactDescriptor
    capsule: CapsuleManifest
    inputs: RestoreInputs
    sources: dict[int, "WeightSource"]
    replica: Replica
    early: EarlyRestore | None = None
    """The tree the process's entry started for this very restore (its CRIU runs already)."""


class _InBackground:
    """A call run in a thread from now on; :meth:`result` waits for it and returns (or raises) what it did."""

    def __init__(self, call: Callable[[], Any], name: str):
        self._outcome: dict[str, Any] = {}

        def run() -> None:
            try:
                self._outcome["value"] = call()
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                self._outcome["error"] = exc

        self._thread = threading.Thread(target=run, name=name, daemon=True)
        self._thread.start()

    def result(self) -> Any:
        self._thread.join()
        if "error" in self._outcome:
            raise self._outcome["error"]
        return self._outcome["value"]


def _admit_gpu(context: OperationContext, descriptor: ArtifactDescriptor, probe: dict) -> None:
    """The snapshot driver's NVIDIA floor (always), the captured floor (unless relaxed); for n610, whose
    image holds CUDA state, also the GPU model, compute capability and the checkpoint API (an n580
    template holds none: any GPU the engine runs on will do). ``probe``: :func:`probe_cuda`'s answer."""
    captured = descriptor.platform
    driver = nvidia_kernel_driver()
    devices = probe["devices"] if probe["available"] else []
    if driver is None or not devices:
        raise OperationFailed("admission.cuda", "the artifact was captured on a GPU; this host has no usable NVIDIA GPU")
    major = int(driver.split(".")[0])
    check_driver_floor(context, descriptor.snapshot_driver, driver, "admission.driver_floor")
    if context.request.policy.compatibility.enforce_captured_driver_floor and major < (captured.nvidia_driver_floor or 0):
        raise OperationFailed("admission.driver_floor", f"captured on NVIDIA driver {captured.nvidia_driver}, this host "
                              f"has {driver} (set compatibility.enforce_captured_driver_floor=false to allow)")
    if descriptor.snapshot_driver == "n580":
        return
    device = devices[0]
    if (device["name"], device["compute_capability"]) != (captured.gpu_model, captured.compute_capability):
        raise OperationFailed("admission.gpu", f"captured on {captured.gpu_model} (cc {captured.compute_capability}), "
                              f"this host has {device['name']} (cc {device['compute_capability']})")
    if not probe["checkpoint_api"]:
        raise OperationFailed("admission.cuda", "this driver has no CUDA checkpoint API")


def _regular_file_size(path: Path) -> int | None:
    try:
        status = path.stat()
    except OSError:
        return None
    return status.st_size if stat.S_ISREG(status.st_mode) else None


def _admit_capsule(context: OperationContext, artifact: ArtifactDir, unit: UnitRecord) -> CapsuleManifest:
    """The unit's capsule manifest and every image it lists, and the host files its tree maps."""
    timer, op = context.timer, context.request.operation
    with timer.span(f"{op}.admission.capsule") as span:
        capsule_path = artifact.capsule_path(unit.unit_id)
        try:  # the manifest itself first: the descriptor binds its digest
            verify_file(capsule_path, unit.capsule.sha256, artifact.record_dir(capsule_path))
            capsule = artifact.read_capsule(unit.unit_id)
        except (PackError, OSError) as exc:
            raise OperationFailed("admission.capsule", f"capsule of {unit.unit_id}: {exc}") from None
        except ContractError as exc:  # an older or newer coldsnap's manifest, named as such
            raise OperationFailed("admission.capsule", f"capsule of {unit.unit_id} cannot be read by this coldsnap: "
                                  f"{'; '.join(exc.problems)}") from None
        # Every image against the capsule's digest before CRIU reads it: a same-size corruption must stop
        # here, not restore garbage. Unchanged files are trusted from their records, each read once.
        images = artifact.images(unit.unit_id)
        by_folder: dict[Path, list[tuple[Path, str]]] = {}
        for entry in capsule.files:
            path = images / entry.path
            if _regular_file_size(path) != entry.size_bytes:
                raise OperationFailed("admission.capsule", f"capsule file {entry.path} is missing or changed size")
            by_folder.setdefault(path.parent, []).append((path, entry.sha256))
        verified_by: dict[str, int] = {}
        for files in by_folder.values():
            try:
                verified = verify_files(files, artifact.record_dir(files[0][0]))
            except (PackError, OSError) as exc:
                raise OperationFailed("admission.capsule", f"capsule file {exc}") from None
            for verification in verified:
                verified_by[verification.method] = verified_by.get(verification.method, 0) + 1
        span["images_verified_by"] = ",".join(f"{m}:{n}" for m, n in sorted(verified_by.items()))
        recorded = sorted(w.rank for w in capsule.metadata.workers)
        if recorded != sorted(w.rank for w in unit.workers):
            raise OperationFailed("admission.capsule", f"capsule of {unit.unit_id} records ranks {recorded}, the "
                                  f"artifact {sorted(w.rank for w in unit.workers)}")
    with timer.span(f"{op}.admission.files") as span:
        try:
            changed = changed_host_files(images, capsule.metadata.host_file_mtimes_ns)
        except (OSError, ImageFormatError) as exc:
            raise OperationFailed("admission.capsule", f"capsule of {unit.unit_id}: files.img: {exc}") from None
        if changed:
            raise OperationFailed("admission.files", f"{len(changed)} host file(s) the captured tree maps or holds open "
                                  f"changed since capture: {'; '.join(changed[:20])}"
                                  f"{f' (and {len(changed) - 20} more)' if len(changed) > 20 else ''} — restore "
                                  "where they are as at capture, or capture again")
    return capsule


def admit(context: OperationContext, artifact: ArtifactDir, entry: FastEntry = NOT_RUN) -> Admitted:
    """Every check restore can make without starting anything; raises OperationFailed with the first problem.
    ``entry``: what the program's entry did for this restore (its tree adopted here, or abandoned)."""
    timer = context.timer
    op = context.request.operation  # restore or warm: the same admission, each under its own span names
    with timer.span(f"{op}.admission.descriptor"):
        require_implemented_driver(context.request.snapshot_driver)
        if not artifact.committed():
            raise OperationFailed("admission.artifact", f"{artifact.root} holds no committed artifact (no artifact.json)")
        try:
            descriptor = artifact.load()
        except ContractError as exc:
            raise OperationFailed("admission.artifact", "; ".join(exc.problems)) from None
        if descriptor.engine != context.request.engine or descriptor.snapshot_driver != context.request.snapshot_driver:
            raise OperationFailed("admission.driver", f"artifact is {descriptor.engine}/{descriptor.snapshot_driver}, "
                                  f"request asks {context.request.engine}/{context.request.snapshot_driver}")
        index = _admit_topology(context, descriptor)
    # `criu check` (~0.1 s) and the CUDA probe (~0.15 s: driver init) run in threads while the capsule's
    # images are checked; their spans are the waits, in the order their failures are reported.
    cache_dir = host_cache_dir()
    checker = _InBackground(lambda: checked_criu(cache_dir), "coldsnap-criu-check")
    gpu_probe = (_InBackground(lambda: cached_probe_cuda(cache_dir), "coldsnap-cuda-probe")
                 if descriptor.platform.nvidia_driver is not None else None)
    with timer.span(f"{op}.admission.platform"):
        if descriptor.platform.arch != platform.machine():
            raise OperationFailed("admission.platform", f"captured on {descriptor.platform.arch}, this is {platform.machine()}")
        if context.request.policy.compatibility.kernel == "exact" and descriptor.platform.kernel != platform.release():
            raise OperationFailed("admission.kernel", f"captured on kernel {descriptor.platform.kernel}, this is {platform.release()}")
    capsule = _admit_capsule(context, artifact, unit := descriptor.units[index])
    inputs = restore_inputs(context, artifact, descriptor, capsule)
    _refuse_gpus_for_a_cpu_artifact(artifact, inputs, descriptor.platform.gpu_model)
    with timer.span(f"{op}.admission.payload") as span:
        sources = weight_sources(context, artifact, unit.workers, inputs.weights_mode, span)
    if gpu_probe is not None:
        with timer.span(f"{op}.admission.gpu"):
            _admit_gpu(context, descriptor, gpu_probe.result())
    try:
        host_thp = host_thp_requested()
    except ThpError as exc:
        raise OperationFailed("admission.host_thp", str(exc)) from None
    if host_thp:
        with timer.span(f"{op}.admission.host_thp") as span:
            try:
                span["host_thp_before"] = thp_mode()
            except ThpError as exc:
                raise OperationFailed("admission.host_thp", str(exc)) from None
            if os.geteuid() != 0:
                raise OperationFailed("admission.host_thp", "--host-thp sets the host's THP mode, which needs root")
    with timer.span(f"{op}.admission.criu") as span:
        try:
            version, check = checker.result()
        except CriuError as exc:
            raise OperationFailed("admission.criu", str(exc)) from None
        span["criu"] = str(version)  # (its GitID says whether it fills huge pages)
        if version.numbers[:2] < MINIMUM_VERSION:
            raise OperationFailed("admission.criu", f"CRIU {version} is too old (need 4.2+)")
        if not check.ok:
            raise OperationFailed("admission.criu", f"criu check failed: {check.output.splitlines()[-1:] or ''}")
    with timer.span(f"{op}.admission.port") as span:
        early = _adopted(entry, inputs, artifact, span) if op == "restore" else None
        # One operation per port from here on: a concurrent restore, warm or wake of it loses here (the entry's
        # early restore took it already: this process holds it)
        hold_port(context, inputs.serving_port, str(artifact.root))
        if early is not None:  # planned, probed and being restored since the entry: admitted, it is this one's
            context.held.callback(early.lock.release)  # (the port's lock too: released when the operation ends)
            replica = early.replica
            span["early_restore"] = True
        else:
            replica = _plan_replica(context, artifact, capsule, inputs)
        span["serving_port"] = replica.serving_port
        if replica.generation.shift:
            span["port_shift"] = replica.generation.shift
    return Admitted(descriptor, capsule, inputs, sources, replica, early)


def restore_inputs(context: OperationContext, artifact: ArtifactDir, descriptor: ArtifactDescriptor,
                   capsule: CapsuleManifest) -> RestoreInputs:
    """What this restore brings back and where (:func:`coldsnap.activation.restore_inputs.decide`), from the
    strictly decoded request, descriptor and capsule: the rules the program's fast entry decided with."""
    try:
        captured = json.loads(artifact.request_path.read_text())
    except (OSError, ValueError):
        captured = None  # (the capture's GPUs then unknown: as unset)
    return decide(context.request.to_json_value(), captured if isinstance(captured, dict) else None,
                  descriptor.to_json_value(), capsule.to_json_value(), artifact.root)


def _adopted(entry: FastEntry, inputs: RestoreInputs, artifact: ArtifactDir, span: dict[str, Any]) -> EarlyRestore | None:
    """The tree the program's entry started, where it decided what admission decided (then this restore's); else
    abandoned — its tree and its port's lock go — saying how it differed."""
    early = entry.tree
    if early is None or early.settled:
        return None
    differing = differences(early.inputs, inputs)
    if early.artifact_id != artifact_id(artifact.root):
        differing.append("the artifact's identity")
    if differing:
        early.abandon()
        span["early_restore_declined"] = f"the entry decided otherwise: {'; '.join(differing)}"
        return None
    return early


def _plan_replica(context: OperationContext, artifact: ArtifactDir, capsule: CapsuleManifest,
                  inputs: RestoreInputs) -> Replica:
    """This restore's :class:`Replica` (:meth:`RestoreInputs.replica`); ``admission.port`` when a port it needs is
    taken (naming the artifact's warm standby when that is what holds the captured port)."""
    # One unit of several: every unit's captured address → its new one, published here (every unit admits
    # at once), so the probe binds where the restore will.
    units = context.units
    try:
        return inputs.replica(moved_addresses(units.place(capsule.metadata.address)) if units is not None else None)
    except PortsTaken as exc:
        pid = getattr(live_standby(artifact), "pid", None) if exc.serving_port_taken else None
        if pid is not None:
            raise OperationFailed("admission.port", f"serving port {inputs.serving_port} is held by a warm standby of "
                                  f"this artifact (pid {pid}): `coldsnap wake {artifact.root}` makes it serve") from None
        raise OperationFailed("admission.port", str(exc)) from None


def gpu_placement(inputs: RestoreInputs, capsule: CapsuleManifest) -> GpuPlacement:
    """This restore's :class:`GpuPlacement` (``admission.gpu`` when the request's GPUs are not there): the
    request's ``CUDA_VISIBLE_DEVICES`` (``--gpu``) against the capture's."""
    metadata = capsule.metadata
    if not metadata.gpu_pids:
        return GpuPlacement(pairs=[], launcher_ordinals={})
    try:
        return inputs.gpu_placement(metadata.gpu_uuids, [d["uuid"] for d in cuda_devices(host_cache_dir())])
    except ValueError as exc:
        raise OperationFailed("admission.gpu", str(exc)) from None


def _refuse_gpus_for_a_cpu_artifact(artifact: ArtifactDir, inputs: RestoreInputs, gpu_model: str | None) -> None:
    """``admission.gpu`` when the request places the engine on GPUs (``--gpu``: a ``CUDA_VISIBLE_DEVICES``
    other than the capture's) and the artifact was captured without a GPU (no ``gpu_model`` recorded):
    nothing of it would run there, so admitting it would promise what the restore does not do."""
    if gpu_model is None and inputs.gpus is not None and inputs.gpus != inputs.captured_gpus:
        raise OperationFailed("admission.gpu", f"GPU {inputs.gpus} asked for (--gpu), but {artifact.root} was "
                              "captured without a GPU: it restores on the CPU, as captured; restore it without --gpu")


def _admit_topology(context: OperationContext, descriptor: ArtifactDescriptor) -> int:
    """The index of the unit this restore brings back: the only one, or the request's selection of one of
    several, which must be the artifact's units (a subset of them is never restored: the others meet it
    at the coordinator, each on its own host)."""
    request = context.request
    units = [u.unit_id for u in descriptor.units]
    if len(units) == 1 and request.unit is None:
        return 0
    if request.unit is None:
        raise OperationFailed("admission.topology", f"the artifact has {len(units)} launch units: restore each on its "
                              f"own host, all at once (coldsnap restore --units {len(units)} --unit K --rendezvous "
                              "HOST:PORT ...); a subset of the units is never restored")
    if request.unit.units != len(units) or [u.unit_id for u in request.units] != units:
        raise OperationFailed("admission.topology", f"the request's {request.unit.units} units "
                              f"{[u.unit_id for u in request.units]} are not the artifact's {units}")
    if context.units is None:
        raise OperationFailed("admission.topology", "a unit of several is restored through its coordinator")
    return units.index(request.unit.unit_id)


WeightSource = Literal["native", "recovery"]


def weight_sources(context: OperationContext, artifact: ArtifactDir, workers: list[WorkerRecord], mode: str,
                   span: dict[str, Any]) -> dict[int, WeightSource]:
    """Where each rank's weights will come from, every file verified (stat-bound record or full hash):
    ``native`` the payload pack, ``recovery`` the safetensors the capture pinned — by ``weights.mode``:
    ``native`` needs the pack, ``recovery`` the safetensors, ``auto`` takes the pack and falls back to
    the safetensors (with a warning) when the pack is missing or fails verification (``mode``: the request's,
    :attr:`RestoreInputs.weights_mode`). The residual is needed either way."""

    def check(path: Path, sha256: str, record_dir: Path | None) -> str:
        if arrival_for(path) is not None:  # being pulled by this restore: each chunk is verified as it lands
            return "arriving"
        try:
            return verify_file(path, sha256, record_dir).method
        except (PackError, OSError) as exc:
            raise _Unusable(str(exc)) from None

    sources: dict[int, WeightSource] = {}
    for worker in workers:
        prefix = rank_prefix(worker.rank)
        residual = artifact.root / worker.residual.path
        try:
            span[f"{prefix}residual_verified_by"] = check(residual, worker.residual.sha256, artifact.record_dir(residual))
        except _Unusable as exc:
            raise OperationFailed("admission.payload", str(exc)) from None
        native_problem = None
        if mode == "native" and worker.payload is None:
            raise OperationFailed("admission.payload", f"weights.mode native, but rank {worker.rank} was captured "
                                  "without a native pack (weights.mode recovery, native_generation off)")
        if mode != "recovery" and worker.payload is not None:  # auto without a pack: recovery is the only way
            try:
                payload = artifact.root / worker.payload.path
                span[f"{prefix}pack_verified_by"] = check(payload, worker.payload.sha256, artifact.record_dir(payload))
                sources[worker.rank] = span[f"{prefix}source"] = "native"
                continue
            except _Unusable as exc:
                native_problem = str(exc)
                if mode == "native" or worker.recovery is None:
                    raise OperationFailed("admission.payload", native_problem + (
                        "" if mode == "native" else "; and the capture pinned no safetensors to recover from")) from None
        if worker.recovery is None:  # (auto came here only with no pack recorded, and then capture pinned them)
            raise OperationFailed("admission.recovery", f"weights.mode {mode}, but the capture pinned no safetensors "
                                  f"for rank {worker.rank} (its engine reported none)")
        try:
            span[f"{prefix}recovery_verified_by"] = ",".join(
                check(Path(pinned.path), pinned.sha256, artifact.external_record_dir(Path(pinned.path), context.hand_over))
                for pinned in worker.recovery)
        except _Unusable as exc:
            if native_problem:  # auto: neither source is usable
                raise OperationFailed("admission.payload", f"{native_problem}; and the recovery safetensors: {exc}") from None
            raise OperationFailed("admission.recovery", f"recovery safetensors: {exc}") from None
        if native_problem:
            context.warn(f"rank {worker.rank}: {native_problem}; restoring its weights from the pinned safetensors "
                         "(weights.mode auto)")
        sources[worker.rank] = span[f"{prefix}source"] = "recovery"
    return sources


class _Unusable(Exception):
    """A weight source file that is missing, unreadable or not the bytes recorded."""


def launcher_stages(op: str, descriptor: ArtifactDescriptor, capsule: CapsuleManifest,
                    sources: dict[int, "WeightSource"]) -> bool:
    """Whether the launcher of ``op`` will hydrate some rank's weights itself (a CUDA context of its own on
    that GPU): :func:`coldsnap.activation.staging.stages_rank` for any rank."""
    regions = {record.rank: record.regions for record in capsule.metadata.workers}
    unit = next(u for u in descriptor.units if u.unit_id == capsule.unit_id)
    return any(stages_rank(op, sources.get(w.rank), w.payload, regions[w.rank]) for w in unit.workers)



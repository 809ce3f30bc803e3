"""Restore admission: every check a restore (or warm) makes before it starts anything.

In order: the descriptor (strict; the request's engine and snapshot driver), the platform (architecture;
the kernel with ``compatibility.kernel=exact``), the capsule manifest and every CRIU image in it against
its SHA-256, the host files the captured tree maps or holds open (``admission.files``), each rank's
weight source (native pack, or the pinned safetensors: :func:`weight_sources`), the GPU (driver floors,
model, checkpoint API), CRIU (version, ``criu check``), then the serving port: its lock (one operation per
port, :mod:`coldsnap.activation.operation_locks`) and every bind the restored tree will make
(:func:`coldsnap.activation.replica.plan_replica`). ``criu check`` and the CUDA probe run in threads while
the images are checked. What a driver admits on top (n610: the GPUs and their free memory; n580: the
template's placement) is the driver's (:mod:`coldsnap.activation.drivers`).
"""

from __future__ import annotations

import os
import platform
import stat
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

from coldsnap.activation.artifact_dir import ArtifactDir
from coldsnap.activation.early_restore import EarlyRestore, early_restore
from coldsnap.activation.operation_locks import hold_port
from coldsnap.activation.qualification import check_driver_floor, require_implemented_driver
from coldsnap.activation.ranks import rank_prefix
from coldsnap.activation.replica import Replica, plan_replica, refuse_gpus_for_a_cpu_artifact, serving_port
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
from coldsnap.snapshot.cuda_checkpoint import cached_probe_cuda
from coldsnap.snapshot.host_files import changed_host_files
from coldsnap.snapshot.thp import ThpError, host_thp_requested, thp_mode

__all__ = ["Admitted", "WeightSource", "admit", "launcher_stages", "weight_sources"]


@dataclass(frozen=True)
class Admitted:
    """What admission found: the artifact's descriptor and capsule, each rank's weight source, and this
    restore's place on the host."""

    descriptor: ArtifactDescriptor
    capsule: CapsuleManifest
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


def _admit_capsule(context: OperationContext, artifact: ArtifactDir, unit: UnitRecord
                   ) -> tuple[CapsuleManifest, dict[int, "WeightSource"]]:
    """The unit's capsule manifest and every image it lists, then each rank's weight source."""
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
    with timer.span(f"{op}.admission.payload") as span:
        sources = weight_sources(context, artifact, unit.workers, span)
    return capsule, sources


def admit(context: OperationContext, artifact: ArtifactDir) -> Admitted:
    """Every check restore can make without starting anything; raises OperationFailed with the first problem."""
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
        refuse_gpus_for_a_cpu_artifact(context, artifact, descriptor.platform.gpu_model)
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
    capsule, sources = _admit_capsule(context, artifact, unit := descriptor.units[index])
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
        port = serving_port(context, capsule)
        early = early_restore() if op == "restore" else None
        if early is not None and not early.matches(artifact.root, artifact_id(artifact.root), capsule.unit_id, port):
            early.abandon()  # (another artifact, unit or port than the entry's: its tree and lock go)
            early = None
            span["early_restore_declined"] = "the entry's tree was for another artifact, unit or port"
        # One operation per port from here on: a concurrent restore, warm or wake of it loses here (the entry's
        # early restore took it already: this process holds it)
        hold_port(context, port, str(artifact.root))
        if early is not None:  # planned, probed and being restored since the entry: admitted, it is this one's
            context.held.callback(early.lock.release)  # (the port's lock too: released when the operation ends)
            replica = early.replica
            span["early_restore"] = True
        else:
            replica = plan_replica(context, artifact, capsule, lambda: getattr(live_standby(artifact), "pid", None))
        span["serving_port"] = replica.serving_port
        if replica.generation.shift:
            span["port_shift"] = replica.generation.shift
    return Admitted(descriptor, capsule, sources, replica, early)


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


def weight_sources(context: OperationContext, artifact: ArtifactDir, workers: list[WorkerRecord],
                   span: dict[str, Any]) -> dict[int, WeightSource]:
    """Where each rank's weights will come from, every file verified (stat-bound record or full hash):
    ``native`` the payload pack, ``recovery`` the safetensors the capture pinned — by ``weights.mode``:
    ``native`` needs the pack, ``recovery`` the safetensors, ``auto`` takes the pack and falls back to
    the safetensors (with a warning) when the pack is missing or fails verification. The residual is
    needed either way."""
    mode = context.request.policy.weights.mode or "auto"

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



"""Restore: admit the artifact, bring the process tree back, hydrate, prove it right.

Admission (all of it before anything starts; ``--prepare-only`` stops after it): descriptor format,
architecture (and kernel with ``compatibility.kernel=exact``), CRIU version and ``criu check``, the
capsule manifest, the native packs (stat-bound record or full hash), the serving port free.
Activation: each rank's GPU weights are hydrated by the launcher into shareable chunks (or its
payload prefetched into the page cache) *while* CRIU restores the tree; GPU processes are
CUDA-restored (captured GPU UUIDs remapped onto this host's) and unlocked; every rank's agent then
maps its regions at their captured addresses, fills them and zeroes the KV cache, and the ranks
rebuild their NCCL communicators together through the activation's coordinator; the canary must give
the captured tokens exactly. Each step is a method of :class:`RestoreSequence` with its own span and
error code (:mod:`coldsnap.contracts.errors`); any failure — of any rank, at any step, an interrupt
included — goes through its one unwind, which kills what was restored and leaves the artifact as it was.
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
import stat
import threading
import time
from pathlib import Path
from typing import Any, Callable, ContextManager, Literal

from coldsnap.activation.artifact_dir import STATE_DIR_ENV, ArtifactDir, state_root
from coldsnap.activation.state import host_cache_dir
from coldsnap.activation.engine_process import ask_canary
from coldsnap.activation.gpu_memory import admit_gpu_memory
from coldsnap.activation.operation_locks import hold_port
from coldsnap.activation.ranks import ActivationCoordinator, call_every_rank, rank_prefix
from coldsnap.activation.replica import (GpuPlacement, Replica, gpu_placement, plan_replica, port_free,
                                        refuse_gpus_for_a_cpu_artifact, serving_port)
from coldsnap.snapshot.process_tree import kill_tree
from coldsnap.agent.client import AgentClient, AgentError, Lease
from coldsnap.agent.protocol import Resume, ResumeReply
from coldsnap.contracts.artifact import ArtifactDescriptor, FileRef, UnitRecord, WorkerRecord
from coldsnap.contracts.base import ContractError
from coldsnap.contracts.capsule import CapsuleManifest
from coldsnap.operation import OperationContext, OperationFailed, OperationOutcome, step
from coldsnap.payload.errors import PackError
from coldsnap.progress import PhaseProgress
from coldsnap.payload.validation import verify_file, verify_files
from coldsnap.activation.qualification import check_driver_floor, require_implemented_driver
from coldsnap.activation.staging import WeightStager
from coldsnap.host import nvidia_kernel_driver
from coldsnap.snapshot.criu import MINIMUM_VERSION, CriuError, CriuSnapshotter, SnapshotOptions, checked_criu
from coldsnap.snapshot.criu_images import ImageFormatError
from coldsnap.snapshot.host_files import changed_host_files
from coldsnap.snapshot.replica import probe_path_sockets, replica_images
from coldsnap.snapshot.cuda_checkpoint import CudaCheckpointError, TreeCheckpoint, cached_probe_cuda, start_cuda_in_background
from coldsnap.snapshot.thp import ThpError, host_thp_requested, huge_pages_for_the_fill, thp_mode

__all__ = ["restore", "admit", "port_free", "serving_port", "gpu_placement"]


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


def admit(context: OperationContext, artifact: ArtifactDir
          ) -> tuple[ArtifactDescriptor, CapsuleManifest, dict[int, "WeightSource"], "Replica"]:
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
        if len(descriptor.units) != 1:
            raise OperationFailed("admission.topology", "this build restores one launch unit")
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
    capsule, sources = _admit_capsule(context, artifact, unit := descriptor.units[0])
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
        # One operation per port from here on: a concurrent restore, warm or wake of it loses here
        hold_port(context, serving_port(context, capsule), str(artifact.root))
        replica = plan_replica(context, artifact, capsule)
        span["serving_port"] = replica.serving_port
        if replica.generation.shift:
            span["port_shift"] = replica.generation.shift
    return descriptor, capsule, sources, replica


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
                check(Path(pinned.path), pinned.sha256, artifact.external_record_dir(Path(pinned.path)))
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


def restore(context: OperationContext, artifact: ArtifactDir | None = None) -> OperationOutcome:
    """``artifact``: the request's by default; a capture's check restore passes its pending one."""
    artifact = artifact or ArtifactDir(Path(context.request.artifact))
    descriptor, capsule, sources, replica = admit(context, artifact)
    placement = None
    if descriptor.snapshot_driver == "n580":  # what the template will be handed, checked before anything starts
        from coldsnap.activation.n580 import TemplateRestore, template_placement

        with context.timer.span("restore.admission.placement"):
            placement = template_placement(context, artifact, descriptor, capsule, sources, replica.controls[0])
    else:
        with context.timer.span("restore.admission.gpus"):
            gpus = gpu_placement(context, artifact, capsule)
        with context.timer.span("restore.admission.gpu_memory") as span:
            admit_gpu_memory(context, capsule, gpus, launcher_stages(descriptor, capsule, sources), span)
    if context.request.prepare_only:
        context.progress("admission passed; --prepare-only: nothing started")
        return OperationOutcome(artifact=str(artifact.root))
    if placement is not None:
        return TemplateRestore(context, artifact, descriptor, capsule, sources, replica, placement).run()
    return RestoreSequence(context, artifact, descriptor, capsule, sources, replica, gpus=gpus).run()


def launcher_stages(descriptor: ArtifactDescriptor, capsule: CapsuleManifest, sources: dict[int, "WeightSource"]) -> bool:
    """Whether a restore's launcher will hydrate some rank's weights itself (a CUDA context of its own on
    that GPU): a native source and regions it can stage (:meth:`RestoreSequence.restore_tree`)."""
    regions = {record.rank: record.regions for record in capsule.metadata.workers}
    return any(sources.get(w.rank) == "native" and w.payload is not None and WeightStager.stageable(regions[w.rank])
               for w in descriptor.units[0].workers)


class RestoreSequence:
    """The steps of one admitted restore, each its own method, span and error code (:meth:`step`), and
    one :meth:`unwind` for every failure: staging cancelled, handed-over memory closed, whatever CRIU
    restored killed, the lease dropped. The artifact is only read.

    A warm standby runs the same steps in two operations (:mod:`coldsnap.activation.standby`):
    ``warm`` up to the CUDA restore, then parks the ranks (:meth:`run_warm`); ``wake`` takes the
    parked tree from there (:meth:`run_wake`). Spans are named after the operation (``warm.criu_restore``);
    error codes after the step (``restore.criu``)."""

    def __init__(self, context: OperationContext, artifact: ArtifactDir, descriptor: ArtifactDescriptor,
                 capsule: CapsuleManifest, sources: dict[int, WeightSource], replica: Replica | None,
                 restored_pid: int | None = None, controls: list[str] | None = None,
                 gpus: GpuPlacement | None = None):
        """``replica``: this restore's place (admission's); a standby's wake has none — it is handed the
        parked tree's ``restored_pid`` and agent ``controls`` instead."""
        self.context = context
        self.op = context.request.operation
        self.timer = context.timer
        self.artifact = artifact
        self.descriptor = descriptor
        self.unit = descriptor.units[0]
        self.workers = sorted(self.unit.workers, key=lambda w: w.rank)
        self.metadata = capsule.metadata
        self.replica = replica
        self.serving_port = replica.serving_port if replica is not None else capsule.metadata.serving_port
        self.records = {record.rank: record for record in self.metadata.workers}
        self.controls = (dict(enumerate(controls)) if controls is not None else replica.controls if replica is not None
                         else {rank: record.control for rank, record in self.records.items()})
        self.gpus = gpus
        self.host_pids: dict[int, int] = {}  # captured pid → its pid on this host (a replica's namespace)
        self.sources = sources  # rank → where admission found its weights
        self.stagers: dict[int, WeightStager] = {}
        self.prefetch_errors: list[BaseException] = []
        self.warmer: threading.Thread | None = None
        self.restored_pid = restored_pid  # what unwind kills: set once CRIU restored it (a standby's from the start)
        self.lease: Lease | None = None
        self.handed_over: list[int] = []  # descriptors of staged memory, closed once sent (or on failure)
        self.staged: dict[int, tuple[dict[str, int], dict[str, Any]]] = {}  # rank → (adopted chunks, staging stats)
        self.fds_by_rank: dict[int, list[int]] = {}

    def step(self, span: str, code: str) -> ContextManager[dict[str, str | int | bool]]:
        """One step (:func:`coldsnap.operation.step`): a failure of what it calls (CRIU, CUDA, an agent,
        the OS) is reported with its code, the exception's type first."""
        return step(self.timer, span, code, (CriuError, CudaCheckpointError, AgentError, OSError, ContractError),
                    lambda exc: f"{type(exc).__name__}: {exc}")

    def run(self) -> OperationOutcome:
        """restore: the tree from nothing to serving."""
        return self._run(self.restore_tree, self.take_lease, self.restore_cuda, self.collect_staged_weights,
                         self.resume_ranks, self.check_canary)

    def run_warm(self, park: Callable[["RestoreSequence"], None]) -> OperationOutcome:
        """warm: the tree restored (CUDA included) and parked by ``park``, not serving; the weights' pack
        read into the page cache meanwhile for the wake."""
        return self._run(self.restore_tree, self.take_lease, self.restore_cuda, self.collect_staged_weights,
                         functools.partial(park, self))

    def run_wake(self) -> OperationOutcome:
        """wake: a parked standby (already restored) hydrated, resumed and proven by the canary."""
        return self._run(self.take_lease, self.resume_ranks, self.check_canary)

    def _run(self, *steps: Callable[[], None]) -> OperationOutcome:
        try:
            for run_step in steps:
                run_step()
            assert self.lease is not None
            self.lease.release()  # the process is on its own now
        except BaseException:
            self.unwind()
            raise
        warnings = [f"prefetch failed: {e}" for e in self.prefetch_errors]
        self.context.progress(f"{'warm standby' if self.op == 'warm' else 'ready'}: pid {self.restored_pid}, port "
                              f"{self.serving_port}{'' if self.op == 'warm' else ', canary matched'}")
        return OperationOutcome(artifact=str(self.artifact.root), warnings=warnings)

    def pack(self, ref: FileRef | None) -> Path | None:
        return self.artifact.root / ref.path if ref is not None else None

    def restore_tree(self) -> None:
        """CRIU restores the tree; meanwhile each rank's GPU weights are hydrated by this launcher into
        shareable chunks (handed over at resume), or else its payload is read into the page cache."""
        # (a standby's weights are hydrated at wake, by its own agents: only its pack is read ahead)
        for w in self.workers if self.op == "restore" else []:
            regions = self.records[w.rank].regions
            if self.sources[w.rank] == "native" and w.payload is not None and WeightStager.stageable(regions):
                self.stagers[w.rank] = WeightStager(regions, self.artifact.root / w.payload.path, self.pack(w.residual),
                                                    w.layout_digest, self.timer.now_ns,
                                                    self.gpus.launcher_ordinals if self.gpus is not None else {})
        with self.step(f"{self.op}.criu_restore", "restore.criu") as span:
            state_dir = self.state_dir()
            if self.metadata.gpu_pids:  # the checkpoint API ready when the tree is (admission used a cached probe)
                start_cuda_in_background()
            for stager in self.stagers.values():
                stager.start()
            self.warmer = threading.Thread(target=self._prefetch, name="coldsnap-prefetch", daemon=True)
            self.warmer.start()
            span["state_dir"] = str(state_dir)
            images = self.replica_images(state_dir)
            options = SnapshotOptions(tcp=self.metadata.criu_tcp)  # as dumped
            with contextlib.ExitStack() as window:
                if host_thp_requested():  # the operator's choice (--host-thp), checked at admission
                    try:
                        span["host_thp_before"] = window.enter_context(huge_pages_for_the_fill(state_root()))
                    except ThpError as exc:
                        raise OperationFailed("admission.host_thp", str(exc)) from None
                result = CriuSnapshotter(options=options).restore(images, state_dir, self.artifact.root, own_images=True)
            self.restored_pid = span["pid"] = result.pid
            span["thp_fill"] = result.thp_fill  # (CRIU fills huge pages where its build and the host's mode allow)
            span["fill_threads"] = result.fill_threads  # (helpers per process, where CRIU's build has them)
            self.host_pids = result.host_pids
        self.context.progress(f"process tree restored (pid {result.pid}) in {result.seconds:.2f} s")

    def replica_images(self, state_dir: Path) -> Path:
        """The images CRIU restores this replica from: the capture's, with ``files.img`` rewritten for its
        ports and sockets in ``state_dir`` (the artifact is only read)."""
        assert self.replica is not None
        # A previous incarnation's socket files at this replica's paths (nothing listens: admission checked)
        for stale in probe_path_sockets([n for n in self.replica.unix_names.values() if n.startswith(b"/")])[1]:
            stale.unlink(missing_ok=True)
        return replica_images(self.artifact.images(self.unit.unit_id), state_dir / "images",
                              self.replica.generation, self.replica.unix_names,
                              f".{self.replica.name}".encode())

    def state_dir(self) -> Path:
        """This replica's state directory under the artifact's, made if needed (``restore.state_dir`` when
        it cannot be): restores on other ports share nothing in it."""
        assert self.replica is not None
        try:
            path = self.artifact.state_dir() / self.replica.name
            path.mkdir(exist_ok=True, mode=0o700)
            return path
        except OSError as exc:
            raise OperationFailed("restore.state_dir", f"cannot make the state directory under {state_root()}: "
                                  f"{exc} (choose one with --state-dir or {STATE_DIR_ENV})") from None

    def _prefetch(self) -> None:
        from coldsnap.hydrate import prefetch_file

        try:
            for w in self.workers:
                if self.sources[w.rank] == "native" and w.payload is not None and w.rank not in self.stagers:
                    prefetch_file(self.artifact.root / w.payload.path)
                elif self.sources[w.rank] == "recovery" and w.recovery:
                    for pinned in w.recovery:
                        prefetch_file(Path(pinned.path))
        except BaseException as exc:  # only a hint: hydration still reads the file itself
            self.prefetch_errors.append(exc)

    def take_lease(self) -> None:
        """Until the canary matches, the restored tree dies with this launcher."""
        with self.step(f"{self.op}.lease", "restore.lease"):
            self.lease = Lease([self.controls[w.rank] for w in self.workers])

    def restore_cuda(self) -> None:
        gpu_pids = list(self.metadata.gpu_pids)
        if not gpu_pids:
            return
        with self.step(f"{self.op}.cuda_restore", "restore.cuda") as span:
            # The placed GPUs, by UUID; a replica's processes by their pids on this host.
            pairs = self.gpus.pairs if self.gpus is not None else []
            TreeCheckpoint().restore([self.host_pid(pid) for pid in gpu_pids], pairs)
            span["processes"] = len(gpu_pids)
            if pairs:
                span["gpus_remapped"] = ",".join(f"{old}->{new}" for old, new in pairs)

    def host_pid(self, captured: int) -> int:
        return self.host_pids.get(captured, captured)

    def collect_staged_weights(self) -> None:
        """The chunks each stager hydrated, exported for its rank's resume. A failed staging is a warning:
        that rank's agent hydrates from the pack itself."""
        if self.stagers:
            with self.timer.span(f"{self.op}.stage_wait"):
                staged = {rank: stager.join() for rank, stager in self.stagers.items()}
            for rank, stager in self.stagers.items():
                self.timer.add_timeline_span(f"{self.op}.stage_weights" + (f".rank{rank}" if rank else ""),
                                             stager.started_ns, stager.finished_ns,
                                             **{k: v for k, v in stager.stats.items() if isinstance(v, (int, bool, str))})
                if staged[rank]:
                    adopted, self.fds_by_rank[rank] = stager.export()
                    self.handed_over += self.fds_by_rank[rank]
                    self.staged[rank] = (adopted, stager.stats)
                else:
                    self.context.warn(f"rank {rank}: staging the weights failed ({stager.error}); "
                                      "the process hydrates them itself")
        if self.warmer is not None:
            self.warmer.join()

    def _resume_command(self, w: Any, coordinator: ActivationCoordinator) -> Resume:
        if w.rank in self.staged:  # the memory rides along with the command
            adopted, stats = self.staged[w.rank]
            return Resume(layout_digest=w.layout_digest, coordinator=coordinator.command_field(), adopted=adopted,
                          staged=stats)
        if self.sources[w.rank] == "recovery":
            plan = self._recovery_plan(w)
            return Resume(layout_digest=w.layout_digest, coordinator=coordinator.command_field(),
                          safetensors=[pinned.path for pinned in w.recovery or []], residual=str(self.pack(w.residual)),
                          recovery_plan=plan[0] if plan else None, recovery_gap=plan[1] if plan else None)
        return Resume(layout_digest=w.layout_digest, coordinator=coordinator.command_field(),
                      payload=str(self.pack(w.payload)) if w.payload else None, residual=str(self.pack(w.residual)))

    def _recovery_plan(self, w: WorkerRecord) -> tuple[str, str] | None:
        """The rank's recovery plan and gap pack, verified (stat-bound records: no hashing when unchanged);
        None — the engine's loaders replay the safetensors, with a warning — when it has none or they fail."""
        if w.recovery_plan is None or w.recovery_gap is None:
            return None
        paths = []
        try:
            for ref in (w.recovery_plan, w.recovery_gap):
                path = self.artifact.root / ref.path
                verify_file(path, ref.sha256, self.artifact.record_dir(path))
                paths.append(str(path))
        except (PackError, OSError) as exc:
            self.context.warn(f"rank {w.rank}: the recovery plan is unusable ({exc}); its engine's loaders replay "
                              "the safetensors instead (slower)")
            return None
        return paths[0], paths[1]

    def resume_ranks(self) -> None:
        """Every rank at once: map and fill its regions, zero the KV cache, rebuild NCCL, recapture graphs."""
        with self.step(f"{self.op}.resume", "restore.resume") as span, \
                ActivationCoordinator(len(self.workers)) as coordinator:
            bars = PhaseProgress(f"coldsnap {self.op} [{self.descriptor.engine}/{self.descriptor.snapshot_driver}]: ")

            def resume(w: Any) -> ResumeReply:
                return AgentClient(self.controls[w.rank]).resume(
                    self._resume_command(w, coordinator), on_progress=bars if w.rank == 0 else None,
                    fds=self.fds_by_rank.get(w.rank, []))

            try:
                resumed_ranks = call_every_rank([(w.rank, functools.partial(resume, w)) for w in self.workers], coordinator)
            finally:
                bars.finish()
                released = time.monotonic_ns()
                self._close_handed_over()
                for stager in self.stagers.values():
                    stager.release()
                span["release_staged_ns"] = time.monotonic_ns() - released  # (the launcher's mappings)
            for rank, resumed in enumerate(resumed_ranks):
                prefix = rank_prefix(rank)
                hydrated = resumed.hydrate
                span.update({f"{prefix}bytes": hydrated.bytes, f"{prefix}source": hydrated.source,
                             f"{prefix}staged": hydrated.staged, f"{prefix}pinned": hydrated.stats.get("pinned") is True})
                if hydrated.source == "recovery":  # by the recovery plan, or through the engine's loaders
                    span[f"{prefix}planned"] = hydrated.stats.get("planned") is True
                span.update({f"{prefix}{step}_ns": int(seconds * 1e9) for step, seconds in resumed.seconds.items()})
                if resumed.graphs_recaptured:
                    span[f"{prefix}graphs_recaptured"] = ",".join(resumed.graphs_recaptured)

    def check_canary(self) -> None:
        """The restored server must answer as the captured one did. Where capture recorded the prefill's
        predictions, one prefill checks them at every prompt position plus the first generated tokens;
        else every token and the text."""
        record = self.descriptor.canary
        quick_tokens = record.restore_tokens if record.prompt_argmax is not None else None
        quick = quick_tokens is not None
        tokens = quick_tokens or len(record.token_ids) or 16
        with self.step(f"{self.op}.canary", "restore.canary") as span:
            # HTTP errors are OSErrors: the restored server did not answer right
            canary = ask_canary(self.serving_port, record.prompt, tokens, prompt_argmax=quick)
            span["tokens"] = len(canary.token_ids)
            span["checked"] = (f"prompt argmax at {len(record.prompt_argmax or [])} positions + {tokens} tokens" if quick
                               else f"{tokens} tokens and the text")
        if quick:
            if canary.prompt_argmax != record.prompt_argmax or canary.token_ids != record.token_ids[:tokens]:
                raise OperationFailed("restore.canary", f"canary predicted {canary.prompt_argmax} over the prompt and "
                                      f"generated {canary.token_ids}; captured {record.prompt_argmax} and "
                                      f"{record.token_ids[:tokens]}")
        elif canary.token_ids != record.token_ids or canary.text != record.expected_response:
            raise OperationFailed("restore.canary", f"canary answered {canary.text!r}, captured {record.expected_response!r}")

    def _close_handed_over(self) -> None:
        for fd in self.handed_over:
            os.close(fd)
        self.handed_over.clear()

    def unwind(self) -> None:
        """After any failure (an interrupt included): nothing this restore started survives it."""
        for stager in self.stagers.values():
            stager.cancel()
        for stager in self.stagers.values():
            stager.join()
            stager.release()
        self._close_handed_over()
        if self.restored_pid is not None:
            kill_tree(self.restored_pid)
        if self.lease is not None:
            self.lease.close()

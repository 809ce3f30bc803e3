"""Restore: admit the artifact, bring the process tree back, hydrate, prove it right.

Admission (all of it before anything starts; ``--prepare-only`` stops after it): descriptor format,
architecture (and kernel with ``compatibility.kernel=exact``), CRIU version and ``criu check``, the
capsule manifest, the native packs (stat-bound record or full hash), the serving port free.
Activation: each rank's GPU weights are hydrated by the launcher into shareable chunks (or its
payload prefetched into the page cache) *while* CRIU restores the tree; GPU processes are
CUDA-restored (captured GPU UUIDs remapped onto this host's) and unlocked; every rank's agent then
maps its regions at their captured addresses, fills them and zeroes the KV cache, and the ranks
rebuild their NCCL communicators together through the activation's coordinator; the canary must give
the captured tokens exactly. Any failure — of any rank — kills what was restored and leaves the
artifact as it was.
"""

from __future__ import annotations

import os
import platform
import socket
import threading
from pathlib import Path
from typing import Any

from coldsnap.activation.artifact_dir import STATE_DIR_ENV, ArtifactDir, state_root
from coldsnap.activation.engine_process import ask_canary
from coldsnap.activation.ranks import ActivationCoordinator, call_every_rank, rank_prefix
from coldsnap.snapshot.process_tree import kill_tree
from coldsnap.agent.client import AgentClient, AgentError, Lease
from coldsnap.agent.protocol import Resume, ResumeReply
from coldsnap.contracts.artifact import ArtifactDescriptor
from coldsnap.contracts.base import ContractError
from coldsnap.contracts.capsule import CapsuleManifest
from coldsnap.operation import OperationContext, OperationFailed, OperationOutcome
from coldsnap.native import probe_cuda
from coldsnap.payload.errors import PackError
from coldsnap.progress import PhaseProgress
from coldsnap.payload.validation import verify_file
from coldsnap.activation.qualification import check_driver_floor, require_implemented_driver
from coldsnap.activation.staging import WeightStager
from coldsnap.doctor import nvidia_kernel_driver
from coldsnap.snapshot.criu import MINIMUM_VERSION, Criu, CriuError, CriuSnapshotter, SnapshotOptions
from coldsnap.snapshot.cuda_checkpoint import CudaCheckpointError, TreeCheckpoint, cuda_devices

__all__ = ["restore", "admit", "port_free"]


def port_free(port: int) -> bool:
    """Whether a listener could bind ``port`` on the loopback address now."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _admit_gpu(context: OperationContext, descriptor: ArtifactDescriptor) -> None:
    """The snapshot driver's NVIDIA floor (always), the captured floor (unless relaxed), GPU model and CC."""
    captured = descriptor.platform
    driver = nvidia_kernel_driver()
    probe = probe_cuda()  # one probe: devices and the checkpoint API
    devices = probe["devices"] if probe["available"] else []
    if driver is None or not devices:
        raise OperationFailed("admission.cuda", "the artifact was captured on a GPU; this host has no usable NVIDIA GPU")
    major = int(driver.split(".")[0])
    check_driver_floor(context, descriptor.snapshot_driver, driver, "admission.driver_floor")
    if context.request.policy.compatibility.enforce_captured_driver_floor and major < (captured.nvidia_driver_floor or 0):
        raise OperationFailed("admission.driver_floor", f"captured on NVIDIA driver {captured.nvidia_driver}, this host "
                              f"has {driver} (set compatibility.enforce_captured_driver_floor=false to allow)")
    device = devices[0]
    if (device["name"], device["compute_capability"]) != (captured.gpu_model, captured.compute_capability):
        raise OperationFailed("admission.gpu", f"captured on {captured.gpu_model} (cc {captured.compute_capability}), "
                              f"this host has {device['name']} (cc {device['compute_capability']})")
    if not probe["checkpoint_api"]:
        raise OperationFailed("admission.cuda", "this driver has no CUDA checkpoint API")


def admit(context: OperationContext, artifact: ArtifactDir) -> tuple[ArtifactDescriptor, CapsuleManifest]:
    """Every check restore can make without starting anything; raises OperationFailed with the first problem."""
    timer = context.timer
    with timer.span("restore.admission.descriptor"):
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
    # `criu check` (~0.1 s) runs while the platform is probed (~0.1 s, CUDA init); its span is the wait.
    criu_checked: dict[str, Any] = {}

    def check_criu() -> None:
        try:
            criu = Criu()
            criu_checked["version"], criu_checked["check"] = criu.version(), criu.check()
        except CriuError as exc:
            criu_checked["error"] = exc

    checker = threading.Thread(target=check_criu, name="coldsnap-criu-check", daemon=True)
    checker.start()
    with timer.span("restore.admission.platform"):
        if descriptor.platform.arch != platform.machine():
            raise OperationFailed("admission.platform", f"captured on {descriptor.platform.arch}, this is {platform.machine()}")
        if context.request.policy.compatibility.kernel == "exact" and descriptor.platform.kernel != platform.release():
            raise OperationFailed("admission.kernel", f"captured on kernel {descriptor.platform.kernel}, this is {platform.release()}")
        if descriptor.platform.nvidia_driver is not None:
            _admit_gpu(context, descriptor)
    with timer.span("restore.admission.criu"):
        checker.join()
        if "error" in criu_checked:
            raise OperationFailed("admission.criu", str(criu_checked["error"])) from None
        version, check = criu_checked["version"], criu_checked["check"]
        if version[:2] < MINIMUM_VERSION:
            raise OperationFailed("admission.criu", f"CRIU {'.'.join(map(str, version))} is too old (need 4.2+)")
        if not check.ok:
            raise OperationFailed("admission.criu", f"criu check failed: {check.output.splitlines()[-1:] or ''}")
    unit = descriptor.units[0]
    with timer.span("restore.admission.capsule") as span:
        capsule_path = artifact.capsule_path(unit.unit_id)
        try:  # the manifest itself first: the descriptor binds its digest
            verify_file(capsule_path, unit.capsule.sha256, artifact.record_dir(capsule_path))
            capsule = artifact.read_capsule(unit.unit_id)
        except (PackError, OSError) as exc:
            raise OperationFailed("admission.capsule", f"capsule of {unit.unit_id}: {exc}") from None
        except ContractError as exc:  # an older or newer coldsnap's manifest, named as such
            raise OperationFailed("admission.capsule", f"capsule of {unit.unit_id} cannot be read by this coldsnap: "
                                  f"{'; '.join(exc.problems)}") from None
        images = artifact.images(unit.unit_id)
        verified_by: dict[str, int] = {}
        for entry in capsule.files:
            path = images / entry.path
            try:
                if not path.is_file() or path.stat().st_size != entry.size_bytes:
                    raise OperationFailed("admission.capsule", f"capsule file {entry.path} is missing or changed size")
                # Every image against the capsule's digest before CRIU reads it: a same-size corruption
                # must stop here, not restore garbage. Unchanged files are trusted from their record.
                method = verify_file(path, entry.sha256, artifact.record_dir(path)).method
            except (PackError, OSError) as exc:
                raise OperationFailed("admission.capsule", f"capsule file {entry.path}: {exc}") from None
            verified_by[method] = verified_by.get(method, 0) + 1
        span["images_verified_by"] = ",".join(f"{m}:{n}" for m, n in sorted(verified_by.items()))
        recorded = sorted(w.rank for w in capsule.metadata.workers)
        if recorded != sorted(w.rank for w in unit.workers):
            raise OperationFailed("admission.capsule", f"capsule of {unit.unit_id} records ranks {recorded}, the "
                                  f"artifact {sorted(w.rank for w in unit.workers)}")
    with timer.span("restore.admission.payload") as span:
        for worker in unit.workers:
            for ref in (worker.payload, worker.residual):
                if ref is None:
                    continue
                try:
                    verdict = verify_file(artifact.root / ref.path, ref.sha256, artifact.record_dir(artifact.root / ref.path))
                except (PackError, OSError) as exc:
                    raise OperationFailed("admission.payload", str(exc)) from None
                span[f"{Path(ref.path).suffix[1:]}_verified_by"] = verdict.method
    with timer.span("restore.admission.port"):
        port = capsule.metadata.serving_port
        if not port_free(port):
            raise OperationFailed("admission.port", f"serving port {port} is taken")
    return descriptor, capsule


def restore(context: OperationContext) -> OperationOutcome:
    artifact = ArtifactDir(Path(context.request.artifact))
    descriptor, capsule = admit(context, artifact)
    if context.request.prepare_only:
        context.progress("admission passed; --prepare-only: nothing started")
        return OperationOutcome(artifact=str(artifact.root))
    timer = context.timer
    unit = descriptor.units[0]
    workers = sorted(unit.workers, key=lambda w: w.rank)
    metadata = capsule.metadata
    records = {record.rank: record for record in metadata.workers}

    def pack(ref) -> Path | None:
        return artifact.root / ref.path if ref is not None else None

    # GPU weights: hydrated by the launcher during CRIU + CUDA restore and handed over at resume;
    # otherwise the agent hydrates, and the page cache is warmed meanwhile.
    stagers = {}
    for w in workers:
        regions = records[w.rank].regions
        if w.payload is not None and WeightStager.stageable(regions):
            stagers[w.rank] = WeightStager(regions, pack(w.payload), pack(w.residual), w.layout_digest, timer.now_ns)
    prefetch_error: list[BaseException] = []

    def prefetch() -> None:
        from coldsnap.hydrate import prefetch_file

        try:
            for w in workers:
                if w.payload is not None and w.rank not in stagers:
                    prefetch_file(pack(w.payload))
        except BaseException as exc:  # only a hint: hydration still reads the file itself
            prefetch_error.append(exc)

    restored_pid: int | None = None
    lease: Lease | None = None
    handed_over: list[int] = []
    try:
        with timer.span("restore.criu_restore") as span:
            for stager in stagers.values():
                stager.start()
            warmer = threading.Thread(target=prefetch, name="coldsnap-prefetch", daemon=True)
            warmer.start()
            options = SnapshotOptions(tcp=metadata.criu_tcp)  # as dumped
            try:
                state_dir = artifact.state_dir()
            except OSError as exc:
                raise OperationFailed("restore.state_dir", f"cannot make the state directory under {state_root()}: {exc} "
                                      f"(choose one with --state-dir or {STATE_DIR_ENV})") from None
            span["state_dir"] = str(state_dir)
            result = CriuSnapshotter(options=options).restore(artifact.images(unit.unit_id), state_dir, artifact.root)
            restored_pid = result.pid
            span["pid"] = result.pid
        with timer.span("restore.lease"):
            try:  # until the canary matches, the restored tree dies with this launcher
                lease = Lease([records[w.rank].control for w in workers])
            except (AgentError, OSError) as exc:
                raise OperationFailed("restore.lease", f"the restored agents did not take this launcher's lease: {exc}") from None
        gpu_pids = list(metadata.gpu_pids)
        if gpu_pids:
            with timer.span("restore.cuda_restore") as span:
                # Same ordinal, maybe another GPU: remap the captured UUIDs onto this host's.
                current = [d["uuid"] for d in cuda_devices()]
                pairs = [(old, new) for old, new in zip(metadata.gpu_uuids, current) if old != new]
                try:
                    TreeCheckpoint().restore(gpu_pids, pairs)
                except CudaCheckpointError as exc:
                    raise OperationFailed("restore.cuda", str(exc)) from None
                span["processes"] = len(gpu_pids)
        commands: dict[int, dict[str, Any]] = {}
        fds_by_rank: dict[int, list[int]] = {}
        if stagers:
            with timer.span("restore.stage_wait"):
                staged = {rank: stager.join() for rank, stager in stagers.items()}
            for rank, stager in stagers.items():
                timer.add_timeline_span("restore.stage_weights" + (f".rank{rank}" if rank else ""), stager.started_ns,
                                        stager.finished_ns,
                                        **{k: v for k, v in stager.stats.items() if isinstance(v, (int, bool, str))})
                if staged[rank]:
                    adopted, fds_by_rank[rank] = stager.export()
                    handed_over += fds_by_rank[rank]
                    commands[rank] = {"adopted": adopted, "staged": stager.stats}
                else:
                    context.warn(f"rank {rank}: staging the weights failed ({stager.error}); the process hydrates them itself")
        warmer.join()
        context.progress(f"process tree restored (pid {result.pid}) in {result.seconds:.2f} s")
        with timer.span("restore.resume") as span, ActivationCoordinator(len(workers)) as coordinator:
            bars = PhaseProgress(f"coldsnap restore [{descriptor.engine}/{descriptor.snapshot_driver}]: ")

            def resume(w) -> ResumeReply:
                weights = commands.get(w.rank) or {"payload": str(pack(w.payload)) if w.payload else None,
                                                   "residual": str(pack(w.residual))}
                command = Resume(layout_digest=w.layout_digest, coordinator=coordinator.command_field(), **weights)
                return AgentClient(records[w.rank].control).resume(
                    command, on_progress=bars if w.rank == 0 else None, fds=fds_by_rank.get(w.rank, []))

            try:
                resumed_ranks = call_every_rank([(w.rank, lambda w=w: resume(w)) for w in workers], coordinator)
            finally:
                bars.finish()
                for fd in handed_over:
                    os.close(fd)
                handed_over.clear()
                for stager in stagers.values():
                    stager.release()
            for rank, resumed in enumerate(resumed_ranks):
                prefix = rank_prefix(rank)
                hydrated = resumed.hydrate
                span.update({f"{prefix}bytes": hydrated.bytes, f"{prefix}source": hydrated.source,
                             f"{prefix}staged": hydrated.staged})
                span.update({f"{prefix}{step}_ns": int(seconds * 1e9) for step, seconds in resumed.seconds.items()})
                if resumed.graphs_recaptured:
                    span[f"{prefix}graphs_recaptured"] = ",".join(resumed.graphs_recaptured)
        with timer.span("restore.canary") as span:
            try:
                canary = ask_canary(metadata.serving_port, descriptor.canary.prompt, len(descriptor.canary.token_ids) or 16)
            except OSError as exc:  # HTTP errors included: the restored server did not answer right
                raise OperationFailed("restore.canary", f"the canary request failed: {exc}") from None
            span["tokens"] = len(canary.token_ids)
        if canary.token_ids != descriptor.canary.token_ids or canary.text != descriptor.canary.expected_response:
            raise OperationFailed("restore.canary", f"canary answered {canary.text!r}, captured {descriptor.canary.expected_response!r}")
        lease.release()
    except BaseException as exc:
        for stager in stagers.values():
            stager.cancel()
        for stager in stagers.values():
            stager.join()
            stager.release()
        for fd in handed_over:
            os.close(fd)
        if restored_pid is not None:
            kill_tree(restored_pid)
        if lease is not None:
            lease.close()
        if isinstance(exc, CriuError):
            raise OperationFailed("restore.criu", str(exc)) from None
        if isinstance(exc, (AgentError, OSError)):
            raise OperationFailed("restore.resume", f"{type(exc).__name__}: {exc}") from None
        raise
    warnings = [f"prefetch failed: {e}" for e in prefetch_error]
    context.progress(f"ready: pid {restored_pid}, port {metadata.serving_port}, canary matched")
    return OperationOutcome(artifact=str(artifact.root), warnings=warnings)

"""Restore: admit the artifact, bring the process tree back, hydrate, prove it right.

Admission (all of it before anything starts; ``--prepare-only`` stops after it): descriptor format,
architecture (and kernel with ``compatibility.kernel=exact``), CRIU version and ``criu check``, the
capsule manifest, the native packs (stat-bound record or full hash), the serving port free.
Activation: the payload is prefetched into the page cache *while* CRIU restores the tree; GPU
processes are CUDA-restored (captured GPU UUIDs remapped onto this host's) and unlocked; the agent
then maps the regions at their captured addresses, hydrates them and zeroes the KV cache; the canary
must give the captured tokens exactly. Any failure kills what was restored and leaves the artifact as
it was.
"""

from __future__ import annotations

import os
import platform
import socket
import threading
from pathlib import Path
from typing import Any

from coldsnap.activation.artifact_dir import ArtifactDir
from coldsnap.activation.engine_process import ask_canary
from coldsnap.snapshot.process_tree import kill_tree
from coldsnap.agent.server import AgentError, request
from coldsnap.contracts.artifact import ArtifactDescriptor
from coldsnap.contracts.base import ContractError
from coldsnap.operation import OperationContext, OperationFailed, OperationOutcome
from coldsnap.native import probe_cuda
from coldsnap.payload.errors import PackError
from coldsnap.progress import PhaseProgress
from coldsnap.payload.validation import verify_file
from coldsnap.activation.qualification import check_driver_floor
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


def admit(context: OperationContext, artifact: ArtifactDir) -> tuple[ArtifactDescriptor, dict[str, Any]]:
    """Every check restore can make without starting anything; raises OperationFailed with the first problem."""
    timer = context.timer
    with timer.span("restore.admission.descriptor"):
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
    with timer.span("restore.admission.capsule"):
        try:
            capsule = artifact.read_capsule(unit.unit_id)
            images = artifact.images(unit.unit_id)
            for entry in capsule["files"]:
                path = images / entry["path"]
                if not path.is_file() or path.stat().st_size != entry["size_bytes"]:
                    raise OperationFailed("admission.capsule", f"capsule file {entry['path']} is missing or changed size")
        except (OSError, ValueError, KeyError) as exc:
            raise OperationFailed("admission.capsule", f"capsule of {unit.unit_id} is unreadable: {exc}") from None
    with timer.span("restore.admission.payload") as span:
        for worker in unit.workers:
            for ref in (worker.payload, worker.residual):
                if ref is None:
                    continue
                try:
                    verdict = verify_file(artifact.root / ref.path, ref.sha256)
                except (PackError, OSError) as exc:
                    raise OperationFailed("admission.payload", str(exc)) from None
                span[f"{Path(ref.path).suffix[1:]}_verified_by"] = verdict.method
    with timer.span("restore.admission.port"):
        port = capsule["metadata"]["serving_port"]
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
    worker = unit.workers[0]
    metadata = capsule["metadata"]
    payload = artifact.root / worker.payload.path if worker.payload else None

    residual = artifact.root / worker.residual.path
    regions = metadata.get("regions") or {}
    # GPU weights: hydrated by the launcher during CRIU + CUDA restore and handed over at resume;
    # otherwise the agent hydrates, and the page cache is warmed meanwhile.
    stager = (WeightStager(regions, payload, residual, worker.layout_digest, timer.now_ns)
              if payload is not None and WeightStager.stageable(regions) else None)
    prefetch_error: list[BaseException] = []

    def prefetch() -> None:
        from coldsnap.hydrate import prefetch_file

        try:
            if payload is not None:
                prefetch_file(payload)
        except BaseException as exc:  # only a hint: hydration still reads the file itself
            prefetch_error.append(exc)

    restored_pid: int | None = None
    try:
        with timer.span("restore.criu_restore") as span:
            if stager is not None:
                stager.start()
                warmer = None
            else:
                warmer = threading.Thread(target=prefetch, name="coldsnap-prefetch", daemon=True)
                warmer.start()
            options = SnapshotOptions(tcp=metadata.get("criu_tcp", "established"))  # as dumped
            result = CriuSnapshotter(options=options).restore(artifact.images(unit.unit_id))
            restored_pid = result.pid
            span["pid"] = result.pid
        gpu_pids = list(metadata.get("gpu_pids") or [])
        if gpu_pids:
            with timer.span("restore.cuda_restore") as span:
                # Same ordinal, maybe another GPU: remap the captured UUIDs onto this host's.
                current = [d["uuid"] for d in cuda_devices()]
                pairs = [(old, new) for old, new in zip(metadata.get("gpu_uuids") or [], current) if old != new]
                try:
                    TreeCheckpoint().restore(gpu_pids, pairs)
                except CudaCheckpointError as exc:
                    raise OperationFailed("restore.cuda", str(exc)) from None
                span["processes"] = len(gpu_pids)
        adopted: dict[str, int] = {}
        fds: list[int] = []
        if stager is not None:
            with timer.span("restore.stage_wait"):
                staged = stager.join()
            timer.add_timeline_span("restore.stage_weights", stager.started_ns, stager.finished_ns,
                                    **{k: v for k, v in stager.stats.items() if isinstance(v, (int, bool, str))})
            if staged:
                adopted, fds = stager.export()
            else:
                context.warn(f"staging the weights failed ({stager.error}); the process hydrates them itself")
        if warmer is not None:
            warmer.join()
        context.progress(f"process tree restored (pid {result.pid}) in {result.seconds:.2f} s")
        with timer.span("restore.resume") as span:
            bars = PhaseProgress(f"coldsnap restore [{descriptor.engine}/{descriptor.snapshot_driver}]: ")
            command = {"command": "resume", "layout_digest": worker.layout_digest}
            if adopted:
                command.update(adopted=adopted, staged=stager.stats)
            else:
                command.update(payload=str(payload) if payload else None, residual=str(residual))
            try:
                resumed = request(metadata["control"], command, on_progress=bars, fds=fds)
            finally:
                bars.finish()
                for fd in fds:
                    os.close(fd)
                if stager is not None:
                    stager.release()
            hydrated = resumed.get("hydrate", {})
            span.update({"bytes": int(hydrated.get("bytes", 0)), "source": str(hydrated.get("source", "")),
                         "staged": bool(hydrated.get("staged", False))})
            span.update({f"{step}_ns": int(seconds * 1e9) for step, seconds in resumed.get("seconds", {}).items()})
        with timer.span("restore.canary") as span:
            try:
                canary = ask_canary(metadata["serving_port"], descriptor.canary.prompt, len(descriptor.canary.token_ids) or 16)
            except OSError as exc:  # HTTP errors included: the restored server did not answer right
                raise OperationFailed("restore.canary", f"the canary request failed: {exc}") from None
            span["tokens"] = len(canary.token_ids)
        if canary.token_ids != descriptor.canary.token_ids or canary.text != descriptor.canary.expected_response:
            raise OperationFailed("restore.canary", f"canary answered {canary.text!r}, captured {descriptor.canary.expected_response!r}")
    except BaseException as exc:
        if stager is not None:
            stager.cancel()
            stager.join()
            stager.release()
        if restored_pid is not None:
            kill_tree(restored_pid)
        if isinstance(exc, CriuError):
            raise OperationFailed("restore.criu", str(exc)) from None
        if isinstance(exc, (AgentError, OSError)):
            raise OperationFailed("restore.resume", f"{type(exc).__name__}: {exc}") from None
        raise
    warnings = [f"prefetch failed: {e}" for e in prefetch_error]
    context.progress(f"ready: pid {restored_pid}, port {metadata['serving_port']}, canary matched")
    return OperationOutcome(artifact=str(artifact.root), warnings=warnings)

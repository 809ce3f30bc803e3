"""Capture: start the serving command, prove it right, release its model memory, dump it, commit.

Sequence (one launch unit, snapshot driver n610 semantics: the initialized process is captured):
launch → every rank's agent + HTTP ready → canary recorded → ``prepare`` on every rank at once (drain,
graphs the policy drops, NCCL teardown between coordinator barriers, native packs written, weights
and KV released) → CUDA checkpoint of the tree's GPU processes → CRIU dump of the whole tree →
capsule manifest → artifact descriptor committed atomically.
A failure at any step kills what was started and commits nothing; an earlier artifact is never touched.
"""

from __future__ import annotations

import platform
import time
from pathlib import Path

from coldsnap.activation.artifact_dir import ArtifactDir, file_ref
from coldsnap.activation.engine_process import EngineProcess, LaunchError, ask_canary, wait_for_agent, wait_for_http
from coldsnap.activation.ranks import ActivationCoordinator, call_every_rank, rank_prefix
from coldsnap.agent.client import AgentClient, AgentError
from coldsnap.agent.protocol import Prepare, rank_control
from coldsnap.contracts.artifact import ArtifactDescriptor, CanaryRecord, PlatformRecord, UnitRecord, WorkerRecord
from coldsnap.contracts.capsule import ActivationMetadata, RegionRecord, WorkerActivation
from coldsnap.contracts.canonical import canonical_json
from coldsnap.contracts.layout import SemanticManifest
from coldsnap.activation.qualification import check_driver_floor, require_implemented_driver
from coldsnap.doctor import nvidia_kernel_driver
from coldsnap.operation import OperationContext, OperationFailed, OperationOutcome
from coldsnap.progress import PhaseProgress
from coldsnap.snapshot.criu import CriuError, CriuSnapshotter, SnapshotOptions
from coldsnap.snapshot.cuda_checkpoint import CudaCheckpointError, TreeCheckpoint, cuda_devices, gpu_processes
from coldsnap.snapshot.process_tree import anonymous_bytes, connected_tcp_sockets, resident_bytes, tree_pids

__all__ = ["capture", "READY_TIMEOUT_S"]

READY_TIMEOUT_S = 900.0


def capture(context: OperationContext, ready_timeout: float = READY_TIMEOUT_S) -> OperationOutcome:
    request_ = context.request
    require_implemented_driver(request_.snapshot_driver)
    if len(request_.units) != 1:
        raise OperationFailed("capture.topology", "this build captures one launch unit (one process tree)")
    unit = request_.units[0]
    workers = sorted(unit.workers, key=lambda w: w.rank)
    world = len(workers)
    if unit.serving_port is None:
        raise OperationFailed("capture.port", "the unit has no serving_port: the canary needs the engine's HTTP port")
    artifact = ArtifactDir(Path(request_.artifact))
    if artifact.committed():
        raise OperationFailed("capture.exists", f"{artifact.root} already holds a committed artifact; capture into a new directory")
    before = artifact.entries() if artifact.root.exists() else None  # what a failure must leave
    artifact.root.mkdir(parents=True, exist_ok=True)
    artifact.clear_uncommitted([unit.unit_id])
    validation = request_.policy.validation
    timer = context.timer

    with timer.span("capture.launch") as span:
        try:
            engine = EngineProcess(list(unit.command), artifact.log_path(unit.unit_id), dict(unit.env))
        except BaseException:
            artifact.remove_created(before)
            raise
        span["pid"] = engine.pid
    dumped = False
    try:
        context.progress(f"started {unit.command[0]} (pid {engine.pid}); waiting for it to be ready")
        controls = [rank_control(engine.control, w.rank) for w in workers]
        with timer.span("capture.ready") as span:
            status = wait_for_agent(engine.control, engine.alive, ready_timeout)
            if status.world_size != world:
                raise OperationFailed("capture.topology", f"the engine runs {status.world_size} rank(s), the "
                                      f"request lists {world} worker(s): capture with one worker per rank "
                                      "(coldsnap capture --ranks N)")
            statuses = [status] + [wait_for_agent(control, engine.alive, ready_timeout) for control in controls[1:]]
            wait_for_http(unit.serving_port, engine.alive, ready_timeout)
            span["ranks"] = world
        with timer.span("capture.canary") as span:
            canary = ask_canary(unit.serving_port, validation.prompt, validation.max_tokens)
            span["tokens"] = len(canary.token_ids)
        context.progress(f"canary answered {canary.text!r} ({len(canary.token_ids)} tokens)")
        generate = request_.policy.weights.native_generation != "off" or request_.policy.weights.mode != "recovery"
        graph_policy = request_.policy.graphs.mode or "retain"
        with timer.span("capture.prepare") as span, ActivationCoordinator(world) as coordinator:
            bars = PhaseProgress(f"coldsnap capture [{request_.engine}/{request_.snapshot_driver}]: ")
            command = Prepare(pack_dir=str(artifact.payload_dir) if generate else None, graph_policy=graph_policy,
                              coordinator=coordinator.command_field())
            try:
                # Progress bars follow rank 0; the ranks write their packs at the same time.
                prepared_ranks = call_every_rank(
                    [(w.rank, lambda c=c, r=w.rank: AgentClient(c).prepare(command, on_progress=bars if r == 0 else None))
                     for w, c in zip(workers, controls)], coordinator)
            finally:
                bars.finish()
            for rank, prepared in enumerate(prepared_ranks):
                prefix = rank_prefix(rank)
                span.update({f"{prefix}{k}_ns": int(v * 1e9) for k, v in prepared.seconds.items()})
                if prepared.graphs_released:
                    span[f"{prefix}graphs_released"] = ",".join(prepared.graphs_released)
        rss_after_release = sum(p.rss_bytes for p in prepared_ranks)
        device_after_release = sum(p.device_bytes for p in prepared_ranks)
        pids = tree_pids(engine.pid)
        gpu_pids = gpu_processes(pids)
        gpus = cuda_devices() if gpu_pids else []
        if gpu_pids:
            anonymous_before_checkpoint = anonymous_bytes(pids)
            check_driver_floor(context, request_.snapshot_driver, nvidia_kernel_driver() or "0", "capture.driver_floor")
            # n610: the initialized CUDA state goes into the image; weights and KV were released above,
            # so only contexts, graphs and small buffers are copied out (at ~2 GB/s).
            with timer.span("capture.cuda_checkpoint") as span:
                try:
                    TreeCheckpoint().checkpoint(gpu_pids)
                except CudaCheckpointError as exc:
                    raise OperationFailed("capture.cuda_checkpoint", str(exc)) from None
                span["processes"] = len(gpu_pids)
                # What the checkpoint moved from the GPU into the process image (contexts, graph pools).
                span["anonymous_bytes_before"] = anonymous_before_checkpoint
                span["anonymous_bytes_after"] = anonymous_bytes(pids)
        with timer.span("capture.criu_dump") as span:
            # No connected TCP socket (the canary's connection is closed): no --tcp-established and no
            # network lock, which saves nftables work at dump and at every restore.
            tcp = "established" if connected_tcp_sockets(pids) else "none"
            tree_rss = resident_bytes(pids)
            snapshotter = CriuSnapshotter(options=SnapshotOptions(tcp=tcp))
            span["tcp"] = tcp
            result = snapshotter.dump(engine.pid, artifact.images(unit.unit_id), owned_root=artifact.root)
            dumped = True
            engine.process.wait(timeout=30)
            span["image_bytes"] = result.image_bytes
            # Goal: the image holds no weights and no KV, so it is about the process's other memory.
            span["rss_after_release_bytes"] = rss_after_release  # the ranks' own processes
            span["tree_rss_bytes"] = tree_rss  # every process of the tree, model memory released
            span["device_bytes_after_release"] = device_after_release
        context.progress(f"dumped {len(result.pids)} processes, {result.image_bytes / 2**20:.1f} MiB of images "
                         f"in {result.seconds:.2f} s (resident memory without model memory: "
                         f"{rss_after_release / 2**20:.1f} MiB host + {device_after_release / 2**20:.1f} MiB GPU)")
        with timer.span("capture.commit"):
            capsule = artifact.write_capsule(unit.unit_id, ActivationMetadata(
                control=engine.control, serving_port=unit.serving_port, root_pid=engine.pid,
                workers=[WorkerActivation(rank=w.rank, control=c, pid=s.pid, layout=s.layout, layout_digest=p.layout_digest,
                                          regions={tag: RegionRecord(**r.model_dump()) for tag, r in p.regions.items()},
                                          graphs_released=p.graphs_released)
                         for w, c, s, p in zip(workers, controls, statuses, prepared_ranks)],
                criu_options=snapshotter.options.args(), criu_tcp=snapshotter.options.tcp,
                gpu_pids=gpu_pids, gpu_uuids=[d["uuid"] for d in gpus],
            ))
            worker_records = []
            for w, p in zip(workers, prepared_ranks):
                payload, residual = p.payload, p.residual
                if residual is None:
                    raise OperationFailed("capture.residual", f"the agent of rank {w.rank} wrote no residual pack")
                worker_records.append(WorkerRecord(
                    worker_id=w.worker_id, rank=w.rank, layout_digest=p.layout_digest,
                    residual=file_ref(artifact, Path(residual.path), residual.sha256),
                    payload=file_ref(artifact, Path(payload.path), payload.sha256) if payload else None))
            artifact.request_path.write_bytes(canonical_json(request_.to_json_value()) + b"\n")
            driver = nvidia_kernel_driver()
            descriptor = ArtifactDescriptor(
                format=9,
                artifact_id=f"{request_.operation_id}",
                created_unix_ns=time.time_ns(),
                engine=request_.engine,
                snapshot_driver=request_.snapshot_driver,
                request_sha256=context.request_sha256,
                semantic_manifest_sha256=SemanticManifest.from_request(request_).canonical_sha256(),
                model=request_.model,
                graph_policy=graph_policy,
                platform=PlatformRecord(
                    arch=platform.machine(), kernel=platform.release(), nvidia_driver=driver,
                    nvidia_driver_floor=int(driver.split(".")[0]) if driver else None,
                    gpu_model=gpus[0]["name"] if gpus else None,
                    compute_capability=gpus[0]["compute_capability"] if gpus else None,
                    criu_version=".".join(map(str, snapshotter.criu.version())),
                ),
                canary=CanaryRecord(prompt=validation.prompt, expected_response=canary.text, token_ids=canary.token_ids),
                units=[UnitRecord(unit_id=unit.unit_id, capsule=capsule, workers=worker_records)],
            )
            artifact.commit(descriptor)
    except (LaunchError, AgentError, CriuError, OSError, ValueError) as exc:
        tail = engine.log_tail()
        code = {LaunchError: "capture.launch", AgentError: "capture.agent", CriuError: "capture.criu_dump"}.get(type(exc), "capture.io")
        raise OperationFailed(code, f"{exc}" + (f" | engine log: {tail.splitlines()[-1]}" if tail else "")) from exc
    finally:
        if not dumped or engine.alive():
            engine.kill()  # never leave the captured command running
        if not artifact.committed():
            # A failed capture leaves nothing of its own behind (a full disk must not stay full); the
            # engine's last lines go to the progress stream first, since its log goes too.
            tail = engine.log_tail(20)
            if tail:
                context.progress("capture failed; the engine's last lines:\n" + tail)
            artifact.remove_created(before)
    context.progress(f"committed {artifact.descriptor_path}")
    return OperationOutcome(artifact=str(artifact.root))

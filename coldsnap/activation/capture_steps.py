"""The capture steps (:class:`CaptureSequence`): start the serving command, prove it right, release its
model memory, dump it, commit — shared by the snapshot drivers (the order each runs them in is the
driver's: :mod:`coldsnap.activation.n610`, :mod:`coldsnap.activation.n580`).

n610's order (the initialized process is captured): a plain reference start of the command answers the
canary and the check's probes, and is stopped (:mod:`coldsnap.activation.reference_check`) → launch → every
rank's agent + HTTP ready → canary recorded → the answers equal the reference's → ``prepare`` on every rank at once (drain, graphs the policy drops, NCCL teardown between
coordinator barriers, native packs written, weights and KV released) → no TCP connection to a peer
outside the tree → CUDA checkpoint of the tree's GPU processes → CRIU dump of the whole tree → capsule
manifest → the capsule restored once and proven by the canary → artifact descriptor committed atomically.
Each step is a method with its own span and error code (:mod:`coldsnap.contracts.errors`). A failure at
any step kills what was started and commits nothing (one unwind); an earlier artifact is never touched.

The canary and the reference check are :mod:`~coldsnap.activation.capture_reference`, the commit
:mod:`~coldsnap.activation.capture_commit`, the state they share :mod:`~coldsnap.activation.capture_state`.
"""

from __future__ import annotations

import errno
import functools
import os
import socket
import time
from pathlib import Path
from typing import Literal, Sequence

from coldsnap.activation.artifact_dir import external_record_dir
from coldsnap.activation.capture_commit import CommitSteps
from coldsnap.activation.capture_reference import ReferenceCheckSteps
from coldsnap.activation.engine_process import (AgentMissing, EngineProcess, LaunchError, ServingTree, wait_for_agent,
                                                wait_for_http)
from coldsnap.activation.ranks import ActivationCoordinator, call_every_rank, rank_prefix
from coldsnap.agent.client import AgentClient, KeyGateError, KeyGateMissing, key_gate
from coldsnap.agent.protocol import Prepare, PrepareReply, rank_control
from coldsnap.contracts.artifact import PinnedFile
from coldsnap.contracts.capsule import GpuProcessMemory
from coldsnap.activation.qualification import check_driver_floor
from coldsnap.host import nvidia_kernel_driver
from coldsnap.payload.validation import hash_and_record
from coldsnap.operation import OperationFailed, OperationOutcome
from coldsnap.progress import PhaseProgress
from coldsnap.snapshot.criu import CriuSnapshotter
from coldsnap.snapshot.criu_options import SnapshotOptions
from coldsnap.snapshot.cuda_checkpoint import TreeCheckpoint, cuda_devices, gpu_processes
from coldsnap.snapshot.nvml import NvmlError, process_memory
from coldsnap.snapshot.process_tree import (anonymous_bytes, bound_socket_files, remove_socket_files,
                                            resident_bytes, socket_files_in, tcp_connections, tree_pids)
from coldsnap.snapshot.moved_sockets import probe_path_sockets
from coldsnap.secrets.served_key import served_key_in_command
from coldsnap.settings import SETTINGS

UNIT_BARRIERS = {"wait_until_ready": "ready", "dump": "dumped"}
"""One unit of several: after these steps it waits for every unit (``capture.units.<barrier>``): every
engine serves before unit 0 asks the canary; every tree is dumped before any restores its check."""

__all__ = ["CaptureSequence", "READY_TIMEOUT_S", "VERIFY_ENV", "port_taken", "verify_at_capture"]

READY_TIMEOUT_S = 900.0

VERIFY_ENV = "COLDSNAP_CAPTURE_VERIFY"


def verify_at_capture() -> bool:
    """Whether a capture restores its capsule once before committing it (default yes; ``--no-verify``: no)."""
    return SETTINGS.flag(VERIFY_ENV)

STOPPED_WITHIN_S = 30.0
"""How long a stopped start (the reference's, or an engine the reference check starts again) may take to give
its GPU memory and the serving port back."""

# Why an engine of each kind runs without its coldsnap agent, and what to do about it.
AGENT_MISSING_CAUSES: dict[str, str] = {
    "vllm": "vLLM runs without coldsnap: start it with `--load-format coldsnap`, and install coldsnap in vLLM's own "
            "Python environment (its plugin coldsnap_vllm loads through the `vllm.general_plugins` entry point)",
    "sglang": "SGLang runs without coldsnap: start it with `--load-format coldsnap`, and install coldsnap in SGLang's "
              "own Python environment (its plugin coldsnap_sglang loads through the `sglang.srt.plugins` entry point)",
    "torch-lm": "the command does not start coldsnap's agent: the reference workload (`python -m "
                "coldsnap.workloads.torch_lm`) does, through `coldsnap.agent.attach`; for vLLM or SGLang pass --engine",
}


def _host_of(endpoint: str) -> str:
    """``address:port`` (``[v6]:port``) → the address."""
    return endpoint.rpartition(":")[0].strip("[]")


def port_taken(port: int) -> bool:
    """Whether a socket is bound to ``port`` on the loopback address now (a privileged port this user may
    not bind is not taken: the engine's own bind says so)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


class CaptureSequence(ReferenceCheckSteps, CommitSteps):
    """The steps of one capture, each its own method, span and error code (:meth:`step`), and one
    :meth:`unwind` for every failure: the engine killed, everything the capture created in the output
    directory removed (a full disk must not stay full), the engine's last lines shown."""

    def run(self, steps: Sequence[str]) -> OperationOutcome:
        """The named steps (methods of this sequence), in order, as the snapshot driver lists them; any
        failure: :meth:`unwind`; either way: :meth:`release`; on success :meth:`finish` first."""
        try:
            for name in steps:
                getattr(self, name)()
                if self.units is not None and name in UNIT_BARRIERS:
                    with self.timer.span(f"capture.units.{UNIT_BARRIERS[name]}"):
                        self.units.barrier(f"capture.{UNIT_BARRIERS[name]}")
            self.finish()
        except BaseException:
            self.unwind()
            raise
        finally:
            self.release()
        self.context.progress(f"committed {self.artifact.descriptor_path}")
        return OperationOutcome(artifact=str(self.artifact.root))

    def finish(self) -> None:
        """After the commit: nothing of the command keeps running (CRIU's dump ended the tree already)."""
        if self.engine is not None and self.engine.alive():
            self.engine.kill()

    def release(self) -> None:
        """What the sequence holds besides the engine, let go after success or failure (n580's template link
        and state)."""

    def commit_checked(self) -> None:
        """:meth:`commit`, with the capsule restored once first unless that is switched off
        (:func:`verify_at_capture`)."""
        self.commit(verify=verify_at_capture())

    def _prepare_output(self) -> None:
        """Before the first start of the command (the reference's or the engine's): the output directory made,
        what it held noted (the unwind removes only what the capture made), what an earlier failed capture left
        cleared; the engine's temporary folder (its ZeroMQ ipc:// sockets) noted, swept of what the trees
        leave at the end."""
        if self.output_ready:
            return
        self.refuse_served_key()
        artifact, unit = self.artifact, self.unit
        self.before = artifact.entries() if artifact.root.exists() else None
        artifact.root.mkdir(parents=True, exist_ok=True)
        artifact.clear_uncommitted([unit.unit_id])
        self.engine_tmp = Path(unit.env.get("TMPDIR") or os.environ.get("TMPDIR") or "/tmp")
        self.engine_tmp_sockets = socket_files_in(self.engine_tmp)
        self.output_ready = True

    def refuse_served_key(self) -> None:
        """A command that gives its server an API key would put the key in the capsule: refused before anything
        starts, naming the way to give it (at restore)."""
        given = served_key_in_command(self.request.engine, list(self.unit.command), self.engine_env.variables)
        if given is not None:
            raise OperationFailed("capture.secret", f"{given}: the server's API key would be in the capsule (its "
                                  "memory and argv), and so in every registry it is published to. Capture the command "
                                  "without it and give the key to each restore: coldsnap restore DIR --api-key-file F "
                                  "(docs/secrets.md)")

    def _note_environment(self, span: dict[str, str | int | bool]) -> None:
        """The secret-bearing names withheld and held, in the start's span and (once) the progress: names only."""
        env = self.engine_env
        span["env_withheld"] = ",".join(env.withheld)
        span["env_held"] = ",".join(env.held)
        if self.capture_starts + self.plain_starts > 1:
            return
        if env.withheld:
            self.context.progress(f"the command starts without {', '.join(env.withheld)} (names that bear secrets stay "
                                  "out of the capsule; --env NAME passes one on deliberately)")
        missing = [name for name in self.unit.pass_env if name not in env.variables]
        if missing:
            self.context.progress(f"--env {' '.join(missing)}: not set in coldsnap's environment, so not passed on")
        if env.held:
            self.context.warn(f"the capsule holds {', '.join(env.held)} (passed on deliberately): `coldsnap publish` "
                              "refuses it unless --allow-secrets")

    def launch(self) -> None:
        artifact, unit = self.artifact, self.unit
        with self.step("capture.launch", "capture.launch") as span:
            self._prepare_output()
            self.engine = EngineProcess(list(unit.command), artifact.log_path(unit.unit_id), self.engine_env.variables)
            self.capture_starts += 1
            span["pid"] = self.engine.pid
            self._note_environment(span)
        self.context.progress(f"started {unit.command[0]} (pid {self.engine.pid}); waiting for its coldsnap agent "
                              f"and for HTTP on port {self.port}")

    def wait_until_ready(self) -> None:
        """Rank 0's agent, with the HTTP port polled meanwhile (answering while no agent has for
        :data:`AGENT_AFTER_HTTP_S`: ``capture.agent``), then every other rank's agent (the engine runs as
        many ranks as the request lists), then HTTP ``/health``."""
        engine, world = self.engine, self.world
        assert engine is not None
        with self.step("capture.ready", "capture.ready") as span:
            self.controls = [rank_control(engine.control, w.rank) for w in self.workers]
            try:
                status = wait_for_agent(self.controls[0], engine.alive, self.ready_timeout,
                                        http_port=self.port if self.serves else None,
                                        agent_after_http=self.agent_after_http, on_http=lambda: self.context.progress(
                                            f"HTTP answers on port {self.port}; waiting for the coldsnap agent (at "
                                            f"most {self.agent_after_http:.0f} s more)"))
                if status.world_size != world:
                    raise OperationFailed("capture.topology", f"the engine runs {status.world_size} rank(s), the "
                                          f"request lists {world} worker(s): capture with one worker per rank "
                                          "(coldsnap capture --ranks N)")
                self.statuses = [status] + [wait_for_agent(control, engine.alive, self.ready_timeout)
                                            for control in self.controls[1:]]
                if self.serves:
                    self.context.progress(f"coldsnap agent answered ({len(self.workers)} rank(s)); waiting for HTTP "
                                          f"/health on port {self.port}")
                    wait_for_http(self.port, engine.alive, self.ready_timeout)
            except AgentMissing as exc:
                raise OperationFailed("capture.agent", f"{exc}: {AGENT_MISSING_CAUSES[self.request.engine]}") from None
            except LaunchError as exc:
                if engine.alive():  # timed out
                    raise OperationFailed("capture.ready", f"{exc}{self._last_log_line()}") from None
                ended = engine.ended() if isinstance(engine, EngineProcess) else None
                raise OperationFailed("capture.launch", f"{exc}{f': the command {ended}' if ended else ''}"
                                      f"{self._last_log_line(3)}") from None
            span["ranks"] = world

    def _stop_tree(self, tree: ServingTree, graceful: bool = False) -> None:
        """Stop a tree started here (``graceful``: as an operator would, SIGTERM first; else killed) and wait (at
        most :data:`STOPPED_WITHIN_S` each) until the GPU holds nothing of it (NVML, where it answers) and the
        serving port is free: the next start needs both."""
        pids = set(tree_pids(tree.pid))
        on_gpu = set(gpu_processes(list(pids)))
        if graceful and isinstance(tree, EngineProcess):
            tree.stop(STOPPED_WITHIN_S)
        else:
            tree.kill()
        deadline = time.monotonic() + STOPPED_WITHIN_S
        while on_gpu and time.monotonic() < deadline:
            try:
                if not any(process_memory(on_gpu).values()):
                    break
            except NvmlError:
                break
            time.sleep(0.1)
        deadline = time.monotonic() + STOPPED_WITHIN_S
        while port_taken(self.port):
            if time.monotonic() > deadline:
                raise OperationFailed("capture.reference", f"port {self.port} is still taken {STOPPED_WITHIN_S:.0f} s "
                                      "after the start that served it was stopped")
            time.sleep(0.1)

    def hold_served_requests(self) -> None:
        """The last HTTP request of the capture answered: the served HTTP process's key gate is held (the engine's
        guard with a key nobody knows: its guarded paths answer 401, ``/health`` stays open) in the image, so a
        restored server answers nothing on them before its restore opens the gate or gives it the API key
        (:mod:`coldsnap.agent.api_key`): CRIU lets connections in before the ranks resume. An engine without a
        gate (the reference workload): nothing to hold."""
        if not self.serves or not self.controls:
            return
        try:
            key_gate(self.controls[0], {"hold": True})
        except KeyGateMissing:
            return
        except KeyGateError as exc:
            raise OperationFailed("capture.prepare", f"the served HTTP process's key gate: {exc}") from None

    def prepare_ranks(self) -> None:
        """Every rank at once: drain, drop the graphs the policy drops, tear NCCL down, write its packs,
        release weights and KV."""
        weights = self.request.policy.weights
        # No native pack only when recovery is the way back and native generation is off; otherwise
        # `auto` and `native` restores need it.
        native = not (weights.mode == "recovery" and weights.native_generation == "off")
        graph_policy = self.request.policy.graphs.mode or "retain"
        assert self.engine is not None
        pids = tree_pids(self.engine.pid)
        self.serving_gpu_bytes = self._gpu_use(pids) if gpu_processes(pids) else {}
        with self.step("capture.prepare", "capture.prepare") as span, \
                ActivationCoordinator(len(self.workers), self.units) as coordinator:
            bars = PhaseProgress(f"coldsnap capture [{self.request.engine}/{self.request.snapshot_driver}]: ")
            command = Prepare(pack_dir=str(self.artifact.payload_dir), native=native, graph_policy=graph_policy,
                              coordinator=coordinator.command_field())
            try:
                # Progress bars follow rank 0; the ranks write their packs at the same time.
                self.prepared = call_every_rank(
                    [(w.rank, functools.partial(AgentClient(c).prepare, command, on_progress=bars if w.rank == 0 else None))
                     for w, c in zip(self.workers, self.controls)], coordinator)
            finally:
                bars.finish()
            for w, prepared in zip(self.workers, self.prepared):
                prefix = rank_prefix(w.rank)
                span.update({f"{prefix}{k}_ns": int(v * 1e9) for k, v in prepared.seconds.items()})
                # torch's caching allocator on the GPU, before and after its cache was emptied: image attribution
                span.update({f"{prefix}torch_reserved_before_empty_bytes": prepared.device_bytes_before_empty,
                             f"{prefix}torch_reserved_bytes": prepared.device_bytes,
                             f"{prefix}torch_allocated_bytes": prepared.device_bytes_allocated,
                             f"{prefix}graph_pool_bytes": prepared.graph_pool_bytes,
                             f"{prefix}graph_pool_allocated_bytes": prepared.graph_pool_allocated_bytes,
                             f"{prefix}region_pool_bytes": prepared.region_pool_bytes,
                             f"{prefix}stack_bytes": prepared.stack_bytes,
                             f"{prefix}local_memory_freed_bytes": prepared.local_memory_freed_bytes,
                             f"{prefix}device_used_bytes": prepared.device_used_bytes,
                             f"{prefix}rss_bytes": prepared.rss_bytes})
                if prepared.graphs_released:
                    span[f"{prefix}graphs_released"] = ",".join(prepared.graphs_released)

    def refuse_outside_connections(self) -> None:
        """No TCP connection to a peer outside the tree: a restore could not take it up again (the peer
        moved on, and every replica would hold the same connection). Refused while the tree still runs,
        before the CUDA checkpoint and the dump, so the unwind only kills it. Connections between the
        tree's own processes are dumped with it (see :meth:`dump`); so are, for one launch unit of several,
        those to another unit's tree (an engine's store, gloo pairs, ZeroMQ queues between its nodes): every
        unit dumps them established, under the network lock, and every restore rewrites both ends for the
        units' new addresses and holds them until all units are back (``restore.units.network_unlock``)."""
        assert self.engine is not None
        with self.step("capture.connections", "capture.connections") as span:
            connections = tcp_connections(tree_pids(self.engine.pid))
            span["connected"] = connections.connected
            units = self._unit_addresses()
            between_units = [c for c in connections.outside if _host_of(c.remote) in units]
            outside = [c for c in connections.outside if _host_of(c.remote) not in units]
            if between_units:
                span["between_units"] = len(between_units)
            if outside:
                raise OperationFailed("capture.connections", f"the serving tree holds {len(outside)} TCP "
                                      "connection(s) to peers outside it, which no restore could take up again: "
                                      f"{'; '.join(map(str, outside))}; close them before the capture "
                                      "(open them after a restore instead)")

    def _unit_addresses(self) -> set[str]:
        """The other launch units' addresses (one unit of several; none otherwise), as every unit said."""
        if self.units is None:
            return set()
        return {a for a in self.units.every_unit("capture/address", self.units.address) if a != self.units.address}

    def checkpoint_cuda(self) -> None:
        """n610: the initialized CUDA state goes into the image; weights and KV were released, so only
        contexts, graphs and small buffers are copied out (at ~2 GB/s)."""
        assert self.engine is not None
        pids = tree_pids(self.engine.pid)
        self.gpu_pids = gpu_processes(pids)
        if not self.gpu_pids:
            return
        self.gpus = cuda_devices()
        anonymous_before_checkpoint = anonymous_bytes(pids)
        check_driver_floor(self.context, self.request.snapshot_driver, nvidia_kernel_driver() or "0", "capture.driver_floor")
        # (NVML asked again only where it answered while serving: one warning at most)
        checkpointed = self._gpu_use(pids) if self.serving_gpu_bytes else {}
        self.gpu_memory = [GpuProcessMemory(pid=pid, gpu_uuid=uuid, serving_bytes=serving,
                                            checkpointed_bytes=checkpointed.get(uuid, {}).get(pid, 0))
                           for uuid, used in sorted(self.serving_gpu_bytes.items()) for pid, serving in sorted(used.items())]
        with self.step("capture.cuda_checkpoint", "capture.cuda_checkpoint") as span:
            TreeCheckpoint().checkpoint(self.gpu_pids)
            span["processes"] = len(self.gpu_pids)
            # What the checkpoint moved from the GPU into the process image (contexts, graph pools).
            span["anonymous_bytes_before"] = anonymous_before_checkpoint
            span["anonymous_bytes_after"] = anonymous_bytes(pids)

    def _gpu_use(self, pids: list[int]) -> dict[str, dict[int, int]]:
        """GPU UUID → pid → bytes, of the tree's processes ``pids`` (NVML). Where NVML cannot tell, a
        warning: restores of this capsule are then not admitted by GPU memory."""
        try:
            return process_memory(set(pids))
        except NvmlError as exc:
            self.context.warn(f"the GPU memory the tree uses could not be recorded ({exc}); restores of this "
                              "capsule are not checked for room on their GPUs")
            return {}

    def dump(self) -> None:
        engine = self.engine
        assert isinstance(engine, EngineProcess)
        rss_after_release = sum(p.rss_bytes for p in self.prepared)
        device_after_release = sum(p.device_bytes for p in self.prepared)
        with self.step("capture.criu_dump", "capture.criu_dump") as span:
            pids = tree_pids(engine.pid)
            # No connected TCP socket (the canary's connection is closed): no --tcp-established and no
            # network lock, which saves nftables work at dump and at every restore. Connections whose
            # peers are all the tree's own (torch.distributed's store at TP 1): no network lock either.
            # (Outside peers were refused before the checkpoint; one opened since gets the lock.)
            connections = tcp_connections(pids)
            tcp: Literal["established", "none"] = "established" if connections.connected else "none"
            lock: Literal["nftables", "skip"] = "nftables" if connections.outside else "skip"
            tree_rss = resident_bytes(pids)
            self.snapshotter = CriuSnapshotter(options=SnapshotOptions(tcp=tcp, network_lock=lock))
            self.criu_tcp = tcp
            span["tcp"] = tcp
            if connections.connected:
                span["network_lock"] = lock
            socket_files = bound_socket_files(pids)
            result = self.snapshotter.dump(engine.pid, self.artifact.images(self.unit.unit_id), owned_root=self.artifact.root)
            self.dumped = True
            engine.process.wait(timeout=30)
            # The dump ended the tree; the socket files it had bound (vLLM's ZeroMQ ipc:// in /tmp) would stay.
            # (Restores bind their own: <path>.port-P, coldsnap.snapshot.moved_sockets.path_socket_names.)
            remove_socket_files(socket_files)
            self.sweep_engine_tmp()
            span["image_bytes"] = result.image_bytes
            if result.census is not None:  # the zero pages left out, per process: pid:bytes:dropped
                span["zero_bytes_dropped"] = result.census.dropped_bytes
                span["compact_ns"] = int(result.compact_seconds * 1e9)
                span["image_processes"] = result.census.summary()
            # Goal: the image holds no weights and no KV, so it is about the process's other memory.
            span["rss_after_release_bytes"] = rss_after_release  # the ranks' own processes
            span["tree_rss_bytes"] = tree_rss  # every process of the tree, model memory released
            span["device_bytes_after_release"] = device_after_release
        dropped = f", {result.census.dropped_bytes / 2**20:.1f} MiB of zero pages left out" if result.census else ""
        self.context.progress(f"dumped {len(result.pids)} processes, {result.image_bytes / 2**20:.1f} MiB of images{dropped} "
                              f"in {result.seconds:.2f} s (resident memory without model memory: "
                              f"{rss_after_release / 2**20:.1f} MiB host + {device_after_release / 2**20:.1f} MiB GPU)")

    def pin_recovery(self, rank: int, prepared: PrepareReply) -> list[PinnedFile] | None:
        """The safetensors the rank's engine loaded its weights from, pinned by content: what a restore
        replays when the pack is unusable (``auto``) or not wanted (``recovery``). None when the engine
        reported none; a ``recovery`` capture then fails, since it could never restore that way."""
        wanted = self.request.policy.weights.mode
        if not prepared.recovery_files:
            if wanted == "recovery":
                raise OperationFailed("capture.recovery", f"weights.mode recovery, but the engine of rank {rank} "
                                      "loaded its weights from no safetensors file coldsnap can pin")
            return None
        try:
            files = [Path(f).resolve() for f in prepared.recovery_files]
            # Recorded where restores look (a first recovery then hashes nothing while the files are unchanged)
            return [PinnedFile(path=str(f), sha256=hash_and_record(f, external_record_dir(f, self.context.hand_over)),
                               size_bytes=f.stat().st_size)
                    for f in files]
        except OSError as exc:
            raise OperationFailed("capture.recovery", f"rank {rank}'s recovery safetensors: {exc}") from None

    def sweep_engine_tmp(self) -> None:
        """Unlink the socket files new in the engine's temporary folder that nothing listens on: what its tree
        bound and closed without unlinking (vLLM's start-up ZeroMQ handshake), which :func:`bound_socket_files`
        cannot see once no process holds it."""
        if self.engine_tmp is not None:
            new = socket_files_in(self.engine_tmp) - self.engine_tmp_sockets
            for stale in probe_path_sockets([os.fsencode(path) for path in new])[1]:
                stale.unlink(missing_ok=True)

    def unwind(self) -> None:
        """After any failure (an interrupt included): the engine never keeps running, and nothing the
        capture created stays in the output directory; an earlier artifact is never touched."""
        engine = self.engine
        if self.reference_engine is not None and self.reference_engine.alive():
            self.reference_engine.kill()
            self.sweep_engine_tmp()
        if engine is not None and (not self.dumped or engine.alive()):
            engine.kill()
            self.sweep_engine_tmp()
        if self.artifact.committed():
            return
        # The engine's last lines go to the progress stream first, since its log goes too.
        tail = engine.log_tail(20) if engine is not None else ""
        if tail:
            self.context.progress("capture failed; the engine's last lines:\n" + tail)
        self.artifact.remove_created(self.before)

"""Snapshot driver n580: a pre-CUDA template, captured once, placed and started on every restore.

The image is not the serving process but its launcher stopped before the engine starts
(:mod:`coldsnap.agent.template`): Python up, the engine's modules imported, no CUDA, NVML or
distributed socket. It holds nothing of the NVIDIA driver, so it restores under any driver ≥ 580 and
onto any GPU; it saves the interpreter's start and the imports, not the engine's initialization (CUDA
context, weight load, graph capture), which runs again on every restore — with the weights hydrated
from the capture's native pack at load time (the load format reads the placement's
``COLDSNAP_NATIVE_PACK``) instead of parsed from safetensors.

Capture (:class:`TemplateCapture`): launch the command under the template → the template at its
boundary → no NVIDIA userspace-driver state in the tree (``capture.template_nvidia``) → CRIU dump →
the image restored and placed once, here (proves it restores and places, and runs the engine the
capsule will run) → agent + HTTP ready → canary recorded → the agent writes the native pack →
killed → commit. Restore (:class:`TemplateRestore`): admission without the CUDA-state checks plus
the placement ABI (``admission.placement``) → CRIU restore → placement (serving port, the unit's
environment, the pack) → the engine's agent (lease) and HTTP → canary. Graphs (policy ``recreate``, n580's
default): eager first, captured once the engine has answered where the engine supports it
(``COLDSNAP_GRAPHS=after-ready``: the reference workload); vLLM and SGLang capture theirs in their own
startup, before readiness.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from coldsnap.activation.artifact_dir import ArtifactDir
from coldsnap.activation.admission import Admitted, WeightSource
from coldsnap.activation.capture_steps import READY_TIMEOUT_S, CaptureSequence
from coldsnap.activation.engine_process import EngineProcess, LaunchError, new_control_name, wait_for_agent, wait_for_http
from coldsnap.activation.qualification import check_driver_floor
from coldsnap.activation.restore_state import RestorePlan, Step
from coldsnap.activation.restore_steps import RestoreSequence
from coldsnap.agent.client import Lease, TemplateClient, TemplateLink
from coldsnap.agent.protocol import CONTROL_ENV, rank_control
from coldsnap.contracts.artifact import ArtifactDescriptor
from coldsnap.contracts.capsule import ActivationMetadata, CapsuleManifest, TemplateRecord
from coldsnap.contracts.placement import (GRAPHS_AFTER_READY, GRAPHS_ENV, NATIVE_PACK_ENV, PLACEMENT_ABI, PLACEMENT_ABI_ENV, PLACEMENT_ABIS,
                                          PRELOAD_ENV, WEIGHTS_MODE_ENV, PlacementRecord, PlacementRefused,
                                          check_placement_abi)
from coldsnap.contracts.profiles import ENGINE_ADAPTERS
from coldsnap.host import live_start_ticks, nvidia_kernel_driver, state_root
from coldsnap.operation import OperationContext, OperationFailed, OperationOutcome
from coldsnap.snapshot.criu import CriuSnapshotter
from coldsnap.snapshot.criu_options import SnapshotOptions
from coldsnap.snapshot.cuda_checkpoint import cuda_devices, gpu_processes
from coldsnap.snapshot.nvidia_mappings import nvidia_userspace_state
from coldsnap.snapshot.process_tree import kill_tree, tree_pids

KEY_GATE_HELD_ENV = "COLDSNAP_KEY_GATE_HELD"  # (coldsnap.agent.api_key: the engine's gate built held)

__all__ = ["TemplateCapture", "TemplateRestore", "template_placement"]

BOUNDARY_TIMEOUT_S = 300.0


def interpreter_of(command: list[str]) -> str:
    """The Python that runs ``command``: its first word when that is a Python, else the interpreter in the
    console script's ``#!`` line; the template must be started by it to find the engine's modules.
    This process's own Python when neither tells."""
    program = shutil.which(command[0]) or command[0]
    if os.path.basename(program).startswith("python"):
        return program
    try:
        with open(program, "rb") as script:
            first = script.readline(512).decode(errors="replace")
    except OSError:
        return sys.executable
    words = first[2:].split() if first.startswith("#!") else []
    if words and os.path.basename(words[0]) == "env" and len(words) > 1:  # #!/usr/bin/env python3
        words = [shutil.which(words[1]) or words[1]]
    return words[0] if words and os.path.basename(words[0]).startswith("python") else sys.executable


class RestoredTree:
    """A tree CRIU restored (not this process's child): the engine's process as the sequences use it."""

    def __init__(self, pid: int, control: str, log_path: Path):
        self.pid, self.control, self.log_path = pid, control, log_path

    def alive(self) -> bool:
        return live_start_ticks(self.pid) is not None

    def kill(self) -> None:
        kill_tree(self.pid)

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def _restore_template(artifact: ArtifactDir, unit_id: str, images: Path, agent_control: str,
                      state_dir: Path) -> RestoredTree:
    """CRIU restores the unit's template (from ``images``: the artifact's, or a replica's copy in
    ``state_dir``) detached; its log continues in ``state_dir``'s copy."""
    result = CriuSnapshotter(options=SnapshotOptions(tcp="none")).restore(
        images, state_dir, artifact.root, own_images=images.is_relative_to(state_dir))
    return RestoredTree(result.pid, agent_control, state_dir / artifact.relative(artifact.log_path(unit_id)))


class TemplateCapture(CaptureSequence):
    """n580's capture: :class:`CaptureSequence`'s readiness, canary, prepare and commit, run on the engine
    the restored template started; the dump is of the template, before any of that."""

    def __init__(self, context: OperationContext, artifact: ArtifactDir, ready_timeout: float):
        super().__init__(context, artifact, ready_timeout)
        if len(self.workers) != 1:
            raise OperationFailed("capture.topology", "n580 captures one rank in this build (its pack is placed "
                                  "through one environment); capture tensor-parallel engines with n610")
        self.template_control = new_control_name().replace("agent", "template")
        given = self.unit.env.get(PRELOAD_ENV)
        self.preload = ([m for m in given.split(",") if m] if given is not None
                        else list(ENGINE_ADAPTERS[self.request.engine].template_preload))
        abi = self.unit.env.get(PLACEMENT_ABI_ENV, str(PLACEMENT_ABI))
        if abi not in [str(n) for n in PLACEMENT_ABIS]:
            raise OperationFailed("capture.template", f"{PLACEMENT_ABI_ENV}={abi}: this build's templates speak "
                                  f"placement ABI {' or '.join(map(str, PLACEMENT_ABIS))}")
        self.placement_abi = int(abi)
        self.template_pid = 0
        # (every restore starts the engine anew from the template, as a plain start does)
        self.reference_note = "not applicable: n580 captures no initialized engine, every restore starts it anew"
        self.command: list[str] = []
        self.capture_state: Path | None = None  # the capture's own restore of the template writes here
        self.template_link: TemplateLink | None = None

    def finish(self) -> None:
        if self.engine is not None:
            self.engine.kill()  # the template's engine served the capture; the capsule is the template
            self.keep_engine_log()

    def release(self) -> None:
        self._close_link()
        self._remove_capture_state()

    def launch(self) -> None:
        """The unit's command under the template launcher."""
        self.command = list(self.unit.command)
        self.refuse_served_key()
        launcher = [interpreter_of(self.command), "-m", "coldsnap.agent.template", "--control", self.template_control,
                    "--preload", ",".join(self.preload), "--placement-abi", str(self.placement_abi), "--", *self.command]
        self.before = self.artifact.entries() if self.artifact.root.exists() else None
        with self.step("capture.launch", "capture.launch") as span:
            self.artifact.root.mkdir(parents=True, exist_ok=True)
            self.artifact.clear_uncommitted([self.unit.unit_id])
            self.engine = EngineProcess(launcher, self.artifact.log_path(self.unit.unit_id), self.engine_env.variables)
            self.template_pid = span["pid"] = self.engine.pid
            self._note_environment(span)
        self.context.progress(f"started the template of {self.command[0]} (pid {self.engine.pid}), importing "
                              f"{', '.join(self.preload) or 'nothing'}")

    def wait_for_boundary(self) -> None:
        engine = self.engine
        assert engine is not None
        with self.step("capture.template", "capture.template") as span:
            deadline = time.monotonic() + min(self.ready_timeout, BOUNDARY_TIMEOUT_S)
            while True:
                try:
                    status = TemplateClient(self.template_control).status()
                    break
                except (OSError, ValueError):
                    if not engine.alive():
                        raise OperationFailed("capture.template", "the template exited before its boundary (an "
                                              f"import failed?){self._last_log_line()}") from None
                    if time.monotonic() > deadline:
                        raise OperationFailed("capture.template", "the template did not reach its boundary within "
                                              f"{BOUNDARY_TIMEOUT_S:.0f} s{self._last_log_line()}") from None
                    time.sleep(0.05)
            if status.get("abi") != self.placement_abi or status.get("state") != "boundary":
                raise OperationFailed("capture.template", f"the template answered {status}")
            span["preloaded"] = ",".join(self.preload)

    def check_no_nvidia_state(self) -> None:
        """Placement ABI 2: the image must not hold the capture host's NVIDIA userspace driver at all;
        ABI 1: it may map the driver's libraries, but no NVIDIA device may be open (CUDA or NVML started)."""
        assert self.engine is not None
        with self.step("capture.template_nvidia", "capture.template_nvidia") as span:
            pids = tree_pids(self.engine.pid)
            found = nvidia_userspace_state(pids)
            span["processes"] = len(pids)
            span["nvidia_libraries"] = sum(": /dev/nvidia" not in f for f in found)
            if self.placement_abi < 2:
                found = [f for f in found if ": /dev/nvidia" in f]
            if found:
                advice = ("preload less, or capture a placement-ABI-1 template (--placement-abi 1: restorable under "
                          "this NVIDIA driver only)" if self.placement_abi >= 2 else "preload less")
                raise OperationFailed("capture.template_nvidia", f"the placement-ABI-{self.placement_abi} template holds "
                                      f"NVIDIA driver state ({len(found)}: {'; '.join(found[:3])}): a module in "
                                      f"--preload / {PRELOAD_ENV} loaded {'the driver' if self.placement_abi >= 2 else 'a device'} "
                                      f"at import; {advice}")

    def dump(self) -> None:
        engine = self.engine
        assert isinstance(engine, EngineProcess)
        with self.step("capture.criu_dump", "capture.criu_dump") as span:
            self.snapshotter = CriuSnapshotter(options=SnapshotOptions(tcp="none"))  # no TCP socket before the engine
            result = self.snapshotter.dump(engine.pid, self.artifact.images(self.unit.unit_id), owned_root=self.artifact.root)
            self.dumped = True
            engine.process.wait(timeout=30)  # reaped: its restore reuses the pid
            span["image_bytes"] = result.image_bytes
        self.context.progress(f"dumped the template ({len(result.pids)} processes, {result.image_bytes / 2**20:.1f} MiB)")

    def start_from_image(self) -> None:
        """The template restored from the capsule's own image and placed as the capture host's engine."""
        assert self.engine is not None
        control = self.engine.control
        with self.step("capture.template_restore", "capture.template_restore") as span:
            state_root().mkdir(parents=True, exist_ok=True, mode=0o700)
            self.capture_state = Path(tempfile.mkdtemp(prefix="capture-", dir=state_root()))
            self.context.hand_over.claim(self.capture_state)  # (removed at the end; what a failure leaves is the owner's)
            self.engine = _restore_template(self.artifact, self.unit.unit_id, self.artifact.images(self.unit.unit_id),
                                            control, self.capture_state)
            span["pid"] = self.engine.pid
            # Held to the end of the capture: the engine dies with this launcher.
            self.template_link = TemplateClient(self.template_control).place(
                PlacementRecord(abi=self.placement_abi).to_json_value())
        self.context.progress(f"template restored and placed; {self.command[0]} starting")

    def _close_link(self) -> None:
        if self.template_link is not None:
            self.template_link.close()

    def _remove_capture_state(self) -> None:
        if self.capture_state is not None:
            shutil.rmtree(self.capture_state, ignore_errors=True)

    def keep_engine_log(self) -> None:
        """The engine's startup, logged into the state directory's copy of the log, appended to the
        artifact's (a restore copies only the bytes the template had written, whatever follows)."""
        if not isinstance(self.engine, RestoredTree):
            return
        captured = self.artifact.log_path(self.unit.unit_id)
        try:
            with open(self.engine.log_path, "rb") as source, open(captured, "ab") as target:
                source.seek(target.tell())
                while block := source.read(1 << 20):
                    target.write(block)
        except OSError as exc:
            self.context.warn(f"the engine's capture log stays in {self.engine.log_path}: {exc}")

    def note_gpus(self) -> None:
        """The GPUs the capture's engine used (for the descriptor's platform record; the image holds none)."""
        assert self.engine is not None
        if gpu_processes(tree_pids(self.engine.pid)):
            self.gpus = cuda_devices()
            check_driver_floor(self.context, "n580", nvidia_kernel_driver() or "0", "capture.driver_floor")

    def activation_metadata(self) -> ActivationMetadata:
        metadata = super().activation_metadata()
        return metadata.model_copy(update={
            "root_pid": self.template_pid, "gpu_pids": [], "criu_tcp": "none",
            "template": TemplateRecord(control=self.template_control, placement_abi=self.placement_abi, preload=self.preload,
                                       command=self.command, nvidia_driver=nvidia_kernel_driver()),
        })


def template_placement(context: OperationContext, artifact: ArtifactDir, descriptor: ArtifactDescriptor,
                       capsule: CapsuleManifest, sources: dict[int, WeightSource], agent_control: str,
                       serving_port: int) -> PlacementRecord:
    """What this restore hands the template, checked against its placement ABI (``admission.placement``):
    the serving port (:attr:`~coldsnap.activation.restore_inputs.RestoreInputs.serving_port`), the request's environment (``CUDA_VISIBLE_DEVICES`` there selects the GPU), a fresh
    agent socket, and the native pack the engine hydrates at load time (none for a recovery restore: the
    engine loads its safetensors itself)."""
    template = capsule.metadata.template
    if template is None:
        raise OperationFailed("admission.capsule", "an n580 artifact whose capsule records no template")
    unit, worker = context.request.units[0], descriptor.units[0].workers[0]
    env = {**unit.env, CONTROL_ENV: agent_control}
    if sources[worker.rank] == "native" and worker.payload is not None:
        env.update({NATIVE_PACK_ENV: str(artifact.root / worker.payload.path), WEIGHTS_MODE_ENV: "native"})
    else:
        env[WEIGHTS_MODE_ENV] = "recovery"
    env.pop(PRELOAD_ENV, None)
    env.pop(PLACEMENT_ABI_ENV, None)
    if context.request.api_key_file is not None:  # its gate built held: nothing served before the key is in
        env[KEY_GATE_HELD_ENV] = "1"
    if context.request.policy.graphs.mode == "recreate":  # n580's default: eager first, graphs after readiness
        env.setdefault(GRAPHS_ENV, GRAPHS_AFTER_READY)
    if template.placement_abi not in PLACEMENT_ABIS:
        raise OperationFailed("admission.placement", f"the template speaks placement ABI {template.placement_abi}; this "
                              f"build speaks {', '.join(map(str, PLACEMENT_ABIS))}")
    try:
        record = PlacementRecord(abi=template.placement_abi, serving_port=serving_port,
                                 visible_devices=env.pop("CUDA_VISIBLE_DEVICES", None), env=env)
        check_placement_abi(template.placement_abi, record, template.nvidia_driver, nvidia_kernel_driver())
    except (ValueError, PlacementRefused) as exc:  # (a pydantic ValidationError is a ValueError)
        raise OperationFailed("admission.placement", str(exc)) from None
    return record


class TemplateRestore(RestoreSequence):
    """n580's restore: the template restored by CRIU, placed, and the engine's own startup proven by the canary."""

    def __init__(self, plan: RestorePlan, placement: PlacementRecord):
        super().__init__(plan)
        self.placement = placement
        self.agent_control = placement.env[CONTROL_ENV]
        assert plan.metadata.template is not None and plan.replica is not None
        self.template = plan.metadata.template
        assert plan.replica.template_control is not None
        self.template_control = plan.replica.template_control
        self.tree: RestoredTree | None = None
        self.link: TemplateLink | None = None  # until the agent's lease holds the engine

    def release(self) -> None:
        if self.link is not None:
            self.link.close()

    def restore_tree(self) -> None:
        with self.step(f"{self.op}.criu_restore", "restore.criu") as span:
            state_dir = self.state_dir()
            span["state_dir"] = str(state_dir)
            self.tree = _restore_template(self.plan.artifact, self.plan.unit.unit_id, self.replica_images(state_dir),
                                          self.agent_control, state_dir)
            self.held.restored_pid = span["pid"] = self.tree.pid
        self.plan.context.progress(f"template restored (pid {self.tree.pid})")

    def place(self) -> None:
        with self.step(f"{self.op}.place", "restore.place") as span:
            try:
                self.link = TemplateClient(self.template_control).place(self.placement.to_json_value())
            except ValueError as exc:  # refused, or not a template's answer
                raise OperationFailed("restore.place", str(exc)) from None
            span["serving_port"] = self.plan.serving_port
            if self.placement.visible_devices is not None:
                span["visible_devices"] = self.placement.visible_devices
        self.plan.context.progress(f"placed on port {self.plan.serving_port}"
                              + (f", GPU {self.placement.visible_devices}" if self.placement.visible_devices else "")
                              + f"; {self.template.command[0]} starting")

    def wait_for_engine(self) -> None:
        """The engine's startup: its agent answers (the lease binds the tree to this launcher from then
        on), then its HTTP server."""
        tree = self.tree
        assert tree is not None
        timeout = READY_TIMEOUT_S  # as long as a capture waits for the engine
        with self.step(f"{self.op}.engine_start", "restore.engine_start") as span:
            try:
                status = wait_for_agent(self.agent_control, tree.alive, timeout)
                self.held.lease = Lease([rank_control(self.agent_control, rank) for rank in range(status.world_size)])
                assert self.link is not None
                self.link.handover()  # the lease holds the engine from here
                wait_for_http(self.plan.serving_port, tree.alive, timeout)
            except LaunchError as exc:
                tail = tree.log_tail(1)
                raise OperationFailed("restore.engine_start", f"{exc}{f' | engine log: {tail}' if tail else ''}") from None
            span["ranks"] = status.world_size


# The n580 driver: its steps, in order (the registry: :mod:`coldsnap.activation.drivers`).
CAPTURE_STEPS = ("launch", "wait_for_boundary", "check_no_nvidia_state", "dump", "start_from_image", "wait_until_ready",
                 "record_canary", "prepare_ranks", "note_gpus", "commit")
"""The template dumped before any of the engine runs; then restored and placed once to prove it, record the
canary and write the native pack (the commit is not checked again: the capture restored it already)."""
RESTORE_STEPS = (Step(TemplateRestore.restore_tree), Step(TemplateRestore.place), Step(TemplateRestore.wait_for_engine),
                 Step(RestoreSequence.install_served_key), Step(RestoreSequence.check_canary))


def capture(context: OperationContext, artifact: ArtifactDir, ready_timeout: float, check_restore: object) -> OperationOutcome:
    return TemplateCapture(context, artifact, ready_timeout).run(CAPTURE_STEPS)


def admit_placement(context: OperationContext, artifact: ArtifactDir, admitted: Admitted) -> PlacementRecord:
    """What the template will be handed, checked before anything starts (``admission.placement``)."""
    with context.timer.span("restore.admission.placement"):
        return template_placement(context, artifact, admitted.descriptor, admitted.capsule, admitted.sources,
                                  admitted.replica.controls[0], admitted.inputs.serving_port)


def restore(context: OperationContext, artifact: ArtifactDir, admitted: Admitted, placement: PlacementRecord
            ) -> OperationOutcome:
    assert placement.serving_port is not None  # (the restore's: admit_placement put it there)
    plan = RestorePlan.of(context, artifact, admitted.descriptor, admitted.capsule, admitted.sources, admitted.replica,
                          serving_port=placement.serving_port)
    return TemplateRestore(plan, placement).run(RESTORE_STEPS)

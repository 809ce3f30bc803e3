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
"""

from __future__ import annotations

import errno
import functools
import os
import platform
import socket
import time
from pathlib import Path
from typing import Any, Callable, ContextManager, Literal, Sequence

from coldsnap.activation.artifact_dir import ArtifactDir, external_record_dir, file_ref
from coldsnap.activation.canary import Canary, ask_canary
from coldsnap.activation.canary_probes import ProbeAnswer, bits_of, probe_plan
from coldsnap.activation.engine_process import (AgentMissing, EngineProcess, LaunchError, ServingTree, wait_for_agent,
                                                wait_for_http)
from coldsnap.activation.ranks import ActivationCoordinator, call_every_rank, rank_prefix
from coldsnap.activation.reference_check import (REFERENCE_ENV, ReferenceAnswers, ReferenceMode, ask_probes, ask_reference,
                                                 reference_mode, reference_plan)
from coldsnap.activation.units import artifact_request, selected_unit
from coldsnap.agent.client import AgentClient, AgentError, KeyGateError, KeyGateMissing, key_gate
from coldsnap.agent.protocol import Prepare, PrepareReply, StatusReply, rank_control
from coldsnap.contracts.artifact import (ArtifactDescriptor, CanaryProbe, CanaryRecord, EnvironmentRecord, PinnedFile,
                                        PlatformRecord, ReferenceRecord, UnitRecord, WorkerRecord)
from coldsnap.contracts.capsule import ActivationMetadata, GpuProcessMemory, RegionRecord, WorkerActivation
from coldsnap.contracts.base import decode_document
from coldsnap.contracts.canonical import canonical_json
from coldsnap.contracts.profiles import resolve_request
from coldsnap.contracts.request import OperationRequest
from coldsnap.contracts.layout import SemanticManifest
from coldsnap.activation.qualification import check_driver_floor
from coldsnap.host import nvidia_kernel_driver
from coldsnap.payload.validation import hash_and_record
from coldsnap.operation import OperationContext, OperationFailed, OperationOutcome, step
from coldsnap.progress import PhaseProgress
from coldsnap.snapshot.criu import CriuSnapshotter
from coldsnap.snapshot.criu_binary import CriuError
from coldsnap.snapshot.criu_options import SnapshotOptions
from coldsnap.snapshot.cuda_checkpoint import CudaCheckpointError, TreeCheckpoint, cuda_devices, gpu_processes
from coldsnap.snapshot.host_files import read_only_mtimes
from coldsnap.snapshot.nvml import NvmlError, process_memory
from coldsnap.snapshot.process_tree import (anonymous_bytes, bound_socket_files, kill_tree, remove_socket_files,
                                            resident_bytes, socket_files_in, tcp_connections, tree_pids)
from coldsnap.snapshot.moved_sockets import probe_path_sockets
from coldsnap.secrets.engine_env import engine_environment
from coldsnap.secrets.served_key import served_key_in_command
from coldsnap.settings import SETTINGS

UNIT_BARRIERS = {"wait_until_ready": "ready", "dump": "dumped"}
"""One unit of several: after these steps it waits for every unit (``capture.units.<barrier>``): every
engine serves before unit 0 asks the canary; every tree is dumped before any restores its check."""

RESTORE_CANARY_TOKENS = 2
"""Tokens a restore generates beside the prompt check: the first comes from the prefill, the second from
one decode step (KV cache read back, the decode CUDA graph replayed)."""

__all__ = ["AGENT_AFTER_HTTP_S", "CaptureSequence", "CheckRestore", "READY_TIMEOUT_S", "VERIFY_ENV", "port_taken",
           "verify_at_capture"]

CheckRestore = Callable[[OperationContext, ArtifactDir], OperationOutcome]
"""Restore an artifact (seen through its pending descriptor) as ``coldsnap restore`` would."""

READY_TIMEOUT_S = 900.0

VERIFY_ENV = "COLDSNAP_CAPTURE_VERIFY"


def verify_at_capture() -> bool:
    """Whether a capture restores its capsule once before committing it (default yes; ``--no-verify``: no)."""
    return SETTINGS.flag(VERIFY_ENV)

STOPPED_WITHIN_S = 30.0
"""How long a stopped start (the reference's, or an engine the reference check starts again) may take to give
its GPU memory and the serving port back."""

AGENT_AFTER_HTTP_S = 60.0
"""How long a capture waits for the coldsnap agent once the engine's HTTP port answers (``capture.agent``
after that). An engine starts its agent while it loads the model, before its HTTP server comes up, so
an HTTP server without an agent is an engine running without coldsnap, and no wait would bring one."""

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


def _probe_record(answer: ProbeAnswer) -> CanaryProbe:
    """A probe's answer as the descriptor keeps it (each logprob as its IEEE bits)."""
    return CanaryProbe(prompt_ids=answer.prompt_ids, token_ids=answer.token_ids,
                       logprob_bits=[bits_of(x) for x in answer.logprobs])


class CaptureSequence:
    """The steps of one capture, each its own method, span and error code (:meth:`step`), and one
    :meth:`unwind` for every failure: the engine killed, everything the capture created in the output
    directory removed (a full disk must not stay full), the engine's last lines shown."""

    def __init__(self, context: OperationContext, artifact: ArtifactDir, ready_timeout: float,
                 check_restore: "CheckRestore | None" = None):
        """``check_restore``: how the capture restores its own capsule before committing it (the lifecycle's
        restore, passed in: this module does not import it back)."""
        self.check_restore = check_restore
        self.context = context
        self.request = context.request
        self.timer = context.timer
        self.artifact = artifact
        self.units = context.units  # one unit of several: its seat at the activation's coordinator
        self.index = selected_unit(self.request) or 0
        self.unit = self.request.units[self.index]
        self.workers = sorted(self.unit.workers, key=lambda w: w.rank)
        self.world = sum(len(u.workers) for u in self.request.units)  # the engine's ranks, over every unit
        self.ready_timeout = ready_timeout
        self.agent_after_http = AGENT_AFTER_HTTP_S
        self.before: set[str] | None = None  # the output directory's entries before (None: it did not exist)
        self.engine: ServingTree | None = None
        self.dumped = False
        self.engine_tmp: Path | None = None  # the engine's temporary folder and the sockets it held before (launch)
        self.engine_tmp_sockets: set[Path] = set()
        self.controls: list[str] = []
        self.statuses: list[StatusReply] = []
        self.canary: Canary | None = None
        self.probes: list[CanaryProbe] = []
        self.prepared: list[PrepareReply] = []
        self.gpu_pids: list[int] = []
        self.gpus: list[dict[str, Any]] = []
        self.snapshotter: CriuSnapshotter | None = None
        self.criu_tcp: Literal["established", "none"] = "none"
        self.serving_gpu_bytes: dict[str, dict[int, int]] = {}  # GPU UUID → pid → bytes while serving
        self.gpu_memory: list[GpuProcessMemory] = []
        self.output_ready = False  # the output directory made and its earlier entries noted (first start)
        # The reference check (start_reference, check_reference): the plain start's answers, the captured
        # engine's, and what the descriptor records
        self.reference_mode: ReferenceMode = "none"
        self.reference_note: str | None = None
        self.reference_engine: EngineProcess | None = None
        self.reference_answers: ReferenceAnswers | None = None
        self.captured_answers: ReferenceAnswers | None = None
        self.plain_starts = 0
        self.capture_starts = 0
        # the command's environment: the launcher's less its secrets and coldsnap's own settings
        self.engine_env = engine_environment(self.unit.env, self.unit.pass_env)

    @property
    def port(self) -> int:
        """The unit's serving port; a unit of several that serves nothing has the activation's (unit 0's),
        which names its replicas and moves its ports by the activation's one generation."""
        port = self.unit.serving_port or self.request.units[0].serving_port
        assert port is not None  # checked before the sequence
        return port

    @property
    def serves(self) -> bool:
        return self.unit.serving_port is not None

    def step(self, span: str, code: str) -> ContextManager[dict[str, str | int | bool]]:
        """One step (:func:`coldsnap.operation.step`): a failure of what it calls is reported with its
        code and the engine's last log line."""
        return step(self.timer, span, code, (LaunchError, AgentError, CriuError, CudaCheckpointError, OSError, ValueError),
                    lambda exc: f"{exc}{self._last_log_line()}")

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

    def _last_log_line(self, lines: int = 1) -> str:
        """The engine log's last ``lines`` non-blank lines, for a receipt's message."""
        tail = self.engine.log_tail(lines + 10) if self.engine is not None else ""
        last = [line.strip() for line in tail.splitlines() if line.strip()][-lines:]
        return f" | engine log: {' | '.join(last)}" if last else ""

    def record_canary(self) -> None:
        """The canary's answer, and where the engine gives them, its prefill's top-1 predictions at every
        prompt position: a restore then checks those plus the first :data:`RESTORE_CANARY_TOKENS` tokens."""
        if self.units is not None and self.index != 0:  # unit 0 serves and asks; the others follow its ranks
            with self.step("capture.canary", "capture.canary"):
                shared = self.units.get("capture/canary")
            self.canary = Canary(text=shared["text"], token_ids=shared["token_ids"], seconds=0.0,
                                 prompt_argmax=shared["prompt_argmax"])
            self.probes = [CanaryProbe.model_validate(p) for p in shared["probes"]]
            return
        self._ask_canary()
        if self.units is not None:
            assert self.canary is not None
            self.units.put("capture/canary", {"text": self.canary.text, "token_ids": self.canary.token_ids,
                                              "prompt_argmax": self.canary.prompt_argmax,
                                              "probes": [p.to_json_value() for p in self.probes]})

    def _check_plan(self) -> tuple[tuple[int, int], ...]:
        """The probes the captured engine is asked: the restore's, and with the reference check its own after them."""
        return reference_plan(probe_plan()) if self.reference_mode == "plain" else probe_plan()

    def _ask_canary(self) -> None:
        """The canary, then the probes (:meth:`_check_plan`), one at a time: the same requests in the same order
        as the reference start was asked. The restore's probes are recorded for every restore to check."""
        validation = self.request.policy.validation
        assert validation.prompt is not None and validation.max_tokens is not None  # resolve_request fills both
        restore_lengths = {length for length, _ in probe_plan()}
        with self.step("capture.canary", "capture.canary") as span:
            self.canary = ask_canary(self.port, validation.prompt, validation.max_tokens, prompt_argmax=True)
            span["tokens"] = len(self.canary.token_ids)
        self.context.progress(f"canary answered {self.canary.text!r} ({len(self.canary.token_ids)} tokens)")
        with self.step("capture.canary_probes", "capture.canary") as span:
            answers = self.captured_answers = ReferenceAnswers(self.canary, ask_probes(self.port, self._check_plan()))
            self.probes = [_probe_record(answer) for (length, _), answer in answers.probes
                           if answer is not None and length in restore_lengths]
            lengths = [str(len(p.prompt_ids)) for p in self.probes]
            span["probes"] = ",".join(lengths)
        if self.probes:
            self.context.progress(f"canary probes recorded: {len(self.probes)} prompts of {', '.join(lengths)} tokens, "
                                  "ids and logprobs")
        else:
            self.context.progress("no canary probes: the engine gave no token ids and logprobs for token-id prompts")

    # The reference check (coldsnap.activation.reference_check) --------------------------------------------

    def _reference_mode(self) -> tuple[ReferenceMode, str | None]:
        """This capture's reference mode, and why it is ``none`` where it is."""
        if self.units is not None:
            return "none", ("one launch unit of several: the check would need every unit's plain start at once, "
                            "which this build does not run")
        try:
            mode = reference_mode(self.request.engine)
        except ValueError as exc:
            raise OperationFailed("capture.reference", f"{REFERENCE_ENV}: {exc}") from None
        if mode == "plain":
            return mode, None
        if SETTINGS.text(REFERENCE_ENV):
            return mode, "skipped: --reference none"
        return mode, (f"skipped: not on by default for {self.request.engine} (coldsnap's own deterministic workload); "
                      "--reference plain runs it")

    def start_reference(self) -> None:
        """The plain start of the command (:mod:`coldsnap.activation.reference_check`), before the engine that
        is captured: started as a user starts it, asked the canary and the check's probes, stopped. Skipped,
        and recorded as skipped, with ``--reference none`` and for one launch unit of several."""
        with self.step("capture.reference_start", "capture.reference") as span:
            self.reference_mode, self.reference_note = self._reference_mode()
            span["mode"] = self.reference_mode
            if self.reference_mode == "none":
                self.context.progress(f"reference check {self.reference_note}")
                return
            self.reference_answers = self._plain_start_answers(span)

    def _plain_start_answers(self, span: dict[str, str | int | bool]) -> ReferenceAnswers:
        """One plain start of the command: ready (HTTP ``/health``), asked the check's requests, stopped (its GPU
        memory and the port free again before anything else starts)."""
        validation, unit = self.request.policy.validation, self.unit
        assert validation.prompt is not None and validation.max_tokens is not None  # resolve_request fills both
        self._prepare_output()
        plan = self._check_plan()
        which = "a second plain start" if self.plain_starts else "a plain start"
        self.context.progress(f"reference check: {which} of the command (no coldsnap agent) first; the engine captured "
                              f"after it must give its canary and {len(plan)} probes back exactly, ids and logprob bits")
        started = time.perf_counter()
        engine = self.reference_engine = EngineProcess(list(unit.command), self.artifact.reference_log_path(unit.unit_id),
                                                       self.engine_env.variables, agent=False)
        self.plain_starts += 1
        self._note_environment(span)
        try:
            wait_for_http(self.port, engine.alive, self.ready_timeout)
            ready_s = time.perf_counter() - started
            self.context.progress(f"reference start (pid {engine.pid}) ready after {ready_s:.1f} s; asking it the canary "
                                  f"and {len(plan)} probes")
            answers = ask_reference(self.port, validation.prompt, validation.max_tokens, plan)
        except (LaunchError, OSError) as exc:
            ended = engine.ended()
            # (its log goes with the output directory: its last lines to the progress stream first)
            self.context.progress(f"the plain reference start failed; its last lines:\n{engine.log_tail(20)}")
            if isinstance(exc, LaunchError):
                raise OperationFailed("capture.reference", f"the plain reference start of the command: {exc}"
                                      f"{f' (the command {ended})' if ended else ''}{self._reference_log_tail()}") from None
            raise OperationFailed("capture.reference", "the plain reference start did not answer the canary or a "
                                  f"probe: {exc}{self._reference_log_tail()}") from None
        finally:
            self._stop_reference()
        span[f"plain_start_{self.plain_starts}_ready_ns"] = int(ready_s * 1e9)
        span[f"plain_start_{self.plain_starts}_ns"] = int((time.perf_counter() - started) * 1e9)
        return answers

    def _reference_log_tail(self) -> str:
        engine = self.reference_engine
        last = [line.strip() for line in (engine.log_tail(13) if engine else "").splitlines() if line.strip()][-3:]
        return f" | reference log: {' | '.join(last)}" if last else ""

    def _stop_reference(self) -> None:
        """The reference start stopped (SIGTERM, then SIGKILL), its GPU memory given back and the port free again."""
        engine = self.reference_engine
        if engine is not None and engine.alive():
            self._stop_tree(engine, graceful=True)
        self.sweep_engine_tmp()

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

    def check_reference(self) -> None:
        """The captured engine's answers must equal the plain start's, every token id and logprob bit. On a
        mismatch, once more: a second plain start (which must agree with one of the two: else plain starts of
        the command disagree on this host, and nothing can be proved), then the engine again, which must answer
        as that second plain start did. ``capture.reference`` otherwise, nothing committed."""
        if self.reference_mode == "none":
            return
        with self.step("capture.reference", "capture.reference") as span:
            assert self.reference_answers is not None and self.captured_answers is not None
            difference = self.reference_answers.difference(self.captured_answers, "the plain start", "the captured engine")
            span["matched_first"] = difference is None
            if difference is not None:
                span["first_difference"] = difference[:500]
                self._check_reference_again(difference, span)
            answers = self.reference_answers
            span.update(plain_starts=self.plain_starts, capture_starts=self.capture_starts,
                        probes=len(answers.answered()), answers_sha256=answers.sha256())
        probes = (f" and {len(answers.answered())} probes" if answers.answered() else
                  " (it answered no probe: no token ids and logprobs for token-id prompts)")
        self.context.progress(f"reference check passed: the captured engine answered a plain start's canary{probes} "
                              "exactly, token ids and logprob bits")

    def _check_reference_again(self, difference: str, span: dict[str, str | int | bool]) -> None:
        first_plain, first_engine = self.reference_answers, self.captured_answers
        assert first_plain is not None and first_engine is not None and self.engine is not None
        self.context.progress(f"reference check: the captured engine answers differently from the plain start: "
                              f"{difference}; trying once more (one more plain start, then the engine again)")
        self._stop_tree(self.engine)
        second = self._plain_start_answers(span)
        against_plain = first_plain.difference(second, "the first plain start", "the second plain start")
        against_engine = first_engine.difference(second, "the first engine start", "the second plain start")
        if against_plain is not None and against_engine is not None:
            raise OperationFailed("capture.reference", "plain starts of the command disagree on this host, so no "
                                  f"capture can be proved equal to one: {against_plain}; and the first captured engine "
                                  f"differed too ({difference}). Nothing was committed; `coldsnap capture --reference "
                                  "none` captures without the check")
        deviant = "the first plain start" if against_plain is not None else "the first start of the captured engine"
        self.reference_note = f"retried: {deviant} answered unlike the other starts ({difference})"
        self.reference_answers = second
        self.launch()
        self.wait_until_ready()
        self.record_canary()
        assert self.captured_answers is not None
        again = second.difference(self.captured_answers, "the plain start", "the captured engine")
        if again is not None:
            raise OperationFailed("capture.reference", "the captured engine answers differently from a plain start of "
                                  f"the same command, twice: {again}. Nothing was committed")

    def _reference_record(self) -> ReferenceRecord:
        """What the descriptor says of the check."""
        answers = self.reference_answers
        if self.reference_mode == "none" or answers is None:
            return ReferenceRecord(mode="none", note=self.reference_note)
        return ReferenceRecord(mode="plain", note=self.reference_note, plain_starts=self.plain_starts,
                               capture_starts=self.capture_starts, canary_token_ids=answers.canary.token_ids,
                               probes=[_probe_record(a) for a in answers.answered()],
                               answers_sha256=answers.sha256())

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

    def activation_metadata(self) -> ActivationMetadata:
        """The capsule's activation metadata: the tree, each rank's agent and memory, how it was dumped."""
        engine, snapshotter = self.engine, self.snapshotter
        assert engine is not None and snapshotter is not None
        return ActivationMetadata(
            control=engine.control, serving_port=self.port, root_pid=engine.pid,
            workers=[WorkerActivation(rank=w.rank, control=c, pid=s.pid, layout=s.layout, layout_digest=p.layout_digest,
                                      regions={tag: RegionRecord(**r.model_dump()) for tag, r in p.regions.items()},
                                      graphs_released=p.graphs_released)
                     for w, c, s, p in zip(self.workers, self.controls, self.statuses, self.prepared)],
            criu_options=snapshotter.options.args(), criu_tcp=self.criu_tcp,
            gpu_pids=self.gpu_pids, gpu_uuids=[d["uuid"] for d in self.gpus],
            host_file_mtimes_ns=read_only_mtimes(self.artifact.images(self.unit.unit_id)), gpu_memory=self.gpu_memory,
            address=self.units.address if self.units is not None else None,
        )

    def commit(self, verify: bool = False) -> None:
        """The capsule manifest, the resolved request, then the descriptor, written atomically last; with
        ``verify``, as a pending descriptor first, committed by one rename once the capture's own restore
        of it served the canary's tokens (:meth:`verify`)."""
        artifact, request_, engine, canary, snapshotter = self.artifact, self.request, self.engine, self.canary, self.snapshotter
        assert engine is not None and canary is not None and snapshotter is not None
        with self.step("capture.commit", "capture.commit"):
            capsule = artifact.write_capsule(self.unit.unit_id, self.activation_metadata())
            worker_records = []
            for w, p in zip(self.workers, self.prepared):
                if p.residual is None:
                    raise OperationFailed("capture.residual", f"the agent of rank {w.rank} wrote no residual pack")
                worker_records.append(WorkerRecord(
                    worker_id=w.worker_id, rank=w.rank, layout_digest=p.layout_digest,
                    residual=file_ref(artifact, Path(p.residual.path), p.residual.sha256),
                    payload=file_ref(artifact, Path(p.payload.path), p.payload.sha256) if p.payload else None,
                    recovery=(pinned := self.pin_recovery(w.rank, p)),
                    recovery_plan=(file_ref(artifact, Path(p.recovery_plan.path), p.recovery_plan.sha256)
                                   if pinned and p.recovery_plan and p.recovery_gap else None),
                    recovery_gap=(file_ref(artifact, Path(p.recovery_gap.path), p.recovery_gap.sha256)
                                  if pinned and p.recovery_plan and p.recovery_gap else None)))
            recorded = artifact_request(request_)  # the whole activation, no unit's selection
            artifact.request_path.write_bytes(canonical_json(recorded.to_json_value()) + b"\n")
            unit_record = UnitRecord(unit_id=self.unit.unit_id, capsule=capsule, workers=worker_records,
                                     environment=EnvironmentRecord(withheld=list(self.engine_env.withheld),
                                                                   held=list(self.engine_env.held)))
            records = [unit_record]
            if self.units is not None:  # every unit's record, in one descriptor: unit 0's, committed by each unit
                records = [UnitRecord.model_validate(r)
                           for r in self.units.every_unit("capture/record", unit_record.to_json_value())]
            descriptor = (self._descriptor(recorded, records) if self.units is None or self.index == 0 else
                          decode_document(ArtifactDescriptor, self.units.get("capture/descriptor"), "unit 0's descriptor"))
            if self.units is not None and self.index == 0:
                self.units.put("capture/descriptor", descriptor.to_json_value())
            elif descriptor.units != records:
                raise OperationFailed("capture.commit", "unit 0's descriptor does not bind this unit's capsule")
            target = artifact.pending() if verify else artifact
            target.commit(descriptor)
        if verify:
            self.verify(target)
            self._units_verified()
            artifact.promote(target)

    def _descriptor(self, recorded: OperationRequest, records: list[UnitRecord]) -> ArtifactDescriptor:
        """The artifact descriptor of this capture (one unit's, or every unit's records from unit 0)."""
        request_, canary, snapshotter = self.request, self.canary, self.snapshotter
        assert canary is not None and snapshotter is not None
        driver = nvidia_kernel_driver()
        return ArtifactDescriptor(
            format=9,
            artifact_id=f"{request_.operation_id}",
            created_unix_ns=time.time_ns(),
            engine=request_.engine,
            snapshot_driver=request_.snapshot_driver,
            request_sha256=recorded.canonical_sha256(),
            semantic_manifest_sha256=SemanticManifest.from_request(recorded).canonical_sha256(),
            model=request_.model,
            graph_policy=request_.policy.graphs.mode or "retain",
            platform=PlatformRecord(
                arch=platform.machine(), kernel=platform.release(), nvidia_driver=driver,
                nvidia_driver_floor=int(driver.split(".")[0]) if driver else None,
                gpu_model=self.gpus[0]["name"] if self.gpus else None,
                compute_capability=self.gpus[0]["compute_capability"] if self.gpus else None,
                criu_version=".".join(map(str, snapshotter.criu.version().numbers)),
            ),
            canary=CanaryRecord(prompt=self.request.policy.validation.prompt or "", expected_response=canary.text,
                                token_ids=canary.token_ids, prompt_argmax=canary.prompt_argmax,
                                restore_tokens=(min(RESTORE_CANARY_TOKENS, len(canary.token_ids))
                                                if canary.prompt_argmax and canary.token_ids else None),
                                probes=self.probes),
            reference=self._reference_record(),
            units=records,
        )

    def _units_verified(self) -> None:
        """One unit of several commits only once every unit's check restore served (all or none)."""
        if self.units is not None:
            with self.timer.span("capture.units.verified"):
                self.units.barrier("capture.verified")

    def verify(self, pending: ArtifactDir) -> None:
        """Restore the capsule once, as ``coldsnap restore`` of it would (same request, same weights policy,
        the captured port), prove it with the canary, then stop it: a capsule that cannot restore is never
        committed (``capture.verify``). ``COLDSNAP_CAPTURE_VERIFY=0`` (``capture --no-verify``) skips it."""
        assert self.check_restore is not None, "a verified commit needs the lifecycle's restore"
        document = self.request.to_json_value()
        document.update(operation="restore", operation_id=f"{self.request.operation_id}-check", prepare_only=False)
        request = resolve_request(decode_document(OperationRequest, canonical_json(document), "the capture's check"))
        check = self.context.nested(request)
        with self.timer.span("capture.verify") as span:
            try:
                with check.held:
                    self.check_restore(check, pending)
            except OperationFailed as exc:
                raise OperationFailed("capture.verify", f"the capsule did not restore: {exc.code}: {exc.message}") from None
            finally:
                restored = [s.attributes.get("pid") for s in check.timer.envelope().spans if s.name.endswith(".criu_restore")]
                if restored and isinstance(restored[0], int):
                    kill_tree(restored[0])
                self.context.warnings.extend(f"capture's check restore: {w}" for w in check.warnings)
            span.update({f"restore.{s.name.split('.', 1)[1]}_ns": s.duration_ns for s in check.timer.envelope().spans
                         if s.name.count(".") == 1 and s.duration_ns is not None})
        self.context.progress("the capture's own restore served the captured canary; committing")

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

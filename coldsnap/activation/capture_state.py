"""What one capture knows while its steps run (:class:`CaptureState`): the request and its unit, the engine
started, what each step found. The steps are :class:`~coldsnap.activation.capture_steps.CaptureSequence`'s; the
canary and the reference check (:mod:`~coldsnap.activation.capture_reference`) and the commit
(:mod:`~coldsnap.activation.capture_commit`) are its parts in modules of their own, each a subclass of this."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Literal

from coldsnap.activation.artifact_dir import ArtifactDir
from coldsnap.activation.canary import Canary
from coldsnap.activation.engine_process import EngineProcess, LaunchError, ServingTree
from coldsnap.activation.reference_check import ReferenceAnswers, ReferenceMode
from coldsnap.activation.units import selected_unit
from coldsnap.agent.client import AgentError
from coldsnap.agent.protocol import PrepareReply, StatusReply
from coldsnap.contracts.artifact import CanaryProbe, PinnedFile, ReferenceRecord
from coldsnap.contracts.capsule import GpuProcessMemory
from coldsnap.operation import OperationContext, OperationOutcome, step
from coldsnap.snapshot.criu import CriuSnapshotter
from coldsnap.snapshot.criu_binary import CriuError
from coldsnap.secrets.engine_env import engine_environment
from coldsnap.snapshot.cuda_checkpoint import CudaCheckpointError

__all__ = ["AGENT_AFTER_HTTP_S", "CaptureState", "CheckRestore"]

CheckRestore = Callable[[OperationContext, ArtifactDir], OperationOutcome]
"""Restore an artifact (seen through its pending descriptor) as ``coldsnap restore`` would."""

AGENT_AFTER_HTTP_S = 60.0
"""How long a capture waits for the coldsnap agent once the engine's HTTP port answers (``capture.agent``
after that). An engine starts its agent while it loads the model, before its HTTP server comes up, so
an HTTP server without an agent is an engine running without coldsnap, and no wait would bring one."""


class CaptureState:
    """The state of one capture, shared by its steps, and how a step runs (:meth:`step`)."""

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

    def _last_log_line(self, lines: int = 1) -> str:
        """The engine log's last ``lines`` non-blank lines, for a receipt's message."""
        tail = self.engine.log_tail(lines + 10) if self.engine is not None else ""
        last = [line.strip() for line in tail.splitlines() if line.strip()][-lines:]
        return f" | engine log: {' | '.join(last)}" if last else ""

    if TYPE_CHECKING:  # steps of CaptureSequence and its parts that the other parts call
        def launch(self) -> None: ...
        def wait_until_ready(self) -> None: ...
        def _prepare_output(self) -> None: ...
        def _note_environment(self, span: dict[str, str | int | bool]) -> None: ...
        def sweep_engine_tmp(self) -> None: ...
        def _stop_tree(self, tree: ServingTree, graceful: bool = False) -> None: ...
        def pin_recovery(self, rank: int, prepared: PrepareReply) -> list[PinnedFile] | None: ...
        def _reference_record(self) -> ReferenceRecord: ...

"""The launcher ↔ agent control protocol: the messages, their framing, and the failure codes.

One connection per command on the agent's unix socket (abstract when its name starts with ``@``): the
launcher sends one JSON line (with file descriptors as ``SCM_RIGHTS`` where a command hands memory
over), the agent may stream :class:`ProgressLine` lines, then answers one :class:`Reply` line. The
``lease`` command keeps its connection instead: the agent answers :class:`LeaseTaken` and holds it
until the launcher writes ``release`` (or dies, see :func:`coldsnap.agent.server.hold_lease`).

Every message decodes strictly (unknown fields and wrong types are refused), both ways: a launcher
and an agent from different builds fail on the first command with ``agent.command`` instead of
misreading each other. Failures cross the socket as :class:`AgentFailure` with a code from
:data:`FailureCode`, never as text for the other side to match.

This module imports only the standard library and pydantic: the launcher (``coldsnap.activation``)
uses it and :mod:`coldsnap.agent.client`, never the agent's server.
"""

from __future__ import annotations

import socket
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

__all__ = [
    "AgentFailure", "AgentState", "Command", "CoordinatorRef", "FailureCode", "Hydrated", "LeaseTaken", "PackRef",
    "Prefill", "PrefillReply", "Prepare", "PrepareReply", "ProgressLine", "ProtocolError", "RegionStatus", "Reply", "Resume", "ResumeReply",
    "Standby", "StandbyReply", "Status", "StatusReply", "TakeLease", "rank_control", "decode_command", "decode_reply", "encode",
    "receive_line", "MAX_FDS_PER_MESSAGE",
]

MAX_FDS_PER_MESSAGE = 200
"""File descriptors per ``sendmsg`` (the kernel's SCM_MAX_FD is 253, kept clear of); more travel in several messages."""

FailureCode = Literal[
    "agent.command",  # the command did not decode (unknown command, field or type: builds disagree)
    "agent.state",  # not allowed in the agent's state (prepare while prepared, resume while serving)
    "agent.drain",  # a request held the engine past the drain timeout
    "agent.memory",  # model memory: layout digest, adopted chunks, pack or safetensors hydration
    "agent.collectives",  # NCCL teardown or rebuild, or a rank's barrier
    "agent.permissions",  # the kernel refused CPU state features the process used before the snapshot
    "agent.internal",  # anything else: a bug or an engine hook's own failure (type and message say which)
]

AgentState = Literal["serving", "prepared", "standby"]
"""``serving`` until ``prepare``, ``prepared`` (memory released, collectives down) until ``resume``; a
restored process may be parked in ``standby`` first (collectives rebuilt, memory still released), which
``resume`` also leaves."""


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, defer_build=True)  # (built when first used)


# ---- commands ------------------------------------------------------------------------------------


class CoordinatorRef(Message):
    """Where a rank joins the activation's coordinator (multi-rank activations only)."""

    endpoint: str
    token: str  # hex
    world: int
    address: str | None = None
    """The rank's unit's address on the activation's network now (an activation of several units: where
    the rank's peers on other hosts reach it once it rebuilds its collectives); ``None``: unchanged."""


class Status(Message):
    command: Literal["status"] = "status"


class TakeLease(Message):
    """Keep this connection: while it is open and not released, the restored tree lives with the launcher."""

    command: Literal["lease"] = "lease"


class Prepare(Message):
    """Stop serving and release model memory for a snapshot."""

    command: Literal["prepare"] = "prepare"
    pack_dir: str | None
    """Write the payload and residual packs here; ``None`` writes none."""
    native: bool = True
    """Write the payload pack; False: only the residual (recovery replays the model's tensors)."""
    graph_policy: Literal["retain", "recreate"] = "retain"
    coordinator: CoordinatorRef | None = None


class Resume(Message):
    """Map the regions again, fill them, rebuild collectives and graphs, serve. The weights come from the
    chunks handed over with the command (``adopted``: tag → chunk count, descriptors in that order),
    else the payload pack (plus residual), else the safetensors files."""

    command: Literal["resume"] = "resume"
    layout_digest: str
    coordinator: CoordinatorRef | None = None
    payload: str | None = None
    residual: str | None = None
    safetensors: list[str] | None = None
    recovery_plan: str | None = None
    """With ``safetensors``: the plan that streams them into the layout, and its gap pack (both or neither)."""
    recovery_gap: str | None = None
    adopted: dict[str, int] | None = None
    staged: dict[str, int | float | bool | str] | None = None
    """What the launcher's staging measured, reported back in :class:`Hydrated`."""


class Standby(Message):
    """A restored process, CUDA restored, parks as a warm standby: its collectives are rebuilt now (and
    the graphs that held NCCL kernels captured again), its model memory stays released until ``resume``,
    and no launcher holds it meanwhile. The restore
    deadlines of a prepared process are replaced by ``ttl_s`` (None: none): past it, the process
    removes ``record`` (the launcher's standby registry entry) and stops its process group."""

    command: Literal["standby"] = "standby"
    ttl_s: int | None
    record: str | None = None
    coordinator: CoordinatorRef | None = None
    pin_payload: str | None = None
    """A GPU rank's payload pack to map and register as pinned host memory now, so that the wake's
    hydration from it is DMA copies (its pages stay locked in memory while the standby waits)."""


class Prefill(Message):
    """A standby whose wake is on its way: fill the weights from the pinned pack now, in the background
    (``resume`` of the same pack then takes them as they are). Answered at once. The wake's launcher
    sends it before its own start-up is done, with the standard library only (the line
    ``{"command":"prefill"}``): see :mod:`coldsnap.activation.early_wake`."""

    command: Literal["prefill"] = "prefill"


Command = Annotated[Union[Status, TakeLease, Prepare, Resume, Standby, Prefill], Field(discriminator="command")]

# ---- replies -------------------------------------------------------------------------------------


class RegionStatus(Message):
    backend: str
    device: int
    base: int
    size: int
    mapped: int
    high_water: int
    chunk_bytes: int


class StatusReply(Message):
    state: AgentState
    pid: int
    port: int | None
    rank: int
    world_size: int
    layout_digest: str
    layout: dict[str, Any]
    """The model memory layout (:class:`coldsnap.contracts.layout.MemoryLayout`'s JSON value)."""
    regions: dict[str, RegionStatus]


class PackRef(Message):
    path: str
    sha256: str
    size_bytes: int


class PrepareReply(Message):
    payload: PackRef | None = None
    residual: PackRef | None = None
    layout_digest: str
    seconds: dict[str, float]
    rss_bytes: int
    """The process's resident memory once model memory is gone: what its image will hold."""
    device_bytes: int
    """GPU memory torch's caching allocator holds once its cache was emptied (0 without CUDA torch)."""
    device_bytes_before_empty: int = 0
    """The same before the cache was emptied: what emptying it took out of the image."""
    device_bytes_allocated: int = 0
    """Of ``device_bytes``, what live tensors and CUDA-graph pools use."""
    regions: dict[str, RegionStatus]
    graphs_released: list[str]
    graph_pool_bytes: int = 0
    """Of ``device_bytes``, CUDA-graph private pools (kept while their graphs live; their free part is scratch)."""
    graph_pool_allocated_bytes: int = 0
    """Of ``graph_pool_bytes``, the blocks in use (graph outputs and what outlived the capture)."""
    region_pool_bytes: int = 0
    """Of ``device_bytes``, the segments coldsnap's regions serve (e.g. vLLM's graph pool in the ``cudagraph``
    region): unmapped before the checkpoint, so not in the image though torch still counts them."""
    stack_bytes: int = 0
    """The context's per-thread stack limit before the checkpoint (0: not lowered); resume sets it back."""
    local_memory_freed_bytes: int = 0
    """Device memory lowering that limit freed: local memory the checkpoint no longer copies."""
    device_used_bytes: int = 0
    """Device memory in use on this process's GPUs once all of the above ran, every process's (cuMemGetInfo)."""
    recovery_files: list[str] = []
    """The safetensors files the engine loaded its weights from (absolute paths; empty: none to pin)."""
    recovery_plan: PackRef | None = None
    """Where those files' bytes land unchanged in the layout (:mod:`coldsnap.hydrate.recovery_plan`)."""
    recovery_gap: PackRef | None = None
    """The payload's bytes the plan does not cover (residual format)."""


class Hydrated(Message):
    source: Literal["none", "native", "recovery"]
    """Where the weights came from: nothing to fill, a native pack (staged or read here), safetensors."""
    bytes: int = 0
    staged: bool = False
    """The launcher hydrated them during CRIU's restore and handed the memory over."""
    stats: dict[str, int | float | bool | str] = {}


class ResumeReply(Message):
    rank: int
    hydrate: Hydrated
    seconds: dict[str, float]
    graphs_recaptured: list[str]


class StandbyReply(Message):
    rank: int
    seconds: dict[str, float]
    pinned_bytes: int = 0
    """Bytes of the payload pack registered as pinned memory (0: none asked, or pinning failed: ``pin_error``)."""
    pin_error: str | None = None
    graphs_recaptured: list[str] = []
    """Graphs the snapshot dropped (they held NCCL kernels), captured again against the rebuilt collectives."""


class PrefillReply(Message):
    started: bool
    reason: str | None = None
    """Why not (not a standby, no pinned pack, started already)."""


class LeaseTaken(Message):
    leased: Literal[True] = True


class AgentFailure(Message):
    code: FailureCode
    type: str
    """The exception's class on the agent's side."""
    message: str


class Reply(Message):
    ok: bool
    reply: StatusReply | PrepareReply | ResumeReply | StandbyReply | PrefillReply | None = None
    failure: AgentFailure | None = None


class ProgressUpdate(Message):
    phase: str
    done: int
    total: int


class ProgressLine(Message):
    progress: ProgressUpdate


# ---- framing -------------------------------------------------------------------------------------


class ProtocolError(RuntimeError):
    """A line that is not a message of this protocol (the other side runs another build, or died)."""


# Built at the agent's first command (before any capture, so a restored agent has it); launchers never
# decode commands and never build it.
_COMMAND: TypeAdapter[Status | TakeLease | Prepare | Resume | Standby | Prefill] = TypeAdapter(
    Command, config=ConfigDict(defer_build=True))


def encode(message: Message) -> bytes:
    return message.model_dump_json().encode() + b"\n"


def decode_command(line: bytes) -> Status | TakeLease | Prepare | Resume | Standby | Prefill:
    try:
        return _COMMAND.validate_json(line)
    except ValidationError as exc:
        raise ProtocolError(_first_problem(exc)) from None


def decode_reply(line: bytes, expected: type[Message]) -> Reply:
    """The reply line, its ``reply`` checked to be an ``expected``."""
    try:
        reply = Reply.model_validate_json(line)
    except ValidationError as exc:
        raise ProtocolError(f"the agent's reply: {_first_problem(exc)}") from None
    if reply.ok and not isinstance(reply.reply, expected):
        raise ProtocolError(f"the agent answered {type(reply.reply).__name__}, not {expected.__name__}")
    if not reply.ok and reply.failure is None:
        raise ProtocolError("the agent failed without saying why")
    return reply


def _first_problem(exc: ValidationError) -> str:
    error = exc.errors()[0]
    where = ".".join(str(part) for part in error["loc"]) or "message"
    return f"{where}: {error['msg']}"


CONTROL_ENV = "COLDSNAP_CONTROL"
"""Set by ``coldsnap capture`` in the engine's environment: the control socket its agent listens at."""


def rank_control(control: str, rank: int) -> str:
    """The control socket of ``rank``: the engine's ``COLDSNAP_CONTROL`` for rank 0, suffixed for others."""
    return control if rank == 0 else f"{control}.rank{rank}"


def receive_line(connection: socket.socket) -> tuple[bytes, list[int]]:
    """One line and every file descriptor sent with it (SCM_RIGHTS, in order)."""
    data, fds = b"", []
    while b"\n" not in data:
        chunk, received, _, _ = socket.recv_fds(connection, 1 << 16, MAX_FDS_PER_MESSAGE)
        fds += received
        if not chunk:
            break
        data += chunk
    return data.split(b"\n", 1)[0], fds

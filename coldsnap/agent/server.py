"""Agent server (see the package docstring) and the launcher's client call."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from coldsnap.agent.memory import ModelMemory, timed as _timed
from coldsnap.agent.xstate import dynamic_permissions, request_permissions

if TYPE_CHECKING:
    from coldsnap.collective.group import DistributedState, Rendezvous

__all__ = ["AgentHooks", "AgentServer", "AgentError", "Lease", "hold_lease", "rank_control", "start_agent", "request"]

log = logging.getLogger(__name__)

Hook = Callable[[], None]


class AgentError(RuntimeError):
    """The agent refused or failed a command; the message is its own."""


@dataclass
class AgentHooks:
    """What an engine plugin adds around the memory work (each runs in the agent's thread)."""

    before_release: list[Hook] = field(default_factory=list)
    """After draining and the collectives' teardown, before the regions are unmapped (e.g. handing
    cached allocator blocks back)."""
    after_resume: list[Hook] = field(default_factory=list)
    """After hydration, KV remap and the collectives' rebuild, before graphs are recaptured."""
    release_graphs: Callable[[str], list[str]] | None = None
    """Given the graph policy (``retain`` | ``recreate``), drop the CUDA graphs that will not be kept and
    return their names. Graphs holding NCCL kernels are always dropped: a rebuilt communicator is a new
    one, and kernels captured against the old one must not replay. Runs before the teardown."""
    recapture_graphs: Callable[[], list[str]] | None = None
    """Capture again what ``release_graphs`` dropped (every rank at once: warm-ups run collectives)."""


def rank_control(control: str, rank: int) -> str:
    """The control socket of ``rank``: the engine's ``COLDSNAP_CONTROL`` for rank 0, suffixed for others."""
    return control if rank == 0 else f"{control}.rank{rank}"


def _address(control: str) -> str | bytes:
    return b"\0" + control[1:].encode() if control.startswith("@") else control


class AgentServer:
    def __init__(self, control: str, memory: ModelMemory, serving_lock: threading.Lock, port: int | None = None,
                 hooks: AgentHooks | None = None, rank: int = 0, world: int = 1,
                 collectives: "DistributedState | None" = None):
        if collectives is not None and (collectives.rank, collectives.world) != (rank, world):
            raise ValueError(f"collectives are rank {collectives.rank} of {collectives.world}, the agent {rank} of {world}")
        self.control = rank_control(control, rank)
        self.rank = rank
        self.world = world
        self.collectives = collectives
        self.graphs_released: list[str] = []
        self.memory = memory
        self.serving_lock = serving_lock
        self.port = port
        self.hooks = hooks or AgentHooks()
        self.state = "serving"
        self.on_lease_lost: Callable[[], None] = _stop_process_group  # what a lapsed restore lease does
        self._xstate = 0  # dynamic x86 state permissions recorded at prepare
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(_address(self.control))
        self._listener.listen(4)
        self._thread = threading.Thread(target=self._serve, name="coldsnap-agent", daemon=True)

    def start(self) -> "AgentServer":
        self._thread.start()
        return self

    def _serve(self) -> None:
        while True:
            connection, _ = self._listener.accept()
            with contextlib.ExitStack() as closing:
                closing.callback(connection.close)
                fds: list[int] = []
                try:
                    line, fds = _receive_line(connection)
                    command = json.loads(line)
                    if command.get("command") == "lease":  # the connection is the lease: another thread owns it
                        closing.pop_all()
                        threading.Thread(target=hold_lease, args=(connection, self.on_lease_lost), name="coldsnap-agent-lease",
                                         daemon=True).start()
                        continue
                    reply = {"ok": True, **self.handle(command, _ProgressLines(connection), fds)}
                except Exception as exc:  # every failure goes back to the launcher, none kills the engine
                    log.exception("coldsnap agent command failed")
                    reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                finally:
                    for fd in fds:  # adopted memory holds its own references
                        os.close(fd)
                try:
                    connection.sendall(json.dumps(reply).encode() + b"\n")
                except OSError:
                    pass

    def handle(self, command: dict[str, Any], progress: "_ProgressLines | None" = None,
               fds: list[int] | None = None) -> dict[str, Any]:
        name = command.get("command")
        progress = progress or _ProgressLines(None)
        if name == "status":
            return self.status()
        if name == "prepare":
            return self.prepare(Path(command["pack_dir"]), bool(command.get("generate_pack", True)), progress,
                                graph_policy=str(command.get("graph_policy") or "retain"),
                                coordinator=command.get("coordinator"))
        if name == "resume":
            return self.resume(command, progress, fds or [])
        raise AgentError(f"unknown command {name!r}")

    def status(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "pid": os.getpid(),
            "port": self.port,
            "rank": self.rank,
            "world_size": self.world,
            "layout_digest": self.memory.layout.digest(),
            "layout": self.memory.layout.to_json_value(),
            "regions": {
                tag: {"backend": r.backend, "device": r.device, "base": r.base, "size": r.size, "mapped": r.mapped_bytes,
                      "high_water": r.high_water, "chunk_bytes": r.chunk_bytes}
                for tag, r in self.memory.regions.items()
            },
        }

    def prepare(self, pack_dir: Path, generate_pack: bool, progress: "_ProgressLines", graph_policy: str = "retain",
                coordinator: dict[str, Any] | None = None) -> dict[str, Any]:
        if self.state != "serving":
            raise AgentError(f"prepare needs state serving, not {self.state}")
        seconds: dict[str, float] = {}
        with _rendezvous(coordinator, self.rank, self.world) as rendezvous:
            self._drain(rendezvous, seconds)
            try:
                if self.hooks.release_graphs is not None:
                    self.graphs_released = _timed(seconds, "release_graphs", lambda: self.hooks.release_graphs(graph_policy))
                if self.collectives is not None:
                    self.collectives.teardown(rendezvous, seconds)
                result = self.memory.release(seconds, pack_dir if generate_pack else None,
                                             progress.phase("writing the native pack"), self._before_release)
            except BaseException:
                self.serving_lock.release()
                raise
        self.state = "prepared"
        self._xstate = dynamic_permissions()  # CRIU does not carry AMX permission; resume asks again
        self._arm_watchdog()
        # What the process image will hold: its resident memory once model memory is gone.
        return {**result, "layout_digest": self.memory.layout.digest(), "seconds": seconds, "rss_bytes": _rss_bytes(),
                "regions": self.status()["regions"], "graphs_released": self.graphs_released,
                "device_bytes": _torch_device_bytes()}

    def _drain(self, rendezvous: "Rendezvous | None", seconds: dict[str, float]) -> None:
        """Stop serving. Ranks > 0 only follow rank 0's requests, and one may be waiting in a collective
        for rank 0 right now: they drain after rank 0 has (barrier ``drained``), so their last request
        can finish instead of deadlocking against a drained leader."""
        def acquire() -> None:
            if not _timed(seconds, "drain", lambda: self.serving_lock.acquire(timeout=300)):
                raise AgentError("could not drain: a request held the engine for 300 s")

        if rendezvous is None:
            acquire()
            return
        if self.rank == 0:
            acquire()
        try:
            _timed(seconds, "drain_barrier", lambda: rendezvous.barrier("agent.drained", 330))
        except BaseException:
            if self.rank == 0:
                self.serving_lock.release()
            raise
        if self.rank != 0:
            acquire()

    def _before_release(self) -> None:
        for hook in self.hooks.before_release:
            hook()

    def _arm_watchdog(self) -> None:
        """A restored process that no launcher resumes must not linger frozen (its launcher was killed
        mid-restore, say): past the deadline it kills its own process group. The deadline runs on the
        monotonic clock, which CRIU's time namespace carries across the snapshot, so the time the image
        spent on disk does not count."""
        prepared_at = time.monotonic()
        timeout = float(os.environ.get("COLDSNAP_AGENT_RESUME_TIMEOUT_S", "300"))

        def watch() -> None:
            while self.state == "prepared":
                if time.monotonic() - prepared_at > timeout:
                    _stop_process_group(f"not resumed within {timeout:.0f} s of prepare")
                time.sleep(0.5)

        threading.Thread(target=watch, name="coldsnap-agent-watchdog", daemon=True).start()

    def resume(self, command: dict[str, Any], progress: "_ProgressLines", fds: list[int]) -> dict[str, Any]:
        """Map the regions again and fill them: from chunks the launcher already hydrated (``adopted``:
        tag → chunk count, the file descriptors in that order), else from the pack or safetensors.
        Then the collectives are rebuilt and dropped graphs recaptured, every rank together."""
        if self.state != "prepared":
            raise AgentError(f"resume needs state prepared, not {self.state}")
        seconds: dict[str, float] = {}
        refused = request_permissions(self._xstate)
        if refused:
            raise AgentError(f"the kernel refused x86 state features {refused} this process used before the snapshot")
        with _rendezvous(command.get("coordinator"), self.rank, self.world) as rendezvous:
            hydrated = self.memory.restore(
                seconds, layout_digest=command.get("layout_digest"), payload=command.get("payload"),
                residual=command.get("residual"), safetensors=command.get("safetensors"), adopted=command.get("adopted"),
                fds=fds, staged=command.get("staged"), progress=progress.phase("hydrating weights"))
            if self.collectives is not None:
                self.collectives.rebuild(rendezvous, seconds)
            for hook in self.hooks.after_resume:
                hook()
            recaptured: list[str] = []
            if self.graphs_released and self.hooks.recapture_graphs is not None:
                recaptured = _timed(seconds, "recapture_graphs", self.hooks.recapture_graphs)
            if rendezvous is not None:  # every rank is whole again before any serves
                _timed(seconds, "resumed_barrier", lambda: rendezvous.barrier("agent.resumed", 120))
        self.graphs_released = []
        self.state = "serving"
        self.serving_lock.release()
        return {"hydrate": hydrated, "seconds": seconds, "graphs_recaptured": recaptured, "rank": self.rank}


@contextlib.contextmanager
def _rendezvous(coordinator: dict[str, Any] | None, rank: int, world: int) -> Iterator["Rendezvous | None"]:
    """The activation's coordinator for one command (none for a single rank). Its own ZeroMQ context
    is terminated before the command returns: no connection to the launcher outlives it, so none is in
    the process when CRIU dumps it."""
    if world == 1:
        yield None
        return
    if not coordinator:
        raise AgentError(f"rank {rank} of {world} needs the activation's coordinator in the command")
    import zmq

    from coldsnap.coord import CoordinatorClient

    context = zmq.Context()
    try:
        client = CoordinatorClient(coordinator["endpoint"], bytes.fromhex(coordinator["token"]), rank, context=context)
        completed = False
        try:
            yield client
            completed = True
        finally:
            client.close(completed=completed)
    finally:
        context.term()


class _ProgressLines:
    """Streams ``{"progress": ...}`` lines to the launcher before the reply (at most ~5 a second)."""

    def __init__(self, connection: socket.socket | None):
        self.connection = connection

    def phase(self, name: str) -> Callable[[int, int], None]:
        last = [0.0]

        def report(done: int, total: int) -> None:
            now = time.monotonic()
            if self.connection is None or (now - last[0] < 0.2 and done < total):
                return
            last[0] = now
            try:
                line = {"progress": {"phase": name, "done": done, "total": total}}
                self.connection.sendall(json.dumps(line).encode() + b"\n")
            except OSError:
                self.connection = None  # the launcher stopped listening; the work goes on

        return report


def _rss_bytes() -> int:
    """Resident memory of this process (VmRSS)."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _torch_device_bytes() -> int:
    """GPU memory torch's caching allocator still holds outside the stable regions (graph pools,
    activations): the CUDA checkpoint copies it into the process image. 0 without CUDA torch."""
    torch = sys.modules.get("torch")  # never import an engine's torch ourselves
    if torch is None or not torch.cuda.is_initialized():
        return 0
    return sum(torch.cuda.memory_reserved(d) for d in range(torch.cuda.device_count()))


_agent: AgentServer | None = None


def start_agent(control: str, memory: ModelMemory, *, serving_lock: threading.Lock, port: int | None = None,
                hooks: AgentHooks | None = None, rank: int = 0, world: int = 1,
                collectives: "DistributedState | None" = None) -> AgentServer:
    """Start this process's agent (once) over its model memory; rank ``rank`` of a tensor-parallel
    ``world`` listens at :func:`rank_control` of ``control``."""
    global _agent
    if _agent is None:
        _agent = AgentServer(control, memory, serving_lock, port, hooks, rank, world, collectives).start()
    return _agent


MAX_FDS_PER_MESSAGE = 200  # SCM_RIGHTS carries at most 253 descriptors per message on Linux


def _stop_process_group(reason: str = "the restoring launcher died before the canary matched") -> None:
    log.error("coldsnap agent: %s; stopping this process tree", reason)
    os.killpg(os.getpgrp(), 9)


def hold_lease(connection: socket.socket, on_lost: Callable[[], None] = _stop_process_group) -> bool:
    """Hold the restoring launcher's lease on this process tree: until the launcher says ``release``
    (its canary matched) the tree lives only as long as the launcher, whose death closes the connection:
    then ``on_lost`` (default: SIGKILL to this process group). Returns True when released."""
    with connection:
        try:
            connection.sendall(b'{"ok": true, "leased": true}\n')
            reader = connection.makefile("rb")
            while line := reader.readline():
                if line.strip() == b"release":
                    return True
        except OSError:
            pass
    on_lost()
    return False


class Lease:
    """The launcher's side of :func:`hold_lease`: taken on each rank's agent right after CRIU restored
    the tree, released once the canary matched. If the launcher dies in between, the kernel closes
    these connections and each agent stops its process tree."""

    def __init__(self, controls: list[str], timeout: float = 30.0):
        self._connections: list[socket.socket] = []
        try:
            for control in controls:
                connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self._connections.append(connection)
                connection.settimeout(timeout)
                connection.connect(_address(control))
                connection.sendall(b'{"command": "lease"}\n')
                if b'"leased": true' not in connection.recv(256):
                    raise AgentError(f"agent at {control} did not take the lease")
        except BaseException:
            self.close()
            raise

    def release(self) -> None:
        """The server is on its own from now on."""
        for connection in self._connections:
            try:
                connection.sendall(b"release\n")
            except OSError:
                pass
        self.close()

    def close(self) -> None:
        for connection in self._connections:
            connection.close()
        self._connections = []


def _receive_line(connection: socket.socket) -> tuple[bytes, list[int]]:
    """One command line and every file descriptor sent with it (SCM_RIGHTS, in order)."""
    data, fds = b"", []
    while b"\n" not in data:
        chunk, received, _, _ = socket.recv_fds(connection, 1 << 16, MAX_FDS_PER_MESSAGE)
        fds += received
        if not chunk:
            break
        data += chunk
    return data.split(b"\n", 1)[0], fds


def request(control: str, command: dict[str, Any], timeout: float = 600,
            on_progress: Callable[[str, int, int], None] | None = None, fds: list[int] | None = None) -> dict[str, Any]:
    """Send one command to the agent at ``control``; raises :class:`AgentError` with its reason.
    Progress lines the agent streams before its reply go to ``on_progress(phase, done, total)``.
    ``fds`` travel with the command (SCM_RIGHTS); the caller still owns and closes its copies."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.settimeout(timeout)
        connection.connect(_address(control))
        line = json.dumps(command).encode() + b"\n"
        batches = [list(fds[i:i + MAX_FDS_PER_MESSAGE]) for i in range(0, len(fds or []), MAX_FDS_PER_MESSAGE)]
        for batch in batches[:-1]:
            socket.send_fds(connection, [b" "], batch)  # JSON allows leading blanks
        if batches:
            socket.send_fds(connection, [line], batches[-1])
        else:
            connection.sendall(line)
        reader = connection.makefile("rb")
        while True:
            line = reader.readline()
            if not line or b'"progress"' not in line[:16]:
                break
            if on_progress is not None:
                update = json.loads(line)["progress"]
                on_progress(update["phase"], update["done"], update["total"])
    if not line:
        raise AgentError(f"agent at {control} closed the connection without answering")
    reply = json.loads(line)
    if not reply.pop("ok", False):
        raise AgentError(reply.get("error", "unknown agent error"))
    return reply

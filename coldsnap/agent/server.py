"""Agent server (see the package docstring); its protocol is :mod:`coldsnap.agent.protocol`. Engines start it
through :mod:`coldsnap.agent.engine_entry` with their :mod:`~coldsnap.agent.hooks`."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from coldsnap.agent.addresses import address
from coldsnap.agent.device_state import LocalMemoryTrim, cuda_devices_in_use, device_used_bytes, torch_pool_bytes
from coldsnap.agent.failures import CommandFailed, failure_of
from coldsnap.agent.hooks import AgentHooks
from coldsnap.agent.memory import ModelMemory
from coldsnap.agent.process_memory import empty_torch_cache, rss_bytes, torch_device_bytes, trim_heap
from coldsnap.agent.progress_lines import ProgressLines
from coldsnap.agent.protocol import (
    AgentState,
    Hydrated,
    LeaseTaken,
    PackRef,
    Prefill,
    PrefillReply,
    Prepare,
    PrepareReply,
    RegionStatus,
    Reply,
    Resume,
    ResumeReply,
    Standby,
    StandbyReply,
    Status,
    StatusReply,
    TakeLease,
    decode_command,
    encode,
    rank_control,
    receive_line,
)
from coldsnap.agent.rendezvous import command_rendezvous
from coldsnap.agent.switch_interval import prompt_handoffs
from coldsnap.agent.xstate import dynamic_permissions, request_permissions
from coldsnap.host import process_start_ticks
from coldsnap.timing import timed
from coldsnap.settings import SETTINGS

if TYPE_CHECKING:
    from coldsnap.collective.group import DistributedState, Rendezvous
    from coldsnap.hydrate import PinnedPack

__all__ = ["AgentServer", "hold_lease"]

log = logging.getLogger(__name__)


class AgentServer:
    def __init__(self, control: str, memory: ModelMemory, serving_lock: threading.Lock, port: int | None = None,
                 hooks: AgentHooks | None = None, rank: int = 0, world: int = 1,
                 collectives: "DistributedState | None" = None):
        if collectives is not None and (collectives.rank, collectives.world) != (rank, world):
            raise ValueError(f"collectives are rank {collectives.rank} of {collectives.world}, the agent {rank} of {world}")
        if collectives is not None and world == 1:  # their teardown and rebuild need the coordinator's barriers
            raise ValueError("a single rank has no collectives to tear down")
        self.control = rank_control(control, rank)
        self.rank = rank
        self.world = world
        self.collectives = collectives
        self.graphs_released: list[str] = []
        self.local_memory = LocalMemoryTrim()
        self._preparations = 0  # prepares so far: which one the running watchdog belongs to
        self._leased = 0  # the prepare whose restore a launcher has leased (0: none)
        self.process_start: Callable[[], int] = process_start_ticks  # changes when CRIU restores the process
        self.memory = memory
        self.serving_lock = serving_lock
        self.port = port
        self.hooks = hooks or AgentHooks()
        self.state: AgentState = "serving"
        self.on_lease_lost: Callable[[], None] = _stop_process_group  # what a lapsed restore lease does
        self._xstate = 0  # dynamic x86 state permissions recorded at prepare
        self._prepared_start = 0  # this process's start time when it was prepared (a restore changes it)
        self._pinned: "PinnedPack | None" = None  # a standby's payload pack, pinned for its wake
        self._to_unpin: list["PinnedPack"] = []  # pinned packs a wake used, unpinned once no lease is held
        self._leases = 0  # launchers' leases held now
        self._lease_count = threading.Lock()  # guards _leases and _to_unpin
        self._prefill: "_Prefill | None" = None  # a standby's weights being (or filled) ahead of its wake
        self._prefill_lock = threading.Lock()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(address(self.control))
        self._listener.listen(4)
        self._thread = threading.Thread(target=self._serve, name="coldsnap-agent", daemon=True)

    def start(self) -> "AgentServer":
        self._thread.start()
        return self

    def _serve(self) -> None:
        while True:
            connection, _ = self._listener.accept()
            prompt_handoffs.enter()
            with contextlib.ExitStack() as closing:
                closing.callback(prompt_handoffs.exit)
                closing.callback(connection.close)
                fds: list[int] = []
                try:
                    line, fds = receive_line(connection)
                    command = decode_command(line)
                    if isinstance(command, TakeLease):  # the connection is the lease: another thread owns it
                        closing.pop_all()  # (and the prompt handoffs until the lease ends: resume, canary)
                        self._leased = self._preparations
                        with self._lease_count:
                            self._leases += 1
                        threading.Thread(target=self._hold_lease, args=(connection,), name="coldsnap-agent-lease",
                                         daemon=True).start()
                        continue
                    reply = Reply(ok=True, reply=self.handle(command, ProgressLines(connection), fds))
                except Exception as exc:  # every failure goes back to the launcher, none kills the engine
                    log.exception("coldsnap agent command failed")
                    reply = Reply(ok=False, failure=failure_of(exc))
                finally:
                    for fd in fds:  # adopted memory holds its own references
                        os.close(fd)
                try:
                    connection.sendall(encode(reply))
                except OSError:
                    pass

    def _hold_lease(self, connection: socket.socket) -> None:
        try:
            hold_lease(connection, self.on_lease_lost)
        finally:
            prompt_handoffs.exit()
        with self._lease_count:
            self._leases -= 1
        self._unpin_later(None)

    def _unpin_later(self, pinned: "PinnedPack | None") -> None:
        """Unpin a woken standby's pack (unregistering and unmapping GBs stalls the process's CUDA calls and
        page faults for a while) once its launcher released the lease, i.e. after the canary matched."""
        with self._lease_count:
            if pinned is not None:
                self._to_unpin.append(pinned)
            if self._leases == 0:
                while self._to_unpin:
                    threading.Thread(target=self._to_unpin.pop().close, name="coldsnap-agent-unpin", daemon=True).start()

    def handle(self, command: Status | Prepare | Resume | Standby | Prefill, progress: "ProgressLines | None" = None,
               fds: list[int] | None = None) -> StatusReply | PrepareReply | ResumeReply | StandbyReply | PrefillReply:
        progress = progress or ProgressLines(None)
        if isinstance(command, Status):
            return self.status()
        if isinstance(command, Prefill):
            return self.prefill()
        if isinstance(command, Prepare):
            return self.prepare(command, progress)
        if isinstance(command, Standby):
            return self.standby(command)
        return self.resume(command, progress, fds or [])

    def status(self) -> StatusReply:
        return StatusReply(state=self.state, pid=os.getpid(), port=self.port, rank=self.rank, world_size=self.world,
                           layout_digest=self.memory.layout.digest(), layout=self.memory.layout.to_json_value(),
                           regions=self._regions())

    def _regions(self) -> dict[str, RegionStatus]:
        return {tag: RegionStatus(backend=r.backend, device=r.device, base=r.base, size=r.size, mapped=r.mapped_bytes,
                                  high_water=r.high_water, chunk_bytes=r.chunk_bytes)
                for tag, r in self.memory.regions.items()}

    def prepare(self, command: Prepare, progress: "ProgressLines") -> PrepareReply:
        if self.state != "serving":
            raise CommandFailed("agent.state", f"prepare needs state serving, not {self.state}")
        seconds: dict[str, float] = {}
        pack_dir = Path(command.pack_dir) if command.pack_dir is not None else None
        graph_policy = command.graph_policy
        with command_rendezvous(command.coordinator, self.rank, self.world) as rendezvous:
            self._drain(rendezvous, seconds)
            try:
                release_graphs = self.hooks.release_graphs
                if release_graphs is not None:
                    self.graphs_released = timed(seconds, "release_graphs", lambda: release_graphs(graph_policy))
                if self.collectives is not None:
                    assert rendezvous is not None  # collectives exist only for more than one rank (__init__)
                    self.collectives.teardown(rendezvous, seconds)
                plan = self.hooks.recovery_plan() if self.hooks.recovery_plan is not None else None
                packs = self.memory.release(seconds, pack_dir, progress.phase("writing the native pack"),
                                            self._before_release, write_payload=command.native, recovery_plan=plan)
            except BaseException:
                self.serving_lock.release()
                raise
        reserved_before_empty = torch_device_bytes()
        timed(seconds, "empty_cache", empty_torch_cache)
        timed(seconds, "malloc_trim", trim_heap)
        pools = torch_pool_bytes((r.base, r.size) for r in self.memory.regions.values() if r.backend == "cuda")
        devices = cuda_devices_in_use([r.device for r in self.memory.regions.values() if r.backend == "cuda"])
        trimmed = timed(seconds, "local_memory_trim", lambda: self.local_memory.lower(devices))
        self.state = "prepared"
        self._xstate = dynamic_permissions()  # CRIU does not carry AMX permission; resume asks again
        self._arm_watchdog()
        # What the process image will hold: its resident memory once model memory is gone.
        return PrepareReply(
            payload=PackRef(**packs["payload"]) if "payload" in packs else None,
            residual=PackRef(**packs["residual"]) if "residual" in packs else None,
            layout_digest=self.memory.layout.digest(), seconds=seconds, rss_bytes=rss_bytes(),
            device_bytes=torch_device_bytes(), device_bytes_before_empty=reserved_before_empty,
            device_bytes_allocated=torch_device_bytes(allocated=True), regions=self._regions(), graphs_released=list(self.graphs_released),
            graph_pool_bytes=pools.get("graph_pool_reserved", 0),
            graph_pool_allocated_bytes=pools.get("graph_pool_allocated", 0),
            region_pool_bytes=pools.get("in_regions_reserved", 0),
            stack_bytes=trimmed.get("stack_bytes", 0), local_memory_freed_bytes=trimmed.get("local_memory_freed_bytes", 0),
            device_used_bytes=device_used_bytes(devices),
            recovery_files=list(self.hooks.recovery_files),
            recovery_plan=PackRef(**packs["recovery_plan"]) if "recovery_plan" in packs else None,
            recovery_gap=PackRef(**packs["recovery_gap"]) if "recovery_gap" in packs else None)

    def _drain(self, rendezvous: "Rendezvous | None", seconds: dict[str, float]) -> None:
        """Stop serving. Ranks > 0 only follow rank 0's requests, and one may be waiting in a collective
        for rank 0 right now: they drain after rank 0 has (barrier ``drained``), so their last request
        can finish instead of deadlocking against a drained leader."""
        def acquire() -> None:
            if not timed(seconds, "drain", lambda: self.serving_lock.acquire(timeout=300)):
                raise CommandFailed("agent.drain", "could not drain: a request held the engine for 300 s")

        if rendezvous is None:
            acquire()
            return
        if self.rank == 0:
            acquire()
        try:
            timed(seconds, "drain_barrier", lambda: rendezvous.barrier("agent.drained", 330))
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
        spent on disk does not count.

        A second, short deadline closes the gap before the launcher's lease: the launcher takes it right
        after CRIU returns, so a launcher killed while CRIU ran leaves a restored tree nobody holds. The
        watchdog sees the restore (the kernel task is new: its start time in /proc changed) and stops
        the tree when no lease came within ``COLDSNAP_AGENT_LEASE_WAIT_S`` (default 15 s) of it. Both
        settings are read here, from the engine's environment as captured."""
        prepared_at = time.monotonic()
        timeout = SETTINGS.seconds("COLDSNAP_AGENT_RESUME_TIMEOUT_S") or 300.0
        lease_wait = SETTINGS.seconds("COLDSNAP_AGENT_LEASE_WAIT_S") or 15.0
        started_as = self._prepared_start = self.process_start()
        # Each prepare arms its own watchdog: one left from an earlier prepare (a resume and a new prepare
        # within its 0.5 s tick) must not count the new wait from the old prepare.
        self._preparations += 1
        generation = self._preparations

        def watch() -> None:
            restored_at: float | None = None
            while self.state == "prepared" and self._preparations == generation:
                now = time.monotonic()
                if now - prepared_at > timeout:
                    _stop_process_group(f"not resumed within {timeout:.0f} s of prepare")
                if restored_at is None and self.process_start() != started_as:
                    restored_at = now
                if restored_at is not None and self._leased != generation and now - restored_at > lease_wait:
                    _stop_process_group(f"restored, but no launcher took the lease within {lease_wait:.0f} s")
                time.sleep(0.5)

        threading.Thread(target=watch, name="coldsnap-agent-watchdog", daemon=True).start()

    def resume(self, command: Resume, progress: "ProgressLines", fds: list[int]) -> ResumeReply:
        """Map the regions again and fill them: from chunks the launcher already hydrated (``adopted``:
        tag → chunk count, the file descriptors in that order), else from the pack or safetensors.
        Then the collectives are rebuilt and dropped graphs recaptured, every rank together."""
        if self.state not in ("prepared", "standby"):
            raise CommandFailed("agent.state", f"resume needs state prepared or standby, not {self.state}")
        seconds: dict[str, float] = {}
        started = time.monotonic()
        self._request_permissions()
        timed(seconds, "local_memory_restore", self.local_memory.restore)  # before any kernel runs again
        with command_rendezvous(command.coordinator, self.rank, self.world) as rendezvous:
            pinned, self._pinned = self._pinned, None
            usable = pinned if pinned is not None and pinned.path == command.payload else None
            try:
                prefilled = self._take_prefill(usable, seconds)
                hydrated = self.memory.restore(
                    seconds, layout_digest=command.layout_digest, payload=command.payload, residual=command.residual,
                    safetensors=command.safetensors, recovery_plan=command.recovery_plan, recovery_gap=command.recovery_gap,
                    replay=self.hooks.replay_weights, adopted=command.adopted, fds=fds,
                    staged=command.staged, pinned=usable, prefilled=prefilled,
                    progress=progress.phase("hydrating weights"))
            finally:
                if pinned is not None:
                    self._unpin_later(pinned)
            if self.collectives is not None and self.state == "prepared":  # a standby rebuilt them already
                assert rendezvous is not None  # collectives exist only for more than one rank (__init__)
                self.collectives.rebuild(rendezvous, seconds)
            for hook in self.hooks.after_resume:
                hook()
            recaptured: list[str] = []
            if self.graphs_released and self.hooks.recapture_graphs is not None:
                recaptured = timed(seconds, "recapture_graphs", self.hooks.recapture_graphs)
            if rendezvous is not None:  # every rank is whole again before any serves
                timed(seconds, "resumed_barrier", lambda: rendezvous.barrier("agent.resumed", 120))
        self.graphs_released = []
        self.state = "serving"
        self.serving_lock.release()
        # all of it, the steps above and what lies between them (the launcher's span adds the round trip)
        seconds["agent_resume"] = time.monotonic() - started
        return ResumeReply(rank=self.rank, hydrate=_hydrated(hydrated), seconds=seconds, graphs_recaptured=recaptured)


    def _request_permissions(self) -> None:
        refused = request_permissions(self._xstate)
        if refused:
            raise CommandFailed("agent.permissions",
                                f"the kernel refused x86 state features {refused} this process used before the snapshot")

    def standby(self, command: Standby) -> StandbyReply:
        """Park a restored, CUDA-restored process as a warm standby: rebuild its collectives now (every
        rank together), keep its model memory released and its serving lock held (a request that
        arrives waits for ``resume``), and replace the prepared state's restore deadlines with the
        standby's ``ttl_s``, after which the process removes its registry ``record`` and stops its
        process group: a standby nobody wakes leaves nothing behind."""
        if self.state != "prepared":
            raise CommandFailed("agent.state", f"standby needs state prepared, not {self.state}")
        if self.process_start() == self._prepared_start:
            raise CommandFailed("agent.state", "standby needs a restored process (this one was prepared, not restored)")
        seconds: dict[str, float] = {}
        self._request_permissions()
        self.local_memory.restore()  # a standby's collectives and recaptured graphs run kernels
        recaptured: list[str] = []
        with command_rendezvous(command.coordinator, self.rank, self.world) as rendezvous:
            if self.collectives is not None:
                assert rendezvous is not None  # collectives exist only for more than one rank (__init__)
                self.collectives.rebuild(rendezvous, seconds)
            if self.graphs_released and self.hooks.recapture_graphs is not None:
                recaptured = self._recapture_parked(self.hooks.recapture_graphs, seconds)
            if rendezvous is not None:
                timed(seconds, "standby_barrier", lambda: rendezvous.barrier("agent.standby", 120))
        pin_error = None
        pin = command.pin_payload
        if pin is not None:
            try:
                self._pinned = timed(seconds, "pin_payload", lambda: self.memory.pin_pack(pin))
            except Exception as exc:  # the wake then hydrates through the staging ring: slower, still right
                log.warning("coldsnap agent: could not pin %s: %s", pin, exc)
                pin_error = f"{type(exc).__name__}: {exc}"
        self.state = "standby"  # ends the prepared state's watchdog
        self._watch_standby(command.ttl_s, command.record)
        return StandbyReply(rank=self.rank, seconds=seconds, pinned_bytes=self._pinned.length if self._pinned else 0,
                            pin_error=pin_error, graphs_recaptured=recaptured)

    def prefill(self) -> PrefillReply:
        """A wake is coming (:class:`Prefill`): fill the weights from the pinned pack in the background."""
        with self._prefill_lock:
            if self.state != "standby" or self._pinned is None or self._prefill is not None:
                reason = ("not a standby" if self.state != "standby" else
                          "no pinned pack" if self._pinned is None else "started already")
                return PrefillReply(started=False, reason=reason)
            self._prefill = _Prefill(self.memory, self._pinned)
        return PrefillReply(started=True)

    def _take_prefill(self, pinned: "PinnedPack | None", seconds: dict[str, float]) -> dict[str, Any] | None:
        """The weights a :meth:`prefill` filled, once it is done, when the resume wants that pack
        (``pinned``); else they are released again and the resume fills the weights its own way."""
        with self._prefill_lock:
            prefill, self._prefill = self._prefill, None
        if prefill is None:
            return None
        prefill.thread.join()
        seconds.update({f"prefill_{name}": value for name, value in prefill.seconds.items()})
        if prefill.error is not None or pinned is not prefill.pinned:
            if prefill.error is None:
                self.memory.unfill()
            return None
        return prefill.result

    def _abandon_stale_prefill(self) -> None:
        """A prefill whose wake never came (its launcher failed before the lease): release the weights."""
        with self._prefill_lock:
            prefill = self._prefill
            if (prefill is None or prefill.finished_at is None or self._leases
                    or time.monotonic() - prefill.finished_at < PREFILL_HOLD_S):
                return
            self._prefill = None
            if prefill.error is None:
                self.memory.unfill()
        log.warning("coldsnap agent: no wake took the prefilled weights within %.0f s; released them", PREFILL_HOLD_S)

    def _recapture_parked(self, recapture: Callable[[], list[str]], seconds: dict[str, float]) -> list[str]:
        """Capture the graphs the snapshot dropped (those holding NCCL kernels) again now, against the
        collectives just rebuilt, so the wake does not: the regions are mapped for the capture — its
        warm-up runs read and write them, and what they leave does not matter, since the wake hydrates
        the weights and zeroes the KV cache and graph memory at the same addresses, where the graphs
        find them — then released again, so the standby holds no model memory."""
        for region in self.memory.regions.values():
            timed(seconds, f"map_{region.tag}_for_graphs", region.map)
        try:
            for hook in self.hooks.after_resume:
                hook()
            recaptured = timed(seconds, "recapture_graphs", recapture)
        finally:
            self.memory.release(seconds, None, None, self._before_release)
        self.graphs_released = []
        return recaptured

    def _watch_standby(self, ttl_s: int | None, record: str | None) -> None:
        """While parked: stop past the TTL (removing the registry record first), and release weights a
        prefill filled for a wake that never came."""
        parked_at = time.monotonic()

        def watch() -> None:
            while self.state == "standby":
                if ttl_s is not None and time.monotonic() - parked_at > ttl_s:
                    if record is not None and self.rank == 0:
                        with contextlib.suppress(OSError):
                            os.unlink(record)
                    _stop_process_group(f"warm standby not woken within {ttl_s} s")
                self._abandon_stale_prefill()
                time.sleep(0.5)

        threading.Thread(target=watch, name="coldsnap-agent-standby-expiry", daemon=True).start()


PREFILL_HOLD_S = 30.0
"""How long weights a prefill filled wait for their wake's resume before they are released again."""


class _Prefill:
    """One background fill of a standby's weights from its pinned pack (:meth:`AgentServer.prefill`)."""

    def __init__(self, memory: ModelMemory, pinned: "PinnedPack"):
        self.pinned = pinned
        self.seconds: dict[str, float] = {}
        self.result: dict[str, Any] | None = None
        self.error: BaseException | None = None
        self.finished_at: float | None = None
        self.thread = threading.Thread(target=self._run, args=(memory,), name="coldsnap-agent-prefill", daemon=True)
        self.thread.start()

    def _run(self, memory: ModelMemory) -> None:
        try:
            self.result = {**memory.prefill(self.pinned, self.seconds), "prefilled": True}
        except BaseException as exc:  # reported by the resume that takes it (it then fills the weights itself)
            log.exception("coldsnap agent: prefill failed")
            self.error = exc
        self.finished_at = time.monotonic()


def _hydrated(summary: dict[str, Any]) -> Hydrated:
    """What :meth:`ModelMemory.restore` reports, as the protocol's :class:`Hydrated`."""
    stats = dict(summary)
    return Hydrated(source=stats.pop("source"), bytes=int(stats.pop("bytes", 0)), staged=bool(stats.pop("staged", False)),
                    stats={k: v for k, v in stats.items() if isinstance(v, (int, float, bool, str))})


def _stop_process_group(reason: str = "the restoring launcher died before the canary matched") -> None:
    log.error("coldsnap agent: %s; stopping this process tree", reason)
    os.killpg(os.getpgrp(), 9)


def hold_lease(connection: socket.socket, on_lost: Callable[[], None] = _stop_process_group) -> bool:
    """Hold the restoring launcher's lease on this process tree: until the launcher says ``release``
    (its canary matched) the tree lives only as long as the launcher, whose death closes the connection:
    then ``on_lost`` (default: SIGKILL to this process group). Returns True when released."""
    with connection:
        try:
            connection.sendall(encode(LeaseTaken()))
            reader = connection.makefile("rb")
            while line := reader.readline():
                if line.strip() == b"release":
                    return True
        except OSError:
            pass
    on_lost()
    return False

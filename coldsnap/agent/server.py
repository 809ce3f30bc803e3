"""Agent server (see the package docstring) and the launcher's client call."""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from coldsnap.contracts.layout import MemoryLayout
from coldsnap.agent.xstate import dynamic_permissions, request_permissions
from coldsnap.memory.regions import DISCARDED_TAGS, StableRegion
from coldsnap.native import native

__all__ = ["AgentHooks", "AgentServer", "AgentError", "start_agent", "request"]

log = logging.getLogger(__name__)

Hook = Callable[[], None]


class AgentError(RuntimeError):
    """The agent refused or failed a command; the message is its own."""


@dataclass
class AgentHooks:
    """What an engine plugin adds around the memory work (each runs in the agent's thread)."""

    before_release: list[Hook] = field(default_factory=list)
    """After draining, before the regions are unmapped (e.g. NCCL teardown, graph discard)."""
    after_resume: list[Hook] = field(default_factory=list)
    """After hydration and KV remap, before serving again (e.g. NCCL rebuild, graph recapture)."""


def _address(control: str) -> str | bytes:
    return b"\0" + control[1:].encode() if control.startswith("@") else control


def _timed(seconds: dict[str, float], name: str, work: Callable[[], Any]) -> Any:
    started = time.perf_counter()
    try:
        return work()
    finally:
        seconds[name] = round(time.perf_counter() - started, 6)


class AgentServer:
    def __init__(self, control: str, layout: MemoryLayout, regions: Mapping[str, StableRegion],
                 serving_lock: threading.Lock, port: int | None = None, hooks: AgentHooks | None = None):
        self.control = control
        self.layout = layout
        self.regions = dict(regions)
        self.serving_lock = serving_lock
        self.port = port
        self.hooks = hooks or AgentHooks()
        self.state = "serving"
        self._xstate = 0  # dynamic x86 state permissions recorded at prepare
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(_address(control))
        self._listener.listen(4)
        self._thread = threading.Thread(target=self._serve, name="coldsnap-agent", daemon=True)

    def start(self) -> "AgentServer":
        self._thread.start()
        return self

    def _serve(self) -> None:
        while True:
            connection, _ = self._listener.accept()
            with connection:
                fds: list[int] = []
                try:
                    line, fds = _receive_line(connection)
                    command = json.loads(line)
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
            return self.prepare(Path(command["pack_dir"]), bool(command.get("generate_pack", True)), progress)
        if name == "resume":
            return self.resume(command, progress, fds or [])
        raise AgentError(f"unknown command {name!r}")

    def status(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "pid": os.getpid(),
            "port": self.port,
            "layout_digest": self.layout.digest(),
            "layout": self.layout.to_json_value(),
            "regions": {
                tag: {"backend": r.backend, "device": r.device, "base": r.base, "size": r.size, "mapped": r.mapped_bytes,
                      "high_water": r.high_water, "chunk_bytes": r.chunk_bytes}
                for tag, r in self.regions.items()
            },
        }

    def _allocations(self) -> dict[str, list[tuple[int, int]]]:
        """The preserved bytes per region: the allocator's blocks, or the layout's tensors where the
        engine placed tensors itself."""
        out = {}
        for region_layout in self.layout.regions:
            region = self.regions.get(region_layout.tag)
            if region is None or region_layout.tag in DISCARDED_TAGS:
                continue  # KV and graph scratch are discarded, never preserved
            blocks = region.allocations() or [(t.offset, t.length) for t in region_layout.tensors if t.length]
            if blocks:
                out[region_layout.tag] = blocks
        return out

    def prepare(self, pack_dir: Path, generate_pack: bool, progress: "_ProgressLines") -> dict[str, Any]:
        if self.state != "serving":
            raise AgentError(f"prepare needs state serving, not {self.state}")
        from coldsnap.hydrate import write_pack_from_regions
        from coldsnap.payload import PackKind, plan_residual

        seconds: dict[str, float] = {}
        if not _timed(seconds, "drain", lambda: self.serving_lock.acquire(timeout=300)):
            raise AgentError("could not drain: a request held the engine for 300 s")
        try:
            result: dict[str, Any] = {}
            if generate_pack:
                pack_dir.mkdir(parents=True, exist_ok=True)
                payload = _timed(seconds, "payload_write", lambda: write_pack_from_regions(
                    pack_dir, self.layout, self.regions, progress=progress.phase("writing the native pack")))
                residual_plan = plan_residual(self._allocations(), payload.table)
                residual = _timed(seconds, "residual_write", lambda: write_pack_from_regions(
                    pack_dir, self.layout, self.regions, kind=PackKind.RESIDUAL, extents=residual_plan))
                result["payload"] = {"path": str(payload.path), "sha256": payload.sha256, "size_bytes": payload.size_bytes}
                result["residual"] = {"path": str(residual.path), "sha256": residual.sha256, "size_bytes": residual.size_bytes}
            for hook in self.hooks.before_release:
                hook()
            for region in self.regions.values():
                _timed(seconds, f"unmap_{region.tag}", region.unmap)
            native().release_pinned()
        except BaseException:
            self.serving_lock.release()
            raise
        self.state = "prepared"
        self._xstate = dynamic_permissions()  # CRIU does not carry AMX permission; resume asks again
        self._arm_watchdog()
        # What the process image will hold: its resident memory once model memory is gone.
        return {**result, "layout_digest": self.layout.digest(), "seconds": seconds, "rss_bytes": _rss_bytes(),
                "regions": self.status()["regions"],
                "device_bytes": _torch_device_bytes()}

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
                    log.error("coldsnap agent: not resumed within %.0f s of prepare; stopping this process tree", timeout)
                    os.killpg(os.getpgrp(), 9)
                time.sleep(0.5)

        threading.Thread(target=watch, name="coldsnap-agent-watchdog", daemon=True).start()

    def resume(self, command: dict[str, Any], progress: "_ProgressLines", fds: list[int]) -> dict[str, Any]:
        """Map the regions again and fill them: from chunks the launcher already hydrated (``adopted``:
        tag → chunk count, the file descriptors in that order), else from the pack or safetensors."""
        if self.state != "prepared":
            raise AgentError(f"resume needs state prepared, not {self.state}")
        from coldsnap.hydrate import hydrate_pack, replay_safetensors

        seconds: dict[str, float] = {}
        refused = request_permissions(self._xstate)
        if refused:
            raise AgentError(f"the kernel refused x86 state features {refused} this process used before the snapshot")
        digest = command.get("layout_digest") or self.layout.digest()
        if digest != self.layout.digest():
            raise AgentError(f"layout digest {digest[:12]}… is not this process's {self.layout.digest()[:12]}…")
        adopted: dict[str, int] = command.get("adopted") or {}
        if sum(adopted.values()) != len(fds) or not set(adopted) <= set(self.regions):
            raise AgentError(f"adopted chunks {adopted} do not match the {len(fds)} descriptors sent or this process's regions")
        taken = 0
        for region in self.regions.values():
            count = adopted.get(region.tag, 0)
            if count and count * region.chunk_bytes != region.high_water:
                raise AgentError(f"region {region.tag!r}: {count} adopted chunks do not cover the "
                                 f"{region.high_water} bytes mapped before the snapshot")
        for tag, count in adopted.items():  # descriptors arrive in this order
            region = self.regions[tag]
            _timed(seconds, f"adopt_{tag}", lambda: region.adopt_chunks(fds[taken:taken + count]))
            taken += count
        for region in self.regions.values():
            if region.tag not in adopted:
                _timed(seconds, f"map_{region.tag}", region.map)
        hydrated: dict[str, Any] = {}
        weights = {t: r for t, r in self.regions.items() if t not in DISCARDED_TAGS}
        if adopted and set(weights) <= set(adopted):  # the launcher hydrated payload and residual
            hydrated = {"source": "native", "staged": True, **(command.get("staged") or {})}
        elif command.get("payload"):
            stats = _timed(seconds, "hydrate", lambda: hydrate_pack(command["payload"], weights, layout_digest=digest,
                                                                    progress=progress.phase("hydrating weights")))
            hydrated = {"source": "native", "bytes": stats.bytes, "seconds": stats.seconds, "gb_per_s": round(stats.gb_per_s, 3),
                        "direct": stats.direct, "cached_fraction": stats.cached_fraction}
            if command.get("residual"):
                _timed(seconds, "residual", lambda: hydrate_pack(command["residual"], weights, layout_digest=digest))
        elif command.get("safetensors"):
            stats_list = _timed(seconds, "hydrate", lambda: replay_safetensors(command["safetensors"], self.layout, weights))
            total = sum(s.bytes for s in stats_list)
            hydrated = {"source": "recovery", "bytes": total, "seconds": seconds["hydrate"]}
        else:
            raise AgentError("resume needs a payload pack or safetensors files")
        for tag in DISCARDED_TAGS:
            if tag in self.regions:
                _timed(seconds, f"zero_{tag}", self.regions[tag].zero)
        for hook in self.hooks.after_resume:
            hook()
        self.state = "serving"
        self.serving_lock.release()
        return {"hydrate": hydrated, "seconds": seconds}


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


def start_agent(control: str, layout: MemoryLayout, regions: Mapping[str, StableRegion], *,
                serving_lock: threading.Lock, port: int | None = None, hooks: AgentHooks | None = None) -> AgentServer:
    """Start this process's agent (once)."""
    global _agent
    if _agent is None:
        _agent = AgentServer(control, layout, regions, serving_lock, port, hooks).start()
    return _agent


MAX_FDS_PER_MESSAGE = 200  # SCM_RIGHTS carries at most 253 descriptors per message on Linux


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

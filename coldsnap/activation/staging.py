"""Weights hydrated by the launcher while CRIU and the CUDA driver restore the process.

The restored process cannot take bytes before it exists, so hydrating inside it serializes the pack
copy (~0.3 s for 16 GB at 50+ GB/s, more when cold) after CRIU restore + CUDA restore. Instead the
launcher maps shareable GPU chunks of the captured chunk size, hydrates the payload and residual into
them while the process tree is restored, and hands the chunks over as POSIX file descriptors with the
``resume`` command; the agent maps them at the region's stable address (``adopt_chunks``, ~10 ms for
16 GiB). The launcher then drops its own mapping; the memory lives on in the restored process.

Used for CUDA regions with a native pack; host regions and recovery replay hydrate in the agent.

Importing this module imports no pydantic (the hydration engine's pack reader, which does, is imported
by the staging thread once its chunks are mapped): a restore's entry starts staging right after CRIU,
before the rest of coldsnap is imported (:mod:`coldsnap.activation.early_restore`).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from coldsnap.memory import DISCARDED_TAGS, RegionError, StableRegion, reserve_staging
from coldsnap.native import native
from coldsnap.payload.arrival import arrival_for

__all__ = ["StageableRegion", "WeightStager", "stages_rank"]


class StageableRegion(Protocol):
    """What staging reads of a region's record (:class:`coldsnap.contracts.capsule.RegionRecord`)."""

    backend: str
    device: int
    high_water: int
    chunk_bytes: int


def stages_rank(op: str, source: str | None, payload: object, regions: dict[str, Any]) -> bool:
    """The one rule for whether the launcher hydrates a rank's weights itself (and so holds a CUDA context
    on its GPU): a restore (a warm standby's agents hydrate at its wake), the native pack as the rank's
    weight source, a payload, and GPU regions it can stage (:meth:`WeightStager.stageable`)."""
    return op == "restore" and source == "native" and payload is not None and bool(WeightStager.stageable(regions))


@dataclass
class WeightStager:
    """Runs the staging in a thread; :meth:`join` returns once the chunks are ready (or failed)."""

    regions: dict[str, Any]
    """The capsule's region records by tag (:class:`StageableRegion`)."""
    payload: Path
    residual: Path | None
    layout_digest: str
    now_ns: Any
    devices: dict[int, int] = field(default_factory=dict)
    """The engine's device ordinal → this launcher's, where a restore places the engine on other GPUs."""
    staged: dict[str, StableRegion] = field(default_factory=dict)
    error: BaseException | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    started_ns: int = 0
    finished_ns: int = 0
    _thread: threading.Thread | None = None
    _cancelled: threading.Event = field(default_factory=threading.Event)
    _exported: tuple[dict[str, int], list[int]] | None = None
    """The chunks' descriptors, exported by the staging thread once hydrated, until :meth:`export` hands them on."""

    @staticmethod
    def stageable(regions: dict[str, Any]) -> dict[str, Any]:
        """The records worth staging: GPU regions that are not discarded and had bytes mapped."""
        return {tag: r for tag, r in regions.items()
                if tag not in DISCARDED_TAGS and r.backend == "cuda" and r.high_water and r.chunk_bytes}

    def start(self) -> "WeightStager":
        """Start staging on a thread (once: a stager a restore's entry started is started)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="coldsnap-stage-weights", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        self.started_ns = self.now_ns()
        try:
            for tag, record in self.stageable(self.regions).items():
                region = reserve_staging(tag, record.high_water, device=self.devices.get(record.device, record.device),
                                         chunk_bytes=record.chunk_bytes)
                self.staged[tag] = region
                region.map(record.high_water)
            from coldsnap.hydrate import hydrate_pack, hydrate_pack_as_it_arrives  # (pydantic's: after the mapping)

            keep_going = self._keep_going
            arrival = arrival_for(self.payload)
            if arrival is not None:  # being pulled: hydrate each chunk as it arrives, verified
                payload = hydrate_pack_as_it_arrives(self.payload, self.staged, arrival, layout_digest=self.layout_digest,
                                                     progress=keep_going)
            else:
                payload = hydrate_pack(self.payload, self.staged, layout_digest=self.layout_digest, progress=keep_going)
            seconds = payload.seconds
            if self.residual is not None:
                seconds += hydrate_pack(self.residual, self.staged, layout_digest=self.layout_digest,
                                        progress=keep_going).seconds
            self.stats = {"bytes": payload.bytes, "seconds": round(seconds, 4), "gb_per_s": round(payload.gb_per_s, 3),
                          "direct": payload.direct, "cached_fraction": payload.cached_fraction,
                          "as_it_arrived": arrival is not None}
            self._exported = self._export_chunks()  # (here, not after join(): ~70 ms for 16 GiB of chunks)
        except BaseException as exc:  # never lost: the launcher falls back to hydrating in the agent
            self.error = exc
            self.release()
        finally:
            native().release_pinned()
            self.finished_ns = self.now_ns()

    def _keep_going(self, done: int, total: int) -> bool:
        return not self._cancelled.is_set()  # False stops the hydration engine within ~50 ms

    def cancel(self) -> None:
        """Stop the staging early (the restore failed); join() then returns False."""
        self._cancelled.set()

    def join(self) -> bool:
        """Wait for the staging; True when every chunk is hydrated and can be handed over."""
        if self._thread is not None:
            self._thread.join()
        return self.error is None and bool(self.staged)

    def export(self) -> tuple[dict[str, int], list[int]]:
        """``adopted`` (tag → chunk count, in descriptor order) and the descriptors; close them after sending."""
        exported, self._exported = self._exported, None
        return exported if exported is not None else self._export_chunks()

    def _export_chunks(self) -> tuple[dict[str, int], list[int]]:
        adopted, fds = {}, []
        try:
            for tag, region in self.staged.items():
                chunks = region.export_chunks()
                adopted[tag] = len(chunks)
                fds += chunks
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return adopted, fds

    def release(self) -> None:
        """Drop the launcher's mappings and addresses (memory already adopted stays with the process), and the
        chunks' descriptors no one took."""
        exported, self._exported = self._exported, None
        for fd in exported[1] if exported is not None else ():
            os.close(fd)
        for region in self.staged.values():
            try:
                region.release()
            except RegionError:
                pass
        self.staged.clear()

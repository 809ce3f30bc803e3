"""vLLM sleep-mode backend ``coldsnap``: ``--enable-sleep-mode --sleep-mode-backend coldsnap`` (the flag exists
from vLLM 0.33; ``COLDSNAP_VLLM_SLEEP_BACKEND=coldsnap`` selects it on any, for a model coldsnap loaded).

vLLM's ``/sleep`` ends in ``Worker.sleep(level)`` → ``suspend(level)``; ``/wake_up`` in
``Worker.wake_up(tags)`` → ``resume(tags)``. With the ``coldsnap`` load format the model's weights and
KV cache live in coldsnap's stable regions, so this backend does with them what a snapshot does:
``suspend`` writes the weights to a native pack (page cache, then disk) and unmaps every region, at
any level — the addresses stay reserved, so CUDA graphs and every tensor pointer stay valid;
``resume`` maps the requested regions again, hydrates the weights from the pack at the same addresses
and zeroes the KV cache (vLLM's own wake does not zero it); the CUDA graphs' memory (the ``cudagraph``
region, :mod:`coldsnap_vllm.graph_memory`) comes back, zeroed, with whichever tags wake first.
``discard`` unmaps regions without keeping anything (vLLM's KV release).

The pack goes to ``COLDSNAP_SLEEP_PACK_DIR`` (default ``/dev/shm/coldsnap-sleep-<process group>``, one
directory for every worker of a ``vllm serve``; a page-cache backed directory makes suspend and
resume memory-bandwidth bound).

Tensor parallel: every worker sleeps with its own pack and writes a hibernation record,
``hibernation-rank<R>.json`` (rank, world, sleep generation, packs, layout digest), atomically, once
its suspend succeeded. A worker's resume first reads every rank's record: if any rank of the world
has none for this generation (its suspend failed, or it never slept) the distributed state is
partial, and the wake is refused with the ranks named — the worker stays asleep rather than
serve beside a peer that lost its weights. vLLM's CPU worker ignores sleep,
so on this project's machines the backend is exercised directly (tests/integration/test_vllm_cpu.py);
on GPUs it has not run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from vllm.device_allocator.sleep_mode_backend import SleepModeBackend

from coldsnap.agent.memory import ModelMemory, ModelMemoryError
from coldsnap.atomic import write_atomic
from coldsnap.settings import SETTINGS

__all__ = ["ColdsnapSleepBackend", "BACKEND_NAME"]

BACKEND_NAME = "coldsnap"


def _process_memory() -> ModelMemory:
    from coldsnap_vllm.process import process_memory

    memory = process_memory()
    if memory is None:
        raise ModelMemoryError("the coldsnap sleep backend needs the model loaded with --load-format coldsnap")
    return memory


class PartialSleepError(ModelMemoryError):
    """Some rank of the world has no hibernation record for this sleep: waking would be partial."""


class ColdsnapSleepBackend(SleepModeBackend):
    _state: str  # SleepModeBackend's: RUNNING, SUSPENDED, RESUMING

    def __init__(self) -> None:
        super().__init__()
        self.pack_dir = Path(SETTINGS.text("COLDSNAP_SLEEP_PACK_DIR") or f"/dev/shm/coldsnap-sleep-{os.getpgrp()}")
        self.packs: dict[str, str] = {}
        self.seconds: dict[str, float] = {}
        from coldsnap_vllm.process import distributed_rank

        self.rank, self.world = distributed_rank()
        self.generation = 0  # sleeps of this worker; every worker of a world sleeps together

    def _record_path(self, rank: int) -> Path:
        return self.pack_dir / f"hibernation-rank{rank}.json"

    def suspend(self, level: int = 1) -> None:
        if self._state != "RUNNING":
            raise RuntimeError(f"coldsnap sleep backend: suspend while {self._state}")
        memory = _process_memory()
        written = memory.release(self.seconds, self.pack_dir)
        self.packs = {"payload": written["payload"]["path"], "residual": written["residual"]["path"]}
        self.generation += 1
        record = {"rank": self.rank, "world": self.world, "generation": self.generation, "pid": os.getpid(),
                  "layout_digest": memory.layout.digest(), **self.packs}
        write_atomic(self._record_path(self.rank), (json.dumps(record, sort_keys=True) + "\n").encode())
        self._state = "SUSPENDED"

    def check_whole_world_asleep(self) -> None:
        """Every rank of the world wrote its record for this generation; else PartialSleepError."""
        missing = []
        for rank in range(self.world):
            try:
                record = json.loads(self._record_path(rank).read_text())
            except (OSError, ValueError):
                missing.append(rank)
                continue
            if record.get("world") != self.world or record.get("generation") != self.generation:
                missing.append(rank)
        if missing:
            raise PartialSleepError(f"rank(s) {missing} of {self.world} have no hibernation record for sleep "
                                    f"{self.generation} in {self.pack_dir} (their suspend failed or never ran): "
                                    "waking now would be partial; this worker stays asleep")

    def resume(self, tags: list[str] | None = None) -> None:
        if self._state != "SUSPENDED":
            raise RuntimeError(f"coldsnap sleep backend: resume while {self._state}")
        memory = _process_memory()
        self.check_whole_world_asleep()
        self._state = "RESUMING"
        graphs = memory.regions.get("cudagraph")
        if tags is not None and graphs is not None and graphs.high_water and not graphs.mapped_bytes:
            tags = [*tags, "cudagraph"]  # vLLM wakes "weights" and "kv_cache"; any forward replays the graphs
        try:
            memory.restore(self.seconds, payload=self.packs["payload"], residual=self.packs["residual"], tags=tags)
        except BaseException:
            self._state = "SUSPENDED"  # nothing half-awake: the regions the call mapped are dropped again
            for tag in tags or list(memory.regions):
                if tag in memory.regions:
                    memory.regions[tag].unmap()
            raise
        asleep = [t for t, r in memory.regions.items() if r.high_water and not r.mapped_bytes]
        self._state = "SUSPENDED" if asleep else "RUNNING"

    def discard(self, tags: tuple[str, ...]) -> None:
        memory = _process_memory()
        for tag in tags:
            if tag in memory.regions:
                memory.regions[tag].unmap()

    @classmethod
    def preserves_communicators(cls) -> bool:
        return True  # nothing but stable regions is touched: NCCL communicators stay as they are

    @classmethod
    def preserves_compiled_artifacts(cls) -> bool:
        return True  # the process and its compiled code stay

    @classmethod
    def preserves_graphs_with_communicators(cls) -> bool:
        return True  # graphs replay at the same addresses

    @classmethod
    def supports_durable_storage(cls) -> bool:
        return True  # the pack is a file; `coldsnap capture` makes the whole process durable

"""vLLM sleep-mode backend ``coldsnap``: ``--enable-sleep-mode --sleep-mode-backend coldsnap``.

vLLM's ``/sleep`` ends in ``Worker.sleep(level)`` → ``suspend(level)``; ``/wake_up`` in
``Worker.wake_up(tags)`` → ``resume(tags)``. With the ``coldsnap`` load format the model's weights and
KV cache live in coldsnap's stable regions, so this backend does with them what a snapshot does:
``suspend`` writes the weights to a native pack (page cache, then disk) and unmaps every region, at
any level — the addresses stay reserved, so CUDA graphs and every tensor pointer stay valid;
``resume`` maps the requested regions again, hydrates the weights from the pack at the same addresses
and zeroes the KV cache (vLLM's own wake does not zero it). ``discard`` unmaps regions without keeping
anything (vLLM's KV release).

The pack goes to ``COLDSNAP_SLEEP_PACK_DIR`` (default ``/dev/shm/coldsnap-sleep-<pid>``; a page-cache
backed directory makes suspend and resume memory-bandwidth bound). vLLM's CPU worker ignores sleep,
so on this project's machines the backend is exercised directly (tests/integration/test_vllm_cpu.py);
on GPUs it has not run.
"""

from __future__ import annotations

import os
from pathlib import Path

from vllm.device_allocator.sleep_mode_backend import SleepModeBackend

from coldsnap.agent.memory import ModelMemory, ModelMemoryError

__all__ = ["ColdsnapSleepBackend", "BACKEND_NAME"]

BACKEND_NAME = "coldsnap"


def _process_memory() -> ModelMemory:
    from coldsnap_vllm.loader import process_memory

    memory = process_memory()
    if memory is None:
        raise ModelMemoryError("the coldsnap sleep backend needs the model loaded with --load-format coldsnap")
    return memory


class ColdsnapSleepBackend(SleepModeBackend):
    def __init__(self) -> None:
        super().__init__()
        self.pack_dir = Path(os.environ.get("COLDSNAP_SLEEP_PACK_DIR", f"/dev/shm/coldsnap-sleep-{os.getpid()}"))
        self.packs: dict[str, str] = {}
        self.seconds: dict[str, float] = {}

    def suspend(self, level: int = 1) -> None:
        if self._state != "RUNNING":
            raise RuntimeError(f"coldsnap sleep backend: suspend while {self._state}")
        memory = _process_memory()
        written = memory.release(self.seconds, self.pack_dir)
        self.packs = {"payload": written["payload"]["path"], "residual": written["residual"]["path"]}
        self._state = "SUSPENDED"

    def resume(self, tags: list[str] | None = None) -> None:
        if self._state != "SUSPENDED":
            raise RuntimeError(f"coldsnap sleep backend: resume while {self._state}")
        memory = _process_memory()
        self._state = "RESUMING"
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

"""vLLM's CUDA-graph memory in coldsnap's ``cudagraph`` region.

vLLM captures every CUDA graph of a worker into one private memory pool (the platform's global graph
pool, an id its graph wrappers and Model Runner V2's graph managers take once). torch keeps that pool's
segments while the graphs live: 656 MiB on the 8B model, 32 MiB of it in use, and the CUDA checkpoint
would copy all of it into the process image and back at every restore. Yet between two replays that
memory is scratch: a replay writes every intermediate before it reads it, and the graphs' inputs and
KV cache live elsewhere. So, as the reference workload's decode graph does, the pool is served from the
``cudagraph`` region (address space reserved, chunks mapped as captures reach them): a snapshot unmaps
it, a restore maps it again at the same addresses and zeroes it, and the retained graphs replay there.

Only where the graphs are retained across a snapshot (one rank: graphs with NCCL kernels in them are
recaptured on a rebuilt communicator, :mod:`coldsnap_vllm.distributed`). ``COLDSNAP_VLLM_GRAPH_REGION=0``
leaves the pool torch's own. ``COLDSNAP_POISON_GRAPH_MEMORY=1`` fills the region with 0xFF instead of
zeros at resume: a check that no replay reads this memory before writing it (a restored server must then
still answer as a cold start does)."""

from __future__ import annotations

import logging
from typing import Any

from coldsnap.memory import StableRegion, engine_graph_pool, reserve
from coldsnap.settings import SETTINGS

__all__ = ["GRAPH_REGION_BYTES", "GRAPH_REGION_ENV", "POISON_ENV", "GraphRegionPoison", "place_graph_pool"]

log = logging.getLogger("vllm.coldsnap")

GRAPH_REGION_BYTES = 32 << 30
"""Address space for the graphs' memory (the 8B model's default capture sizes map ~0.7 GiB of it)."""
GRAPH_REGION_ENV = "COLDSNAP_VLLM_GRAPH_REGION"
POISON_ENV = "COLDSNAP_POISON_GRAPH_MEMORY"


def place_graph_pool(device: int, world: int, runner: Any = None) -> StableRegion | None:
    """Reserve the ``cudagraph`` region on ``device`` and make its pool the one every later vLLM graph
    capture of this process uses (graph wrappers built before, during vLLM's compilation, and the graph
    managers of Model Runner V2 ``runner``, built before its KV cache, are pointed at it too). None, and
    vLLM's pool unchanged, at more than one rank, when switched off, or when the region cannot be had
    (with a warning: the graphs' memory then goes into the process image, as before)."""
    if world != 1 or not SETTINGS.flag(GRAPH_REGION_ENV):
        return None
    from coldsnap_vllm import compat

    try:
        region = reserve("cudagraph", GRAPH_REGION_BYTES, backend="cuda", device=device)
        pool = engine_graph_pool("cudagraph")
        compat.point_graph_captures_at(pool, *compat.model_runner_v2_graph_managers(runner))
    except Exception as exc:  # noqa: BLE001 - the plugin never breaks its engine: the graphs keep torch's pool
        log.warning("coldsnap: vLLM's CUDA graphs stay in torch's own pool (and their memory in the process "
                    "image): the cudagraph region could not be set up: %s: %s", type(exc).__name__, exc)
        return None
    log.info("coldsnap: vLLM's CUDA graphs capture into the cudagraph region at 0x%x", region.base)
    return region


class GraphRegionPoison:
    """An agent ``after_resume`` hook, added only when :meth:`wanted` (``COLDSNAP_POISON_GRAPH_MEMORY=1`` at
    capture, which the restored process's environment still holds): the resumed region's bytes become 0xFF
    (after the zeroing every resume does, before anything replays)."""

    def __init__(self, region: StableRegion):
        self.region = region

    @staticmethod
    def wanted() -> bool:
        return SETTINGS.flag(POISON_ENV)

    def __call__(self) -> None:
        if not self.region.mapped_bytes:
            return
        import torch

        memory: Any = self.region.tensor(torch.uint8, (self.region.mapped_bytes,))
        memory.fill_(0xFF)
        torch.cuda.synchronize(memory.device)
        log.warning("coldsnap: %s=1: the cudagraph region's %d MiB were filled with 0xFF", POISON_ENV,
                    self.region.mapped_bytes >> 20)

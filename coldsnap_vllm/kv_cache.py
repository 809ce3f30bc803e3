"""vLLM's KV cache in coldsnap's ``kv_cache`` region.

Every KV allocation function this vLLM has (:data:`coldsnap_vllm.compat.KV_ALLOCATION_SITES`: one backing
buffer per worker, or one tensor per layer on 0.26) is wrapped: for a model the ``coldsnap`` load format
placed, its buffers come from the region (discarded at capture, zeroed at restore). Once weights and KV
cache are both in regions, and the CUDA graphs' pool in its own (:mod:`coldsnap_vllm.graph_memory`), the
process's model memory is complete and its agent attaches.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from coldsnap.agent.memory import ModelMemory
from coldsnap_vllm import compat
from coldsnap_vllm.agent_bootstrap import attach_agent
from coldsnap_vllm.graph_memory import place_graph_pool
from coldsnap_vllm.placement import call_with_kv_region, kv_capacity, layout_for
from coldsnap_vllm.process import ProcessState, distributed_rank

__all__ = ["install_kv_hooks"]

log = logging.getLogger("vllm.coldsnap")  # under vLLM's logger: the lines show in the engine's log


def _kv_allocator(original: Any, shared_backing: bool) -> Any:
    """Wrap one vLLM KV allocation function so that, for a coldsnap model, its backing buffers come from
    the ``kv_cache`` region; then the process's model memory is complete and the agent starts."""

    def allocate(*args: Any, **kwargs: Any) -> Any:
        config = next((a for a in (*args, *kwargs.values()) if hasattr(a, "kv_cache_tensors")), None)
        if (ProcessState.placed is None or config is None or not config.kv_cache_tensors or ProcessState.memory is not None
                or ProcessState.allocating_kv):
            return original(*args, **kwargs)
        weights = ProcessState.placed.region
        ProcessState.allocating_kv = True
        try:
            result, region = call_with_kv_region(original, kv_capacity(config, shared_backing), weights.backend,
                                                 weights.device, *args, **kwargs)
        finally:
            ProcessState.allocating_kv = False
        if region is None:
            log.warning("coldsnap: vLLM %s allocated its KV cache differently than expected; it stays in ordinary "
                        "memory (and goes into a capture's process image)", compat.vllm_version())
        regions = {"weights": weights}
        if region is not None:
            regions["kv_cache"] = region
            log.info("coldsnap: KV cache in the kv_cache region: %d bytes at 0x%x", region.mapped_bytes, region.base)
        # (vLLM captures its graphs after the KV cache is allocated: their pool is in place before)
        graphs = (place_graph_pool(weights.device, distributed_rank()[1], ProcessState.runner)
                  if weights.backend == "cuda" else None)
        if graphs is not None:
            regions["cudagraph"] = ProcessState.graph_region = graphs
        ProcessState.memory = ModelMemory(layout_for(ProcessState.placed, region, graphs), regions)
        attach_agent()
        return result

    allocate.__wrapped__ = original  # type: ignore[attr-defined]
    allocate.__coldsnap_kv__ = True  # type: ignore[attr-defined]
    return allocate


def install_kv_hooks() -> list[str]:
    """Hook every KV allocation function this vLLM has (idempotent); the names hooked."""
    hooked = []
    for site in compat.KV_ALLOCATION_SITES:
        owner_symbol = site.symbol.rsplit(".", 1)[0] if len(site.path) > 1 else site.module
        try:
            owner = compat.lookup(owner_symbol)
            original = compat.lookup(site.symbol)
        except LookupError:
            continue
        if getattr(original, "__coldsnap_kv__", False):
            hooked.append(site.symbol)
            continue
        wrapper = _kv_allocator(original, shared_backing=site.shared_backing)
        setattr(owner, site.path[-1], wrapper)
        for name in site.also_bound:  # modules that imported the function by name
            try:
                bound = importlib.import_module(name)
            except Exception:  # noqa: BLE001 - a runner this build does not have (or cannot import) is not used
                continue
            if getattr(bound, site.path[-1], None) is original:
                setattr(bound, site.path[-1], wrapper)
        hooked.append(site.symbol)
    if not hooked:
        compat.disabled("the KV cache in coldsnap's kv_cache region (discarded at capture, zeroed at restore)",
                        "none of its known KV allocation functions exists; the KV cache stays in ordinary memory")
    return hooked

"""vLLM's KV cache in coldsnap's ``kv_cache`` region: the stand-in that serves a vLLM KV allocation
function's backing buffers from the region. Weight placement is engine-neutral
(:mod:`coldsnap.agent.placement`, re-exported here). No vLLM import here: the functions take torch
modules and vLLM's KV config objects, which is what keeps them testable without vLLM.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from coldsnap.agent.placement import ALIGN, PlacedModel, layout_for, place_model_in_region, planned_extents
from coldsnap.memory import StableRegion, reserve

__all__ = ["PlacedModel", "place_model_in_region", "planned_extents", "layout_for", "call_with_kv_region", "kv_capacity",
           "KvRegionZeros", "ALIGN"]


class KvRegionZeros:
    """Stands in for the ``torch`` module inside one call of a vLLM KV allocation function: every
    one-dimensional ``torch.zeros(n, dtype=int8)`` it makes (its KV backing buffers: one per layer in
    vLLM 0.26, one shared in 0.33) is carved out of the ``kv_cache`` region and zeroed; everything else
    is torch's. ``served`` lists the (offset, bytes) it handed out."""

    def __init__(self, torch: ModuleType, region: StableRegion):
        self._torch = torch
        self._region = region
        self.served: list[tuple[int, int]] = []
        self.refused: list[int] = []  # int8 buffers that did not fit what was reserved

    def zeros(self, *size: Any, dtype: Any = None, device: Any = None, **kwargs: Any) -> Any:
        shape = tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list)) else size
        if dtype == self._torch.int8 and len(shape) == 1 and not kwargs:
            nbytes = int(shape[0])
            used = self.served[-1][0] + self.served[-1][1] if self.served else 0
            if -(-used // ALIGN) * ALIGN + nbytes <= self._region.size:
                offset = self._region.allocate(nbytes, ALIGN)
                if self._region.backend == "cuda":  # fresh host mappings are zero already; touching them
                    self._region.zero(offset, nbytes)  # would make them resident
                self.served.append((offset, nbytes))
                return self._region.tensor(self._torch.int8, (nbytes,), offset)
            self.refused.append(nbytes)
        return self._torch.zeros(*size, dtype=dtype, device=device, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._torch, name)


def kv_capacity(kv_cache_config: Any, shared_backing: bool) -> int:
    """Bytes the ``kv_cache`` region must hold for ``kv_cache_config``: one backing of the (common)
    tensor size where vLLM shares one allocation (0.29+), else every tensor's own, 4 KiB-aligned, with
    packed tensors (``block_stride > 0``) sharing one (0.26)."""
    tensors = list(kv_cache_config.kv_cache_tensors)
    aligned = [-(-int(t.size) // ALIGN) * ALIGN for t in tensors]
    if shared_backing:
        return max(aligned)
    packed = [a for t, a in zip(tensors, aligned) if getattr(t, "block_stride", 0) > 0]
    return sum(a for t, a in zip(tensors, aligned) if getattr(t, "block_stride", 0) <= 0) + max(packed, default=0)


def call_with_kv_region(function: Any, capacity: int, backend: str, device: int, *args: Any,
                        **kwargs: Any) -> tuple[Any, StableRegion | None]:
    """Run ``function`` (a vLLM KV allocation function or method) so that its KV
    backing buffers come from the ``kv_cache`` region (``capacity`` bytes reserved, mapped as they are
    handed out). Returns its result and the region, or None for the region when no buffer came through
    the stand-in or some did not fit (the KV cache then lives, wholly or partly, in ordinary memory and
    would go into the process image)."""
    import torch

    region = reserve("kv_cache", capacity, backend=backend, device=device)
    stand_in = KvRegionZeros(torch, region)
    namespace = function.__globals__  # the module whose code runs: its `torch` is swapped for this call
    previous = namespace["torch"]
    namespace["torch"] = stand_in
    try:
        result = function(*args, **kwargs)
    finally:
        namespace["torch"] = previous
    if not stand_in.served or stand_in.refused:
        if not stand_in.served:
            region.unmap()
        return result, None
    return result, region

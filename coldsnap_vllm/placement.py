"""Moving a loaded vLLM model's tensors into coldsnap's stable regions, and the KV cache with them.

vLLM builds and post-processes the model its own way; coldsnap then copies every parameter storage
into the ``weights`` region (4 KiB-aligned, one extent per storage, shared storages once) and rebinds
the parameters to those bytes, so the native pack can be written from and hydrated to fixed
addresses. Buffers (rotary caches, attention scales: small, computed at build, not in the checkpoint)
stay where vLLM made them, in the process image: the region then holds exactly what vLLM's weight
loaders fill from the safetensors, so a recovery restore can refill all of it through them. The KV cache is allocated straight into the ``kv_cache`` region. No vLLM import here:
the functions take torch modules and tensors, which is what keeps them testable without vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from coldsnap.contracts.layout import MemoryLayout
from coldsnap.memory import StableRegion, reserve

__all__ = ["PlacedModel", "place_model_in_region", "planned_extents", "layout_for", "call_with_kv_region", "kv_capacity",
           "KvRegionZeros"]

ALIGN = 4096


@dataclass
class PlacedModel:
    """What :func:`place_model_in_region` did: the region and one layout entry per storage."""

    region: StableRegion
    tensors: list[dict[str, Any]] = field(default_factory=list)
    bytes: int = 0


def _backend(device: Any) -> tuple[str, int]:
    return ("host", 0) if device.type == "cpu" else ("cuda", device.index or 0)


def _storages(model: Any) -> tuple[list[tuple[Any, int]], dict[int, dict[str, Any]], int]:
    """Every distinct parameter with its storage's key, the distinct storages with planned region
    offsets, and the bytes the region needs (4 KiB-aligned storages, each once). A parameter that two
    modules share (tied weights) is one entry; parameters sharing a storage share its extent."""
    names: dict[int, str] = {}
    parameters: list[Any] = []
    for name, tensor in model.named_parameters(remove_duplicate=False):
        if id(tensor) in names or tensor is None or tensor.is_meta or tensor.numel() == 0:
            continue
        names[id(tensor)] = name
        parameters.append(tensor)
    if not parameters:
        raise ValueError("the model has no parameters to place")
    device = parameters[0].device
    slots: list[tuple[Any, int]] = []  # (parameter, its storage's key before placement)
    storages: dict[int, dict[str, Any]] = {}
    offset = 0
    for tensor in parameters:
        if tensor.device != device:
            raise ValueError(f"{names[id(tensor)]} is on {tensor.device}, the model on {device}")
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        slots.append((tensor, key))
        if key not in storages:
            storages[key] = {"name": names[id(tensor)], "nbytes": storage.nbytes(), "offset": offset}
            offset = -(-(offset + storage.nbytes()) // ALIGN) * ALIGN
    return slots, storages, offset


def planned_extents(model: Any) -> set[tuple[int, int]]:
    """(offset, length) of every storage as :func:`place_model_in_region` would lay it out."""
    return {(entry["offset"], entry["nbytes"]) for entry in _storages(model)[1].values()}


def place_model_in_region(model: Any, tag: str = "weights") -> PlacedModel:
    """Copy every parameter of ``model`` into the region ``tag`` and rebind them there."""
    import torch

    slots, storages, offset = _storages(model)
    device = slots[0][0].device
    backend, index = _backend(device)
    region = reserve(tag, max(offset, ALIGN), backend=backend, device=index)
    region.map(max(offset, ALIGN))
    placed = PlacedModel(region)
    copied: dict[int, Any] = {}
    with torch.no_grad():
        for tensor, key in slots:
            entry = storages[key]
            raw = copied.get(entry["offset"])
            if raw is None:
                raw = region.tensor(torch.uint8, (entry["nbytes"],), entry["offset"])
                raw.copy_(torch.empty(0, dtype=torch.uint8, device=device).set_(tensor.untyped_storage()))
                copied[entry["offset"]] = raw
                placed.tensors.append({"name": entry["name"], "dtype": "uint8", "shape": [entry["nbytes"]],
                                       "offset": entry["offset"], "length": entry["nbytes"]})
                placed.bytes += entry["nbytes"]
            typed = raw.view(tensor.dtype) if entry["nbytes"] % tensor.element_size() == 0 else raw
            moved = typed.as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())
            tensor.data = moved  # the same Parameter object: vLLM's references stay valid
    return placed


def layout_for(placed: PlacedModel, kv: StableRegion | None) -> MemoryLayout:
    regions = [{"tag": placed.region.tag, "size_bytes": placed.region.size, "tensors": placed.tensors}]
    if kv is not None:
        regions.append({"tag": kv.tag, "size_bytes": kv.size, "tensors": []})
    return MemoryLayout.model_validate({"format": 1, "regions": regions})


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
    tensor size where vLLM shares one allocation (0.27+), else every tensor's own, 4 KiB-aligned, with
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

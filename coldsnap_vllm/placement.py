"""Moving a loaded vLLM model's tensors into coldsnap's stable regions, and the KV cache with them.

vLLM builds and post-processes the model its own way; coldsnap then copies every parameter and
buffer storage into the ``weights`` region (4 KiB-aligned, one extent per storage, shared storages
once) and rebinds the tensors to those bytes, so the native pack can be written from and hydrated to
fixed addresses. The KV cache is allocated straight into the ``kv_cache`` region. No vLLM import here:
the functions take torch modules and tensors, which is what keeps them testable without vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from coldsnap.contracts.layout import MemoryLayout
from coldsnap.memory import StableRegion, reserve

__all__ = ["PlacedModel", "place_model_in_region", "planned_extents", "layout_for", "call_with_kv_region"]

ALIGN = 4096


@dataclass
class PlacedModel:
    """What :func:`place_model_in_region` did: the region and one layout entry per storage."""

    region: StableRegion
    tensors: list[dict[str, Any]] = field(default_factory=list)
    bytes: int = 0


def _backend(device: Any) -> tuple[str, int]:
    return ("host", 0) if device.type == "cpu" else ("cuda", device.index or 0)


def _storages(model: Any) -> tuple[list[tuple[Any, str, str, Any]], dict[int, dict[str, Any]], int]:
    """Every parameter and buffer slot, their distinct storages with planned region offsets, and the
    bytes the region needs (4 KiB-aligned storages, each once)."""
    slots: list[tuple[Any, str, str, Any]] = []  # (module, kind, name, tensor)
    for module in model.modules():
        for kind in ("_parameters", "_buffers"):
            for name, tensor in getattr(module, kind).items():
                if tensor is None or tensor.is_meta or tensor.numel() == 0:
                    continue
                slots.append((module, kind, name, tensor))
    if not slots:
        raise ValueError("the model has no parameters or buffers to place")
    device = slots[0][3].device
    names = {id(t): n for n, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]}
    storages: dict[int, dict[str, Any]] = {}
    offset = 0
    for _, _, name, tensor in slots:
        if tensor.device != device:
            raise ValueError(f"{names.get(id(tensor), name)} is on {tensor.device}, the model on {device}")
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in storages:
            storages[key] = {"name": names.get(id(tensor), name), "nbytes": storage.nbytes(), "offset": offset}
            offset = -(-(offset + storage.nbytes()) // ALIGN) * ALIGN
    return slots, storages, offset


def planned_extents(model: Any) -> set[tuple[int, int]]:
    """(offset, length) of every storage as :func:`place_model_in_region` would lay it out."""
    return {(entry["offset"], entry["nbytes"]) for entry in _storages(model)[1].values()}


def place_model_in_region(model: Any, tag: str = "weights") -> PlacedModel:
    """Copy every parameter and buffer of ``model`` into the region ``tag`` and rebind them there."""
    import torch

    slots, storages, offset = _storages(model)
    device = slots[0][3].device
    backend, index = _backend(device)
    region = reserve(tag, max(offset, ALIGN), backend=backend, device=index)
    region.map(max(offset, ALIGN))
    placed = PlacedModel(region)
    copied: dict[int, Any] = {}
    with torch.no_grad():
        for module, kind, name, tensor in slots:
            entry = storages[tensor.untyped_storage().data_ptr()]
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
            if kind == "_parameters":
                tensor.data = moved  # the same Parameter object: vLLM's references stay valid
            else:
                module._buffers[name] = moved
    return placed


def layout_for(placed: PlacedModel, kv: StableRegion | None) -> MemoryLayout:
    regions = [{"tag": placed.region.tag, "size_bytes": placed.region.size, "tensors": placed.tensors}]
    if kv is not None:
        regions.append({"tag": kv.tag, "size_bytes": kv.size, "tensors": []})
    return MemoryLayout.model_validate({"format": 1, "regions": regions})


class _ZerosFromRegion:
    """Stands in for the ``torch`` module inside vLLM's ``allocate_kv_cache`` for one call: its one
    ``torch.zeros(size, dtype=int8, device=...)`` backing buffer comes from the region; everything
    else is torch's."""

    def __init__(self, torch: ModuleType, buffer: Any):
        self._torch = torch
        self._buffer = buffer
        self.used = False

    def zeros(self, *size: Any, dtype: Any = None, device: Any = None, **kwargs: Any) -> Any:
        shape = size[0] if len(size) == 1 and isinstance(size[0], (tuple, list)) else size
        if not self.used and dtype == self._torch.int8 and tuple(shape) in ((self._buffer.numel(),),
                                                                             (int(self._buffer.numel()),)):
            self.used = True
            return self._buffer
        return self._torch.zeros(*size, dtype=dtype, device=device, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._torch, name)


def call_with_kv_region(function: Any, module: ModuleType, size: int, device: Any, *args: Any,
                        **kwargs: Any) -> tuple[Any, StableRegion | None]:
    """Run ``function`` (vLLM's ``allocate_kv_cache``, defined in ``module``) so that its backing buffer
    of ``size`` bytes is the ``kv_cache`` region, mapped and zeroed. Returns its result and the region,
    or None for the region when the allocation did not come through the stand-in (the KV cache then
    lives in ordinary memory and goes into the process image)."""
    import torch

    backend, index = _backend(device)
    region = reserve("kv_cache", size, backend=backend, device=index)
    region.map(size)
    if backend == "cuda":  # fresh host mappings are zero already; touching them would make them resident
        region.zero()
    stand_in = _ZerosFromRegion(torch, region.tensor(torch.int8, (size,)))
    previous = module.torch
    module.torch = stand_in
    try:
        result = function(*args, **kwargs)
    finally:
        module.torch = previous
    if not stand_in.used:
        region.unmap()
        return result, None
    return result, region

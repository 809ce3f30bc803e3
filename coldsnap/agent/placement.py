"""Moving a loaded model's parameters into coldsnap's ``weights`` stable region (engine-neutral).

An engine builds and post-processes its model its own way; coldsnap then copies every parameter storage
into the ``weights`` region (4 KiB-aligned, one extent per storage, shared storages once) and rebinds
the parameters to those bytes, so the native pack can be written from and hydrated to fixed
addresses. Buffers (rotary caches, attention scales: small, computed at build, not in the checkpoint)
stay where the engine made them, in the process image: the region then holds exactly what the engine's
weight loaders fill from the safetensors, so a recovery restore can refill all of it through them.
Used by both engine plugins; no engine import here: the functions take torch modules and tensors.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coldsnap.contracts.layout import MemoryLayout
from coldsnap.contracts.placement import NATIVE_PACK_ENV, WEIGHTS_MODE_ENV
from coldsnap.memory import StableRegion, reserve
from coldsnap.hydrate import hydrate_pack
from coldsnap.payload import NativePack, verify_file
from coldsnap.payload.errors import PackError
from coldsnap.settings import SETTINGS

__all__ = ["ALIGN", "MODES", "OPTION_KEYS", "PackDoesNotFit", "PlacedModel", "append_model_to_region", "check_pack_fits",
           "layout_for", "load_options", "open_fitting_pack", "pack_end", "place_model_in_region", "placed_extents",
           "planned_extents", "fitting_pack", "place_weights", "split_load_config", "storage_offsets"]

ALIGN = 4096


@dataclass
class PlacedModel:
    """What :func:`place_model_in_region` (or :func:`append_model_to_region`) did: the region and one
    layout entry per storage; ``end`` is the 4 KiB-aligned offset after the last storage, where a model
    placed after this one starts."""

    region: StableRegion
    tensors: list[dict[str, Any]] = field(default_factory=list)
    bytes: int = 0
    end: int = 0


def _backend(device: Any) -> tuple[str, int]:
    return ("host", 0) if device.type == "cpu" else ("cuda", device.index or 0)


def _storages(model: Any, start: int = 0) -> tuple[list[tuple[Any, int]], dict[int, dict[str, Any]], int]:
    """Every distinct parameter with its storage's key, the distinct storages with planned region
    offsets from ``start``, and the offset after the last (4 KiB-aligned storages, each once). A
    parameter that two modules share (tied weights) is one entry; parameters sharing a storage share its
    extent."""
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
    offset = start
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


def planned_extents(model: Any, start: int = 0) -> set[tuple[int, int]]:
    """(offset, length) of every storage as :func:`place_model_in_region` would lay it out (from ``start``:
    as :func:`append_model_to_region` would after a model that ends there)."""
    return {(entry["offset"], entry["nbytes"]) for entry in _storages(model, start)[1].values()}


def storage_offsets(model: Any, start: int = 0) -> dict[int, int]:
    """Each parameter storage's address now → its offset in the region :func:`place_model_in_region`
    would lay it out in (ask before placing: placement moves the storages)."""
    return {key: entry["offset"] for key, entry in _storages(model, start)[1].items()}


def _move_into(region: StableRegion, slots: list[tuple[Any, int]], storages: dict[int, dict[str, Any]],
               placed: PlacedModel, copy: bool, prefix: str = "") -> None:
    """Rebind every parameter to its planned bytes in ``region`` (copying its values there unless the
    region already holds them: a pack hydrated them) and note one layout entry per storage."""
    import torch

    device = slots[0][0].device
    moved: dict[int, Any] = {}
    with torch.no_grad():
        for tensor, key in slots:
            entry = storages[key]
            raw = moved.get(entry["offset"])
            if raw is None:
                raw = region.tensor(torch.uint8, (entry["nbytes"],), entry["offset"])
                if copy:
                    raw.copy_(torch.empty(0, dtype=torch.uint8, device=device).set_(tensor.untyped_storage()))
                moved[entry["offset"]] = raw
                placed.tensors.append({"name": prefix + entry["name"], "dtype": "uint8", "shape": [entry["nbytes"]],
                                       "offset": entry["offset"], "length": entry["nbytes"]})
                placed.bytes += entry["nbytes"]
            typed = raw.view(tensor.dtype) if entry["nbytes"] % tensor.element_size() == 0 else raw
            tensor.data = typed.as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())
            # the same Parameter object: the engine's references stay valid


def place_model_in_region(model: Any, tag: str = "weights", reserve_bytes: int = 0) -> PlacedModel:
    """Copy every parameter of ``model`` into the region ``tag`` and rebind them there. ``reserve_bytes``
    reserves more address space than the model needs (only what it needs is mapped): room for a model
    placed after it (:func:`append_model_to_region`), e.g. a speculative draft that loads later."""
    slots, storages, end = _storages(model)
    backend, index = _backend(slots[0][0].device)
    region = reserve(tag, max(end, ALIGN, reserve_bytes), backend=backend, device=index)
    region.map(max(end, ALIGN))
    placed = PlacedModel(region, end=end)
    _move_into(region, slots, storages, placed, copy=True)
    return placed


def append_model_to_region(model: Any, placed: PlacedModel, *, prefix: str, copy: bool = True) -> PlacedModel:
    """Place a second model's parameters in ``placed``'s region right after it (a speculative draft
    beside its target: one region, one pack, one hydration). ``placed`` grows to list both models'
    storages (the second's named with ``prefix``: a pack names each tensor once, and a draft's
    ``model.embed_tokens.weight`` is also its target's); the second model's own placement is returned.
    ``copy=False``: the region already holds the model's bytes there (a pack written with both models
    hydrated them), so the parameters are only rebound. Raises ``ValueError`` when the region has no
    room left for the model."""
    slots, storages, end = _storages(model, placed.end)
    region = placed.region
    if _backend(slots[0][0].device) != (region.backend, region.device):
        raise ValueError(f"the model is on {slots[0][0].device}, the {region.tag} region on {region.backend} "
                         f"device {region.device}")
    if end > region.size:
        raise ValueError(f"region {region.tag!r} has {region.size - placed.end} bytes left after the first model, "
                         f"this model needs {end - placed.end}")
    if copy:
        region.map(end)
    elif end > region.mapped_bytes:
        raise ValueError(f"region {region.tag!r} holds {region.mapped_bytes} bytes; the model's planned bytes end at {end}")
    own = PlacedModel(region, end=end)
    _move_into(region, slots, storages, own, copy=copy, prefix=prefix)
    placed.tensors.extend(own.tensors)
    placed.bytes += own.bytes
    placed.end = end
    return own


def layout_for(placed: PlacedModel, *discarded: StableRegion | None) -> MemoryLayout:
    """The layout of the placed weights and the ``discarded`` regions that exist (KV cache, graph memory:
    address space only, no tensors to keep)."""
    regions = [{"tag": placed.region.tag, "size_bytes": placed.region.size, "tensors": placed.tensors}]
    regions += [{"tag": r.tag, "size_bytes": r.size, "tensors": []} for r in discarded if r is not None]
    return MemoryLayout.model_validate({"format": 1, "regions": regions})


# The ``coldsnap`` load format's options, the same for every engine (its model-loader extra config).
MODES = ("auto", "native", "recovery", "cache-only-auto")
OPTION_KEYS = ("mode", "pack")


def load_options(extra: dict[str, Any], option: str) -> tuple[str, Path | None]:
    """``mode`` and ``pack`` from the load format's extra config (``option`` names the engine's flag in
    messages): ``auto`` (default) and ``cache-only-auto`` use the pack when it fits the model, else load
    through the engine; ``native`` requires a fitting pack; ``recovery`` always loads through the engine.
    Where the config names neither, an n580 restore's placement does (``COLDSNAP_WEIGHTS_MODE``,
    ``COLDSNAP_NATIVE_PACK``): the template's engine hydrates the capture's pack at load time."""
    mode = extra.get("mode", SETTINGS.choice(WEIGHTS_MODE_ENV) or "auto")
    if mode not in MODES:
        raise ValueError(f"{option} mode must be one of {', '.join(MODES)}, not {mode!r}")
    pack = extra.get("pack", SETTINGS.text(NATIVE_PACK_ENV))
    if pack is not None and not isinstance(pack, str):
        raise ValueError(f"{option} pack must be a path to a native pack, not {pack!r}")
    if mode == "native" and not pack:
        raise ValueError(f"coldsnap mode 'native' needs {option} pack=<native pack written by coldsnap capture>; use "
                         "mode 'auto' to load through the engine when there is none")
    return mode, Path(pack) if pack else None


def split_load_config(load_config: Any, option: str, load_format: Any) -> tuple[str, Path | None, Any]:
    """``(mode, pack, inner)`` from an engine's load config for the ``coldsnap`` load format: coldsnap's
    options, and a copy of the config for the engine's own default loading, with ``load_format`` (the
    engine's safetensors format: the files a capture pins) and the extra config without coldsnap's keys.
    A copy, so the shared config still names coldsnap to the engine's next loader lookup."""
    extra = dict(load_config.model_loader_extra_config or {})
    mode, pack = load_options(extra, option)
    inner = copy.copy(load_config)
    inner.load_format = load_format
    inner.model_loader_extra_config = {k: v for k, v in extra.items() if k not in OPTION_KEYS}
    return mode, pack, inner


class PackDoesNotFit(ValueError):
    """The native pack was written for another model, dtype or engine build: its tensors are not this model's."""


def _pack_weight_extents(pack: NativePack) -> set[tuple[int, int]]:
    return {(t.offset, t.length) for e in pack.extents if e.region == "weights" for t in e.tensors}


def pack_end(pack: NativePack) -> int:
    """The offset after the pack's last weight extent: how much of the region it fills."""
    return max((offset + length for offset, length in _pack_weight_extents(pack)), default=0)


def check_pack_fits(pack: NativePack, extents: set[tuple[int, int]], *, start: int = 0, end: int | None = None) -> None:
    """Every weight storage of this model at the same offset and length in the pack, and nothing else
    between ``start`` and ``end`` (default: the whole pack). A window is one model of several the pack
    holds (a speculative target and its draft); ``end`` set also requires the pack to hold more after it."""
    theirs = {e for e in _pack_weight_extents(pack) if e[0] >= start and (end is None or e[0] < end)}
    if extents != theirs:
        missing, extra = len(extents - theirs), len(theirs - extents)
        raise PackDoesNotFit(f"native pack {pack.path.name} does not fit this model: {missing} of its {len(extents)} "
                             f"weight tensors are not in the pack and {extra} of the pack's are not the model's "
                             "(another model, dtype or engine build)")
    if end is not None and pack_end(pack) <= end:
        raise PackDoesNotFit(f"native pack {pack.path.name} holds this model only, not the model placed after it "
                             "(a speculative draft): it was written without one")


def open_fitting_pack(path: Path, extents: set[tuple[int, int]], *, start: int = 0, end: int | None = None) -> NativePack:
    """The native pack at ``path``, verified against the digest its name claims (a stat-bound record
    makes this cheap) and checked to fit ``extents`` (:func:`check_pack_fits`); raises
    :class:`PackDoesNotFit` or a pack error."""
    verify_file(path)
    pack = NativePack.open(path)
    check_pack_fits(pack, extents, start=start, end=end)
    return pack


def placed_extents(placed: PlacedModel) -> set[tuple[int, int]]:
    """(offset, length) of every storage :func:`place_model_in_region` placed."""
    return {(t["offset"], t["length"]) for t in placed.tensors}


def fitting_pack(path: Path | None, mode: str, model: Any, engine: str, log: logging.Logger, *,
                 followed: bool = False) -> NativePack | None:
    """The native pack a ``coldsnap`` load format starts ``model`` from: None without one or in mode
    ``recovery``; a pack that does not fit (or fails verification) is an error in mode ``native``, else
    one warning and None (the engine loads the weights itself). ``followed``: a second model (a
    speculative draft) is placed after this one, and the pack must hold both."""
    if path is None or mode == "recovery":
        return None
    try:
        _, storages, end = _storages(model)  # once: planned_extents would walk the model again
        extents = {(entry["offset"], entry["nbytes"]) for entry in storages.values()}
        return open_fitting_pack(path, extents, end=end if followed else None)
    except (PackDoesNotFit, PackError) as exc:
        if mode == "native":
            raise ValueError(f"coldsnap mode 'native': {exc}") from None
        log.warning("coldsnap: %s; loading the weights through %s instead (recovery)", exc, engine)
        return None


def place_weights(model: Any, pack: NativePack | None, mode: str, log: logging.Logger, *, reserve_bytes: int = 0,
                  followed: bool = False) -> PlacedModel:
    """``model``'s parameters moved into the ``weights`` region, then filled from ``pack`` when there is
    one (else they keep what the engine loaded). ``followed`` (with ``reserve_bytes`` of address space):
    a second model is placed after this one; the whole pack, which holds both, is hydrated now, and the
    second model's parameters are rebound to its bytes (:func:`append_model_to_region`, ``copy=False``)."""
    placed = place_model_in_region(model, reserve_bytes=reserve_bytes)
    if pack is not None:
        # post-processing could have changed the layout
        check_pack_fits(pack, placed_extents(placed), end=placed.end if followed else None)
        if followed:
            placed.region.map(pack_end(pack))
        stats = hydrate_pack(pack.path, {"weights": placed.region})
        log.info("coldsnap: %d bytes of weights hydrated from %s at %.2f GB/s (native)", stats.bytes,
                 pack.path.name, stats.gb_per_s)
    else:
        log.info("coldsnap: %d bytes of weights in the stable region at 0x%x (recovery, mode %s)", placed.bytes,
                 placed.region.base, mode)
    return placed

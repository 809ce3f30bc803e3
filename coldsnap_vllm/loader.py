"""``--load-format coldsnap`` for vLLM: weights and KV cache in coldsnap's stable regions, and the agent.

    vllm serve MODEL --load-format coldsnap [--model-loader-extra-config '{"mode": "auto"}']

The loader builds and loads the model exactly as vLLM's default loader does (weights come through
vLLM's own iteration of the model's safetensors: the *recovery* path), runs
``process_weights_after_loading``, then moves every parameter and buffer into the ``weights`` region.
vLLM's KV cache backing buffer is allocated in the ``kv_cache`` region. Once both exist, and when
``COLDSNAP_CONTROL`` is set (``coldsnap capture`` sets it), the in-process agent starts: ``prepare``
writes the native pack from the regions and releases them, ``resume`` hydrates them at the same
addresses and zeroes the KV cache (vLLM does not zero on wake; coldsnap does).

On CPUs, vLLM normally repacks linear weights for oneDNN/SGL kernels into buffers it owns (dropping
the originals), which would put the weights back into the process image; the loader keeps them as
plain tensors in the region and lets vLLM use ``torch.nn.functional.linear`` on them.

Options (``--model-loader-extra-config``): ``pack`` — a native pack to start from; ``mode`` — ``auto``
(default) and ``cache-only-auto`` use the pack when it fits this model, else load through vLLM;
``native`` requires a fitting pack; ``recovery`` always loads through vLLM. Other keys go to vLLM's
default loader.
"""

from __future__ import annotations

import contextlib
import copy
import os
import threading
from pathlib import Path
from typing import Any, Iterator

import torch
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
from vllm.model_executor.model_loader.utils import process_weights_after_loading
from vllm.utils.torch_utils import set_default_torch_dtype
from vllm.logger import init_logger
from vllm.platforms import current_platform

from coldsnap.agent.memory import ModelMemory
from coldsnap.hydrate import hydrate_pack
from coldsnap.payload import NativePack, verify_file
from coldsnap.payload.errors import PackError
from coldsnap_vllm import compat
from coldsnap_vllm.placement import (PlacedModel, call_with_kv_region, kv_capacity, layout_for, place_model_in_region,
                                     planned_extents)

__all__ = ["ColdsnapModelLoader", "LOAD_FORMAT", "MODES", "process_memory"]

log = init_logger("vllm.coldsnap")  # vLLM's logger: the lines show in vLLM's own log format
LOAD_FORMAT = "coldsnap"
MODES = ("auto", "native", "recovery", "cache-only-auto")
OPTION_KEYS = ("mode", "pack")


class _Process:
    """This process's coldsnap state: the placed weights, then its model memory (with the KV region), then the agent."""

    placed: PlacedModel | None = None
    memory: ModelMemory | None = None
    agent: Any = None
    allocating_kv = False  # inside a hooked KV allocation: a hooked function calling another is served once
    runner: Any = None  # the model runner whose KV cache was placed (its graphs are the agent's to release)


def process_memory() -> ModelMemory | None:
    """This process's model memory once weights and KV cache are in their regions (else None)."""
    return _Process.memory


def _options(extra: dict[str, Any]) -> tuple[str, Path | None]:
    mode = extra.get("mode", "auto")
    if mode not in MODES:
        raise ValueError(f"--model-loader-extra-config mode must be one of {', '.join(MODES)}, not {mode!r}")
    pack = extra.get("pack")
    if pack is not None and not isinstance(pack, str):
        raise ValueError(f"--model-loader-extra-config pack must be a path to a native pack, not {pack!r}")
    if mode == "native" and not pack:
        raise ValueError("coldsnap mode 'native' needs --model-loader-extra-config pack=<native pack written by "
                         "coldsnap capture>; use mode 'auto' to load through vLLM when there is none")
    return mode, Path(pack) if pack else None


class PackDoesNotFit(ValueError):
    """The native pack was written for another model, dtype or vLLM build: its tensors are not this model's."""


def _check_pack_fits(pack: Any, extents: set[tuple[int, int]]) -> None:
    """Every weight storage of this model at the same offset and length in the pack, and nothing else."""
    theirs = {(t.offset, t.length) for e in pack.extents if e.region == "weights" for t in e.tensors}
    if extents != theirs:
        missing, extra = len(extents - theirs), len(theirs - extents)
        raise PackDoesNotFit(f"native pack {pack.path.name} does not fit this model: {missing} of its {len(extents)} "
                             f"weight tensors are not in the pack and {extra} of the pack's are not the model's "
                             "(another model, dtype or vLLM build)")


@contextlib.contextmanager
def _plain_cpu_linear() -> Iterator[None]:
    """On CPU, keep linear weights as tensors (vLLM would repack them into kernel-owned buffers)."""
    if not current_platform.is_cpu():
        yield
        return
    import vllm.model_executor.layers.utils as layer_utils

    original = layer_utils.dispatch_cpu_unquantized_gemm

    def keep_weight(layer: torch.nn.Module, remove_weight: bool) -> None:
        # setattr: torch types Module attributes as tensors or modules, and this one is a function
        setattr(layer, "cpu_linear", torch.nn.functional.linear)

    layer_utils.dispatch_cpu_unquantized_gemm = keep_weight
    try:
        yield
    finally:
        layer_utils.dispatch_cpu_unquantized_gemm = original


@register_model_loader(LOAD_FORMAT)
class ColdsnapModelLoader(DefaultModelLoader):
    """vLLM's default loading, then the model's tensors moved into the ``weights`` region."""

    def __init__(self, load_config: Any):
        extra = dict(load_config.model_loader_extra_config or {})
        self.mode, self.pack = _options(extra)
        # vLLM's default loading reads the checkpoint by load format: safetensors (the pinned model's
        # files). A copy, so the shared config still says `coldsnap` to the next get_model_loader().
        inner = copy.copy(load_config)
        inner.load_format = "safetensors"
        inner.model_loader_extra_config = {k: v for k, v in extra.items() if k not in OPTION_KEYS}
        super().__init__(inner)

    def _recover(self, model: torch.nn.Module, model_config: Any) -> None:
        """Recovery: the weights through vLLM's own iteration of the model's safetensors."""
        try:
            self.load_weights(model, model_config)
        except RuntimeError as exc:
            if "Cannot find any model weights" not in str(exc):
                raise
            raise RuntimeError(f"coldsnap recovery (mode {self.mode!r}, no fitting pack) loads the model's safetensors "
                               f"through vLLM and found none: {exc}") from None

    def get_external_weight_memory(self, vllm_config: Any) -> int:
        """0, deliberately. vLLM asks this in ``init_device`` for weights that exist *before* its startup
        memory snapshot (another process's, as with ``ipc_cache``) and takes them out of the engine's
        budget. coldsnap's weights are allocated in this worker after that snapshot — loaded, then
        moved into the ``weights`` region, or hydrated there from a pack — so vLLM's profiling already
        sees them (as the memory the region maps); reporting them here would count them twice and
        shrink the KV cache by the model's size. (Reasoned from vLLM 0.33's ``request_memory`` and
        ``determine_available_memory``; vLLM's CPU worker never calls this, and no GPU run has checked
        the resulting KV budget.)"""
        return 0

    def load_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> torch.nn.Module:
        """vLLM's BaseModelLoader.load_model with one fork: when a native pack fits the freshly built
        model, its weights come from the pack (after placement) instead of the checkpoint. The model
        is built once either way (vLLM refuses to register its attention layers twice)."""
        if compat.online_quantized_before_build(vllm_config):  # 0.33: quantized while loading: vLLM's own path
            with _plain_cpu_linear():
                model = super().load_model(vllm_config, model_config, prefix)
            return self._place(model, None)
        load_device = vllm_config.device_config.device if self.load_config.device is None else self.load_config.device
        target_device = torch.device(load_device)
        with set_default_torch_dtype(model_config.dtype):
            with target_device:
                model = compat.create_model(self, vllm_config, model_config, prefix)
            online = compat.online_quantized_model(model)  # 0.26 tells it from the built model
            pack = None if online else self._fitting_pack(model)
            if pack is None:
                self._recover(model, model_config)
            if online:
                compat.finalize_online_quantization(model, model_config)
            with _plain_cpu_linear():
                process_weights_after_loading(model, model_config, target_device)
        return self._place(model, pack).eval()

    def _fitting_pack(self, model: torch.nn.Module) -> NativePack | None:
        if self.pack is None or self.mode == "recovery":
            return None
        try:
            verify_file(self.pack)  # the digest its name claims (a stat-bound record makes this cheap)
            pack = NativePack.open(self.pack)
            _check_pack_fits(pack, planned_extents(model))
            return pack
        except (PackDoesNotFit, PackError) as exc:
            if self.mode == "native":
                raise ValueError(f"coldsnap mode 'native': {exc}") from None
            log.warning("coldsnap: %s; loading the weights through vLLM instead (recovery)", exc)
            return None

    def _place(self, model: torch.nn.Module, pack: NativePack | None) -> torch.nn.Module:
        placed = place_model_in_region(model)
        if pack is not None:
            # Weight post-processing could have changed the layout the pack was checked against.
            _check_pack_fits(pack, {(t["offset"], t["length"]) for t in placed.tensors})
            stats = hydrate_pack(pack.path, {"weights": placed.region})
            log.info("coldsnap: %d bytes of weights hydrated from %s at %.2f GB/s (native)", stats.bytes,
                     pack.path.name, stats.gb_per_s)
        else:
            log.info("coldsnap: %d bytes of weights in the stable region at 0x%x (recovery, mode %s)",
                     placed.bytes, placed.region.base, self.mode)
        _Process.placed = placed
        return model


def _kv_allocator(original: Any, shared_backing: bool) -> Any:
    """Wrap one vLLM KV allocation function so that, for a coldsnap model, its backing buffers come from
    the ``kv_cache`` region; then the process's model memory is complete and the agent starts."""

    def allocate(*args: Any, **kwargs: Any) -> Any:
        config = next((a for a in (*args, *kwargs.values()) if hasattr(a, "kv_cache_tensors")), None)
        if (_Process.placed is None or config is None or not config.kv_cache_tensors or _Process.memory is not None
                or _Process.allocating_kv):
            return original(*args, **kwargs)
        weights = _Process.placed.region
        _Process.allocating_kv = True
        try:
            result, region = call_with_kv_region(original, kv_capacity(config, shared_backing), weights.backend,
                                                 weights.device, *args, **kwargs)
        finally:
            _Process.allocating_kv = False
        if region is None:
            log.warning("coldsnap: vLLM %s allocated its KV cache differently than expected; it stays in ordinary "
                        "memory (and goes into a capture's process image)", compat.vllm_version())
        regions = {"weights": weights}
        if region is not None:
            regions["kv_cache"] = region
            log.info("coldsnap: KV cache in the kv_cache region: %d bytes at 0x%x", region.mapped_bytes, region.base)
        _Process.memory = ModelMemory(layout_for(_Process.placed, region), regions)
        _start_agent()
        return result

    allocate.__wrapped__ = original  # type: ignore[attr-defined]
    allocate.__coldsnap_kv__ = True  # type: ignore[attr-defined]
    return allocate


def _install_kv_hooks() -> list[str]:
    """Hook every KV allocation function this vLLM has (compat.KV_ALLOCATION_SITES); the names hooked."""
    import importlib

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


def distributed_rank() -> tuple[int, int]:
    """This worker's global rank and the world size (0 of 1 when vLLM runs no process group)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _start_agent() -> None:
    control = os.environ.get("COLDSNAP_CONTROL")
    if not control or _Process.memory is None:
        return
    from coldsnap.agent import start_agent

    # One agent per worker that owns model memory (EngineCore's worker at TP=1, every WorkerProc at
    # TP>1), each at its rank's control socket. vLLM's engine loop is idle whenever the launcher drives
    # the agents (after the canary, before resume); the lock only keeps two commands from overlapping.
    from coldsnap.agent.server import AgentHooks
    from coldsnap_vllm.distributed import VllmCollectives, VllmGraphs

    rank, world = distributed_rank()
    hooks = AgentHooks()
    if _Process.runner is not None:
        graphs = VllmGraphs(_Process.runner, world)
        hooks.release_graphs, hooks.recapture_graphs = graphs.release_graphs, graphs.recapture_graphs
    _Process.agent = start_agent(control, _Process.memory, serving_lock=threading.Lock(), rank=rank, world=world,
                                 hooks=hooks, collectives=VllmCollectives(rank, world) if world > 1 else None)
    log.info("coldsnap: agent of rank %d/%d listening at %s", rank, world, _Process.agent.control)


def _remembering_runner(initialize_kv_cache: Any) -> Any:
    def initialize(self: Any, *args: Any, **kwargs: Any) -> Any:
        _Process.runner = self
        return initialize_kv_cache(self, *args, **kwargs)

    initialize.__wrapped__ = initialize_kv_cache  # type: ignore[attr-defined]
    return initialize


def _remember_runners() -> None:
    """Wrap the model runners' ``initialize_kv_cache`` (V1, V2, CPU) to note which runner this is."""
    import importlib

    for module_name, class_name in (("vllm.v1.worker.gpu_model_runner", "GPUModelRunner"),
                                    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner"),
                                    ("vllm.v1.worker.cpu_model_runner", "CPUModelRunner")):
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):
            continue  # not in this vLLM build
        method = cls.__dict__.get("initialize_kv_cache")
        if method is not None and not hasattr(method, "__wrapped__"):
            cls.initialize_kv_cache = _remembering_runner(method)


_remember_runners()
KV_HOOKS = _install_kv_hooks()

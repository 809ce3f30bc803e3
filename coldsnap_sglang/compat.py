"""Every SGLang symbol coldsnap's plugin touches, and what to do when one is missing (supported: 0.5.17 → 0.5.23).

The rest of ``coldsnap_sglang`` asks this module instead of importing SGLang's internals by name, so
that an SGLang without a hook coldsnap needs loses that one feature, with one warning naming the SGLang
version, and never fails to start: a plugin must not break its engine. Read from the 0.5.17 and 0.5.23
wheels (their torch pins: 2.11.0 and 2.14.1), where every symbol below has the same name and shape:

- **load format** (:data:`VERIFY_LOAD_FORMAT`, :data:`LOAD_FORMAT_CHOICES`): ``--load-format`` has
  argparse choices (extended with ``server_args.add_load_format_choices``), and ``LoadConfig`` turns the
  string into a closed ``LoadFormat`` enum in ``_verify_load_format``, which would raise on ``coldsnap``;
  a hook around it puts the loader *class* there instead, which ``get_model_loader`` instantiates as is;
- **the loader's base** (:data:`DEFAULT_LOADER`): ``DefaultModelLoader`` (its ``_initialize_model``,
  ``_get_quantization_config``, ``_get_all_weights``, ``load_weights_and_postprocess``);
- **the memory saver** (:data:`MEMORY_SAVER_CREATE`): ``TorchMemorySaverAdapter.create``, which every KV
  pool calls for the adapter whose ``region("kv_cache")`` wraps its buffer allocation;
- **the model runner** (:data:`ALLOC_MEMORY_POOL`, :data:`INIT_CUDA_GRAPHS`): ``ModelRunner.alloc_memory_pool``
  (after it the scheduler's model memory is complete and its agent attaches) and ``init_cuda_graphs``
  (recapture after a restore that dropped the graphs, into a fresh process-wide graph pool:
  :data:`GRAPH_POOL_SETTER`);
- **the server's** ``/flush_cache`` route: empties the prefix cache and the pools (on the scheduler's
  thread) before the KV cache is released;
- **speculative decoding** (:data:`SPEC_CONFIG`, :data:`INIT_ALL_CUDA_GRAPHS`, :data:`DRAFT_GRAPHS`): the
  process's speculative settings (``runtime_context.get_spec()``: algorithm, draft model path and load
  format), which tell the target's load whether a draft will be placed after it; the scheduler, whose
  ``draft_worker`` (the spec worker; its own ``draft_worker`` the ``EagleDraftWorker`` every
  draft-model algorithm builds on) holds the draft's graph runners (``cuda_graph_runner``,
  ``cuda_graph_runner_for_draft_extend``, rebuilt by ``init_cuda_graphs``); the scheduler loop's request
  broadcast (:data:`BROADCAST_REQUESTS`), where the agent's steps run on the scheduler's own thread;
- **the memory-occupation endpoints** (:data:`RELEASE_MEMORY_OCCUPATION`, :data:`RESUME_MEMORY_OCCUPATION`):
  ``TokenizerControlMixin``'s coroutines behind ``/release_memory_occupation`` and
  ``/resume_memory_occupation`` (and ``Engine``'s methods), refused on a coldsnap-loaded server;
- **tensor parallelism** (:data:`DISTRIBUTED_SURFACE`): ``parallel_state._groups`` (every
  ``GroupCoordinator`` by unique name), ``PyNcclCommunicator`` (rebuilt inside them after a restore),
  ``is_symmetric_memory_enabled``, and ``SchedulerRequestReceiver._broadcast_reqs_across_ranks``
  (:data:`BROADCAST_REQUESTS`, where the agents' steps run in lockstep); without them no agent attaches
  at TP > 1 (one warning). The other communicators rebuilt (:data:`REBUILT_COMMUNICATORS`) are probed.

``scripts/api-surface.py`` records which of :data:`PROBED` a wheel has (``tests/fixtures/sglang-*-surface.json``,
checked by ``tests/unit/test_sglang_compat.py``).
"""

from __future__ import annotations

import logging
import re

from coldsnap.plugin import exists, lookup

__all__ = ["SUPPORTED", "PROBED", "sglang_version", "supported", "probe", "lookup", "exists", "disabled",
           "VERIFY_LOAD_FORMAT", "LOAD_FORMAT_CHOICES", "DEFAULT_LOADER", "MEMORY_SAVER_CREATE", "ALLOC_MEMORY_POOL",
           "INIT_CUDA_GRAPHS", "MODEL_RUNNER_MODULE", "LOAD_FORMAT_CHOICE_LIST", "HOOK_REGISTRY", "HOOK_TYPE",
           "SPEC_CONFIG", "SCHEDULER_MODULE", "INIT_ALL_CUDA_GRAPHS", "DRAFT_GRAPHS", "GRAPH_POOL_SETTER", "TOKENIZER_CONTROL_MODULE",
           "RELEASE_MEMORY_OCCUPATION", "RESUME_MEMORY_OCCUPATION", "INHERITED", "LOADER_SURFACE", "hook_target",
           "speculative_draft_load_format", "PARALLEL_GROUPS", "PYNCCL", "SYMMETRIC_MEMORY_ENABLED", "BROADCAST_REQUESTS",
           "DISTRIBUTED_SURFACE",
           "REBUILT_COMMUNICATORS"]

log = logging.getLogger("sglang.coldsnap")  # under SGLang's logger: the lines show in the engine's log

SUPPORTED = ((0, 5, 17), (0, 5, 24))
"""SGLang releases coldsnap's plugin supports: from 0.5.17 up to, not including, 0.5.24."""

VERIFY_LOAD_FORMAT = "sglang.srt.configs.load_config:LoadConfig._verify_load_format"
LOAD_FORMAT_CHOICES = "sglang.srt.server_args:add_load_format_choices"
LOAD_FORMAT_CHOICE_LIST = "sglang.srt.server_args:LOAD_FORMAT_CHOICES"
DEFAULT_LOADER = "sglang.srt.model_loader.loader:DefaultModelLoader"
MEMORY_SAVER_CREATE = "sglang.srt.utils.torch_memory_saver_adapter:TorchMemorySaverAdapter.create"
MODEL_RUNNER_MODULE = "sglang.srt.model_executor.model_runner"
ALLOC_MEMORY_POOL = f"{MODEL_RUNNER_MODULE}:ModelRunner.alloc_memory_pool"
INIT_CUDA_GRAPHS = f"{MODEL_RUNNER_MODULE}:ModelRunner.init_cuda_graphs"

SPEC_CONFIG = "sglang.srt.runtime_context:get_spec"
SCHEDULER_MODULE = "sglang.srt.managers.scheduler"
INIT_ALL_CUDA_GRAPHS = f"{SCHEDULER_MODULE}:Scheduler.init_all_cuda_graphs"
DRAFT_GRAPHS = "sglang.srt.speculative.eagle_worker_v2:EagleDraftWorker._capture_cuda_graphs"
GRAPH_POOL_SETTER = "sglang.srt.model_executor.runner_utils.pool:set_global_graph_memory_pool"
"""The process-wide graph memory pool every graph runner captures into; a recreate starts a fresh one."""
"""Where the draft's graph runners are made (its ``init_cuda_graphs`` calls it); probed, not hooked."""
TOKENIZER_CONTROL_MODULE = "sglang.srt.managers.tokenizer_control_mixin"
RELEASE_MEMORY_OCCUPATION = f"{TOKENIZER_CONTROL_MODULE}:TokenizerControlMixin.release_memory_occupation"
RESUME_MEMORY_OCCUPATION = f"{TOKENIZER_CONTROL_MODULE}:TokenizerControlMixin.resume_memory_occupation"

COMMUNICATORS_MODULE = "sglang.srt.distributed.device_communicators"
PARALLEL_GROUPS = "sglang.srt.distributed.parallel_state:_groups"
PYNCCL = f"{COMMUNICATORS_MODULE}.pynccl:PyNcclCommunicator"
SYMMETRIC_MEMORY_ENABLED = f"{COMMUNICATORS_MODULE}.pynccl_allocator:is_symmetric_memory_enabled"
BROADCAST_REQUESTS = ("sglang.srt.managers.scheduler_components.request_receiver:"
                      "SchedulerRequestReceiver._broadcast_reqs_across_ranks")
"""Where each scheduler loop broadcasts rank 0's requests to the TP group (every iteration, over its gloo
group): hooked so that the agent's steps run there, on the scheduler's thread and in lockstep
(:mod:`coldsnap_sglang.scheduler_thread`)."""
DISTRIBUTED_SURFACE = (PARALLEL_GROUPS, PYNCCL, SYMMETRIC_MEMORY_ENABLED, BROADCAST_REQUESTS)
"""What TP > 1 needs: :mod:`coldsnap_sglang.distributed`'s lookups and the broadcast hook (without them no
agent attaches there)."""
REBUILT_COMMUNICATORS = (f"{COMMUNICATORS_MODULE}.custom_all_reduce:CustomAllreduce.close",
                         f"{COMMUNICATORS_MODULE}.custom_all_reduce_v2:CustomAllReduceV2.close",
                         f"{COMMUNICATORS_MODULE}.torch_symm_mem:TorchSymmMemCommunicator")
"""The communicators it closes and remakes as ``type(old)(group=..., device=...)``, as SGLang makes them
(probed, not looked up: a group holds them)."""

HOOK_REGISTRY = "sglang.srt.plugins.hook_registry:HookRegistry"
HOOK_TYPE = "sglang.srt.plugins.hook_registry:HookType"

LOADER_SURFACE = (f"{DEFAULT_LOADER}._prepare_weights", f"{DEFAULT_LOADER}._get_all_weights",
                  f"{DEFAULT_LOADER}.load_weights_and_postprocess", "sglang.srt.model_loader.loader:_initialize_model",
                  "sglang.srt.model_loader.loader:_get_quantization_config",
                  "sglang.srt.model_loader.utils:set_default_torch_dtype", "sglang.srt.configs.load_config:LoadFormat")
"""What :mod:`coldsnap_sglang.loader` imports from SGLang's loader by name (it runs only under the
load format, which the hook above enables)."""

PROBED = (VERIFY_LOAD_FORMAT, LOAD_FORMAT_CHOICES, LOAD_FORMAT_CHOICE_LIST, DEFAULT_LOADER, MEMORY_SAVER_CREATE,
          ALLOC_MEMORY_POOL, INIT_CUDA_GRAPHS, HOOK_REGISTRY, HOOK_TYPE, SPEC_CONFIG, INIT_ALL_CUDA_GRAPHS, DRAFT_GRAPHS,
          RELEASE_MEMORY_OCCUPATION, RESUME_MEMORY_OCCUPATION, GRAPH_POOL_SETTER, *LOADER_SURFACE, *DISTRIBUTED_SURFACE,
          *REBUILT_COMMUNICATORS)

INHERITED = "inherited"
"""What :func:`speculative_draft_load_format` says when the draft loads with the target's load format."""


def speculative_draft_load_format() -> str | None:
    """The load format this scheduler process's speculative draft model will load with (:data:`INHERITED`:
    the target's), or None when there is no draft model to load (no speculation, n-gram speculation, or an
    SGLang without ``get_spec``)."""
    try:
        spec = lookup(SPEC_CONFIG)()
        if not getattr(spec, "speculative_algorithm", None) or not getattr(spec, "speculative_draft_model_path", None):
            return None
        draft_format = getattr(spec, "speculative_draft_load_format", None)
    except Exception:  # noqa: BLE001 - an SGLang without these settings has no draft coldsnap could place
        return None
    return str(getattr(draft_format, "value", draft_format)).lower() if draft_format else INHERITED


def hook_target(symbol: str) -> str:
    """A ``module:Class.attr`` symbol as HookRegistry's dotted target (``module.Class.attr``)."""
    return symbol.replace(":", ".")


def sglang_version() -> str:
    """The installed SGLang's version ("unknown" when it cannot be told)."""
    import importlib.metadata as metadata

    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return "unknown"


def _patch_release(version: str) -> tuple[int, int, int] | None:
    """(major, minor, patch) of a version string, patch 0 when it has none; None when it is not one."""
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    return (int(match.group(1)), int(match.group(2)), int(match.group(3) or 0)) if match else None


def supported(version: str) -> bool:
    found = _patch_release(version)
    return found is not None and SUPPORTED[0] <= found < SUPPORTED[1]


def probe() -> dict[str, bool]:
    """Which of :data:`PROBED` this SGLang has (importing the modules that hold them)."""
    return {symbol: exists(symbol) for symbol in PROBED}


_warned: set[str] = set()


def disabled(feature: str, reason: str) -> None:
    """Say once per process that ``feature`` is off on this SGLang, and why."""
    if feature in _warned:
        return
    _warned.add(feature)
    log.warning("coldsnap: %s disabled on SGLang %s: %s", feature, sglang_version(), reason)

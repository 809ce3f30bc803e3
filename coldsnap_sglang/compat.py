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
  (recapture after a restore that dropped the graphs);
- **the server's** ``/flush_cache`` route: empties the prefix cache and the pools (on the scheduler's
  thread) before the KV cache is released.
"""

from __future__ import annotations

import logging
import re

from coldsnap.plugin import exists, lookup

__all__ = ["SUPPORTED", "PROBED", "sglang_version", "supported", "probe", "lookup", "exists", "disabled",
           "VERIFY_LOAD_FORMAT", "LOAD_FORMAT_CHOICES", "DEFAULT_LOADER", "MEMORY_SAVER_CREATE", "ALLOC_MEMORY_POOL",
           "INIT_CUDA_GRAPHS", "MODEL_RUNNER_MODULE", "LOAD_FORMAT_CHOICE_LIST", "HOOK_REGISTRY", "HOOK_TYPE",
           "hook_target"]

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

HOOK_REGISTRY = "sglang.srt.plugins.hook_registry:HookRegistry"
HOOK_TYPE = "sglang.srt.plugins.hook_registry:HookType"

PROBED = (VERIFY_LOAD_FORMAT, LOAD_FORMAT_CHOICES, LOAD_FORMAT_CHOICE_LIST, DEFAULT_LOADER, MEMORY_SAVER_CREATE,
          ALLOC_MEMORY_POOL, INIT_CUDA_GRAPHS, HOOK_REGISTRY, HOOK_TYPE)


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

"""coldsnap's SGLang plugin, loaded through the ``sglang.srt.plugins`` entry point.

SGLang runs ``load_plugins()`` in the server, every scheduler process and the detokenizer (before it
parses arguments), so registration is idempotent and imports nothing heavy: the hooks go through
SGLang's ``HookRegistry`` (which SGLang applies right after the plugins ran), and the model runner's
hook is registered only when SGLang itself imports the model runner (in scheduler processes).

What registration installs (:mod:`coldsnap_sglang.compat` names every target):

- ``--load-format coldsnap``: the choice added to SGLang's argument parser, and an AROUND hook on
  ``LoadConfig._verify_load_format`` that puts :class:`coldsnap_sglang.loader.ColdsnapModelLoader` where
  SGLang's closed ``LoadFormat`` enum would reject the string;
- the memory saver (:mod:`coldsnap_sglang.memory_saver`): the KV cache in coldsnap's ``kv_cache`` region;
- the agent (:mod:`coldsnap_sglang.agent_bootstrap`), attached after ``ModelRunner.alloc_memory_pool``,
  the scheduler noted around ``Scheduler.init_all_cuda_graphs`` (a speculative draft's graphs), and the
  agent's steps (graph work; at TP > 1 the NCCL teardown and rebuild too) run on the scheduler's thread
  where ``SchedulerRequestReceiver._broadcast_reqs_across_ranks`` carried rank 0's marker for them, in
  lockstep across the ranks (:mod:`coldsnap_sglang.scheduler_thread`);
- SGLang's ``/release_memory_occupation`` and ``/resume_memory_occupation`` refused on a coldsnap-loaded
  server, with one message (:func:`coldsnap_sglang.memory_saver.refuse_memory_occupation`).

A speculative draft model (``--speculative-algorithm STANDALONE``/``EAGLE``/``EAGLE3`` with
``--speculative-draft-model-path``) loads through the same load format unless
``--speculative-draft-load-format`` names another: its weights go into the ``weights`` region after
the target's, its KV cache into ``kv_cache``.

Supported: SGLang 0.5.17 → 0.5.23. Whatever the installed SGLang, registering never raises: a missing
hook turns its feature off with one warning that names the SGLang version, and a failure to register
at all leaves SGLang running without coldsnap.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any, Callable

from coldsnap.plugin import PluginRegistration, after_import

__all__ = ["register"]

log = logging.getLogger("sglang.coldsnap")


def _coldsnap_load_format(original: Callable[..., Any], load_config: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``LoadConfig._verify_load_format``: ``coldsnap`` becomes the loader class (SGLang's
    ``get_model_loader`` instantiates a class it finds there); every other format is SGLang's."""
    chosen = load_config.load_format
    if isinstance(chosen, str) and chosen.lower() == "coldsnap":
        from coldsnap_sglang.loader import ColdsnapModelLoader
        from coldsnap_sglang.process import ProcessState

        ProcessState.active = True
        load_config.load_format = ColdsnapModelLoader
        return None
    return original(load_config, *args, **kwargs)


def _hook(registry: Any, symbol: str, hook: Callable[..., Any], feature: str, kind: str = "AROUND") -> bool:
    from coldsnap_sglang import compat

    if not compat.exists(symbol):
        compat.disabled(feature, f"SGLang has no {symbol}")
        return False
    hook_type = getattr(compat.lookup(compat.HOOK_TYPE), kind)
    registry.register(compat.hook_target(symbol), hook, hook_type)
    return True


def _hook_model_runner(module: ModuleType) -> None:
    """Once SGLang imported its model runner (a scheduler process): the agent's hook, applied now."""
    from coldsnap_sglang import compat
    from coldsnap_sglang.agent_bootstrap import after_alloc_memory_pool

    registry = compat.lookup(compat.HOOK_REGISTRY)
    if _hook(registry, compat.ALLOC_MEMORY_POOL, after_alloc_memory_pool,
             "the coldsnap agent (capture and restore of this server)"):
        registry.apply_hooks()


def _hook_scheduler(module: ModuleType) -> None:
    """Once SGLang imported its scheduler (a scheduler process): the scheduler noted for the draft's
    graphs, and its request broadcast running the agent's steps (in lockstep across the ranks)."""
    from coldsnap_sglang import compat
    from coldsnap_sglang.agent_bootstrap import around_init_all_cuda_graphs

    from coldsnap_sglang.scheduler_thread import around_broadcast_requests

    registry = compat.lookup(compat.HOOK_REGISTRY)
    hooked = [_hook(registry, compat.INIT_ALL_CUDA_GRAPHS, around_init_all_cuda_graphs,
                    "graph policy 'recreate' for a speculative draft's graphs"),
              _hook(registry, compat.BROADCAST_REQUESTS, around_broadcast_requests,
                    "graph work on the scheduler's thread (at TP 1 a 'recreate' recapture then runs on the agent's, "
                    "much slower; TP > 1 needs it)")]
    if any(hooked):
        registry.apply_hooks()


def _hook_tokenizer_control(module: ModuleType) -> None:
    """Once SGLang imported its tokenizer manager's control mixin (the server's process): the
    memory-occupation endpoints refused on a coldsnap-loaded server."""
    from coldsnap_sglang import compat
    from coldsnap_sglang.memory_saver import refuse_memory_occupation

    registry = compat.lookup(compat.HOOK_REGISTRY)
    feature = "the refusal of /release_memory_occupation and /resume_memory_occupation (they answer success and free nothing)"
    hooked = [_hook(registry, symbol, refuse_memory_occupation, feature)
              for symbol in (compat.RELEASE_MEMORY_OCCUPATION, compat.RESUME_MEMORY_OCCUPATION)]
    if any(hooked):
        registry.apply_hooks()


def _install() -> None:
    from coldsnap_sglang import compat
    from coldsnap_sglang.memory_saver import create

    version = compat.sglang_version()
    (a, b, c), (x, y, z) = compat.SUPPORTED
    supported = f"coldsnap supports SGLang {a}.{b}.{c} to {x}.{y}.{z - 1}"
    try:
        registry = compat.lookup(compat.HOOK_REGISTRY)
    except LookupError as exc:
        raise RuntimeError(f"SGLang {version} has no plugin HookRegistry ({exc}; {supported})") from None
    if not compat.supported(version):
        log.warning("coldsnap: SGLang %s is outside the supported range (%s); the hooks it has are used", version,
                    supported)
    load_format = "--load-format coldsnap"
    if _hook(registry, compat.VERIFY_LOAD_FORMAT, _coldsnap_load_format, load_format):
        if compat.exists(compat.LOAD_FORMAT_CHOICES):
            choices = compat.lookup(compat.LOAD_FORMAT_CHOICE_LIST)
            if "coldsnap" not in choices:
                compat.lookup(compat.LOAD_FORMAT_CHOICES)(["coldsnap"])
        else:
            compat.disabled(load_format, f"SGLang has no {compat.LOAD_FORMAT_CHOICES}")
    _hook(registry, compat.MEMORY_SAVER_CREATE, create,
          "the KV cache in coldsnap's kv_cache region (it stays in ordinary memory and goes into the image)")
    after_import(compat.MODEL_RUNNER_MODULE, _hook_model_runner)
    after_import(compat.SCHEDULER_MODULE, _hook_scheduler)
    after_import(compat.TOKENIZER_CONTROL_MODULE, _hook_tokenizer_control)
    after_import("fastapi", _gate_served_key)  # the HTTP process: a restore's --api-key-file reaches it


def _gate_served_key(_fastapi: Any) -> None:
    from coldsnap.agent.api_key import install_key_gates
    from coldsnap_sglang.served_key import sglang_key_guard

    install_key_gates(sglang_key_guard)


register = PluginRegistration("sglang", _install)

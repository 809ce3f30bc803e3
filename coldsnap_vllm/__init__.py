"""coldsnap's vLLM plugin, loaded through the ``vllm.general_plugins`` entry point.

vLLM calls ``register()`` once in every process it starts (API server, EngineCore, each worker), so
registration is idempotent and this module imports nothing from vLLM at import time. Registration
installs the ``coldsnap`` load format (:mod:`coldsnap_vllm.loader`: weights in a stable region), the
KV-cache hook (:mod:`coldsnap_vllm.kv_cache`: the KV cache in one), which attaches coldsnap's agent in
the process that owns both (:mod:`coldsnap_vllm.agent_bootstrap`), and the ``coldsnap`` sleep-mode
backend (:mod:`coldsnap_vllm.sleep`).

Supported: vLLM 0.26 → 0.33 (:mod:`coldsnap_vllm.compat` finds each hook per release). Whatever the
installed vLLM, registering never raises: a missing hook turns its feature off with one warning that
names the vLLM version, and a failure to register at all leaves vLLM running without coldsnap.
"""

from __future__ import annotations

import logging
from typing import Any

from coldsnap.plugin import PluginRegistration, after_import

log = logging.getLogger("vllm.coldsnap")

__all__ = ["register"]


def _install() -> None:
    """Register the ``coldsnap`` load format (importing the loader registers it) and, where this vLLM
    has pluggable sleep backends, the ``coldsnap`` sleep backend (lazily: vLLM imports it on use)."""
    from coldsnap_vllm import compat

    version = compat.vllm_version()
    low, high = compat.SUPPORTED
    supported = f"coldsnap supports vLLM {low[0]}.{low[1]} to {high[0]}.{high[1] - 1}"
    try:
        import coldsnap_vllm.loader  # noqa: F401 - importing it registers the load format
        from coldsnap_vllm.agent_bootstrap import remember_runners
        from coldsnap_vllm.kv_cache import install_kv_hooks
        from coldsnap_vllm.prefix_cache import install_prefix_cache_reset

        remember_runners()
        install_kv_hooks()
    except Exception as exc:  # noqa: BLE001 - PluginRegistration reports it once; the engine runs on
        raise RuntimeError(f"vLLM {version}: {type(exc).__name__}: {exc} ({supported})") from exc
    if not compat.supported(version):
        log.warning("coldsnap: vLLM %s is outside the supported range (%s); its hooks were found and are used",
                    version, supported)
    after_import(compat.WORKER_MODULE, compat.keep_coldsnap_loads_out_of_sleep_pools)  # in worker processes
    # in the EngineCore process: a restored scheduler must not hand out prefix-cache hits on zeroed KV blocks
    after_import(compat.ENGINE_CORE_MODULE, install_prefix_cache_reset)
    # vLLM's own snapshot (0.31+) of a coldsnap-loaded engine: refused unless coldsnap's sleep backend is chosen
    after_import(compat.SNAPSHOT_CLI_MODULE, compat.guard_vllm_snapshot_create)
    after_import(compat.SNAPSHOT_SERVER_MODULE, compat.guard_vllm_snapshot_server)
    after_import("__main__", compat.guard_vllm_snapshot_server)  # `python -m vllm.snapshot.server`
    # in the API server process: the key gate a restore's --api-key-file installs vLLM's --api-key check with
    after_import("fastapi", _gate_served_key)

    try:
        factory = compat.lookup(compat.SLEEP_FACTORY)
    except LookupError:  # a vLLM without RFC #34303's backends: the load format still works
        compat.disabled("the coldsnap sleep backend", "no SleepModeBackendFactory")
        return
    if "coldsnap" not in factory._registry:  # registering twice raises
        factory.register_backend("coldsnap", "coldsnap_vllm.sleep", "ColdsnapSleepBackend")
    _select_sleep_backend(factory)


def _select_sleep_backend(factory: Any) -> None:
    """``COLDSNAP_VLLM_SLEEP_BACKEND=coldsnap`` makes vLLM's sleep mode use coldsnap's backend on a
    vLLM without ``--sleep-mode-backend`` (before 0.33): its factory creates that backend whatever
    ``model_config.sleep_mode_backend`` says, for a model coldsnap's loader placed. Any other model
    keeps the configured backend (vLLM's ``cumem`` by default): coldsnap's has nothing of it to release,
    and an exported variable must not break vLLM's own sleep. The worker creates its backend at its
    first sleep, after loading."""
    from coldsnap_vllm import compat

    chosen = compat.sleep_backend_override()
    if chosen is None or getattr(factory.create_backend, "__coldsnap_override__", False):
        return
    original = factory.create_backend.__func__

    def create_backend(cls: type, model_config: object) -> object:
        import copy

        from coldsnap_vllm.process import ProcessState

        if ProcessState.placed is None:  # not loaded with --load-format coldsnap
            configured = getattr(model_config, "sleep_mode_backend", "cumem")
            log.info("coldsnap: %s=%s ignored: this model was not loaded with --load-format coldsnap; vLLM's %r "
                     "sleep backend is used", compat.SLEEP_BACKEND_ENV, chosen, configured)
            return original(cls, model_config)
        overridden = copy.copy(model_config)
        object.__setattr__(overridden, "sleep_mode_backend", chosen)
        return original(cls, overridden)

    create_backend.__coldsnap_override__ = True  # type: ignore[attr-defined]
    factory.create_backend = classmethod(create_backend)


def _gate_served_key(_fastapi: Any) -> None:
    from coldsnap.agent.api_key import install_key_gates
    from coldsnap_vllm.served_key import vllm_key_guard

    install_key_gates(vllm_key_guard)


register = PluginRegistration("vllm", _install)

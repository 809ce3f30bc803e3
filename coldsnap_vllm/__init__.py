"""coldsnap's vLLM plugin, loaded through the ``vllm.general_plugins`` entry point.

vLLM calls ``register()`` once in every process it starts (API server, EngineCore, each worker), so
registration is idempotent and this module imports nothing from vLLM at import time. Registration
installs the ``coldsnap`` load format (:mod:`coldsnap_vllm.loader`), which puts weights and KV cache
in stable regions and starts coldsnap's agent in the process that owns them, and the ``coldsnap``
sleep-mode backend (:mod:`coldsnap_vllm.sleep`).
"""

from __future__ import annotations

from coldsnap.plugin import PluginRegistration

__all__ = ["register"]


def _install() -> None:
    """Register the ``coldsnap`` load format (importing the loader registers it) and, where this vLLM
    has pluggable sleep backends, the ``coldsnap`` sleep backend (lazily: vLLM imports it on use)."""
    import coldsnap_vllm.loader  # noqa: F401

    try:
        from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory
    except ImportError:  # a vLLM without RFC #34303's backends: the load format still works
        return
    if "coldsnap" not in SleepModeBackendFactory._registry:  # registering twice raises
        SleepModeBackendFactory.register_backend("coldsnap", "coldsnap_vllm.sleep", "ColdsnapSleepBackend")


register = PluginRegistration("vllm", _install)

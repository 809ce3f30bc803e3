"""coldsnap's vLLM plugin, loaded through the ``vllm.general_plugins`` entry point.

vLLM calls ``register()`` once in every process it starts (API server, EngineCore, each worker), so
registration is idempotent and this module imports nothing from vLLM at import time. Registration
installs the ``coldsnap`` load format (:mod:`coldsnap_vllm.loader`), which puts weights and KV cache
in stable regions and starts coldsnap's agent in the process that owns them.
"""

from __future__ import annotations

from coldsnap.plugin import PluginRegistration

__all__ = ["register"]


def _install() -> None:
    """Register the ``coldsnap`` load format (importing the loader registers it)."""
    import coldsnap_vllm.loader  # noqa: F401


register = PluginRegistration("vllm", _install)

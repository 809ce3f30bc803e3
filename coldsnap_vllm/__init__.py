"""coldsnap's vLLM plugin, loaded through the ``vllm.general_plugins`` entry point.

vLLM calls ``register()`` once in every process it starts (API server, EngineCore, each worker), so
registration is idempotent and this module imports nothing from vLLM at import time. The
``coldsnap`` load format, the sleep backend and the worker extension are installed by
:func:`_install` as they land; today it installs nothing.
"""

from __future__ import annotations

from coldsnap.plugin import PluginRegistration

__all__ = ["register"]


def _install() -> None:
    """Install coldsnap's hooks into vLLM (none yet)."""


register = PluginRegistration("vllm", _install)

"""coldsnap's SGLang plugin, loaded through the ``sglang.srt.plugins`` entry point.

SGLang runs ``load_plugins()`` in the server, every scheduler process and the detokenizer, so
registration is idempotent and this module imports nothing from SGLang at import time. HookRegistry
hooks (load format, memory saver, graphs, NCCL) are installed by :func:`_install` as they land;
today it installs nothing.
"""

from __future__ import annotations

from coldsnap.plugin import PluginRegistration

__all__ = ["register"]


def _install() -> None:
    """Install coldsnap's hooks into SGLang (none yet)."""


register = PluginRegistration("sglang", _install)

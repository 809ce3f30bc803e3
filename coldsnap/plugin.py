"""Idempotent engine-plugin registration shared by ``coldsnap_vllm`` and ``coldsnap_sglang``.

Engines load their plugins once in *every* process they start, sometimes more than once in one
process; installing a hook twice would wrap it twice. The registration runs its installer once per
process, under a lock, and remembers a failure instead of retrying a half-installed state.

A plugin never breaks its engine: engines do not catch what a plugin function raises (vLLM's
``load_general_plugins`` calls it bare), so a failing installer is reported as one warning and the
engine runs without coldsnap.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

__all__ = ["PluginRegistration"]

log = logging.getLogger(__name__)


class PluginRegistration:
    """A callable entry point that runs ``install`` at most once per process."""

    def __init__(self, engine: str, install: Callable[[], None]):
        self.engine = engine
        self._install = install
        self._lock = threading.Lock()
        self._state = "pending"  # pending -> installed | failed

    @property
    def installed(self) -> bool:
        return self._state == "installed"

    def __call__(self) -> None:
        with self._lock:
            if self._state != "pending":
                return
            try:
                self._install()
            except Exception as exc:  # noqa: BLE001 - whatever it is, the engine must still start
                self._state = "failed"
                log.warning("coldsnap %s plugin disabled: it could not register (%s: %s); the engine runs without "
                            "coldsnap", self.engine, type(exc).__name__, exc)
                log.debug("coldsnap %s plugin registration failure", self.engine, exc_info=True)
                return
            self._state = "installed"
            log.debug("coldsnap %s plugin registered", self.engine)

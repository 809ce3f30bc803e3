"""vLLM's prefix cache across a process snapshot: emptied before a restored engine takes its first request.

vLLM's scheduler (in the EngineCore process) keeps a table from the hashes of full KV blocks of earlier
requests to the blocks holding them, and a new request whose prompt starts with such blocks reads them
instead of computing them. A restore zeroes the KV cache (its bytes are not in the image), but the table
is host memory and comes back with the process: a request sharing 16 tokens or more with one served
before the capture (the capture's canary, a chat template's system prompt) would attend to zeroed keys
and values and answer wrongly. vLLM's own sleep empties the table for the same reason
(``EngineCore.sleep``: ``pause_scheduler(clear_cache=True)``).

``EngineCore.add_request`` is wrapped so that the first request after a restore empties the table
first (``EngineCore.reset_prefix_cache``). A restore is told by the process's start time in
``/proc/self/stat``: CRIU restores a process as a new kernel task. This works whatever the tensor-parallel
size (the scheduler runs in the EngineCore process, the agents in the workers), costs one read of
``/proc/self/stat`` per request, and changes nothing in a process that was never restored.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

from coldsnap import host

__all__ = ["KEEP_ENV", "RestoreWatch", "install_prefix_cache_reset"]

log = logging.getLogger("vllm.coldsnap")  # under vLLM's logger: the lines show in the engine's log


class RestoreWatch:
    """Tells, once per restore, that this process was restored since it was last asked."""

    def __init__(self, ticks: Callable[[], int] | None = None):
        self._ticks = ticks or host.process_start_ticks
        self._seen = self._ticks()

    def restored(self) -> bool:
        now = self._ticks()
        return now != self._seen

    def settled(self) -> None:
        """What a restore asked for is done: until the next restore, :meth:`restored` is False."""
        self._seen = self._ticks()


def _resetting_prefix_cache(add_request: Callable[..., Any], watch: RestoreWatch) -> Callable[..., Any]:
    @functools.wraps(add_request)
    def add(self: Any, *args: Any, **kwargs: Any) -> Any:
        if watch.restored():
            if self.reset_prefix_cache():
                log.info("coldsnap: restored; vLLM's prefix cache emptied (its blocks' KV was zeroed)")
                watch.settled()
            else:  # blocks in use: no request runs right after a restore, so this is unexpected; retried
                log.error("coldsnap: restored, but vLLM refused to empty its prefix cache (blocks in use); "
                          "trying again at the next request")
        return add_request(self, *args, **kwargs)

    add.__coldsnap_prefix_reset__ = True  # type: ignore[attr-defined]
    return add


KEEP_ENV = "COLDSNAP_VLLM_KEEP_PREFIX_CACHE"
"""``1``: do not empty the prefix cache after a restore (only to show what goes wrong without it)."""


def install_prefix_cache_reset(module: Any) -> None:
    """Wrap ``module.EngineCore.add_request`` (``module`` is ``vllm.v1.engine.core``); idempotent."""
    from coldsnap.settings import SETTINGS

    if SETTINGS.flag(KEEP_ENV):
        log.warning("coldsnap: %s=1: a restored server keeps its prefix cache over a zeroed KV cache and can "
                    "answer wrongly", KEEP_ENV)
        return
    engine_core = getattr(module, "EngineCore", None)
    add_request = getattr(engine_core, "add_request", None)
    if engine_core is None or add_request is None or not hasattr(engine_core, "reset_prefix_cache"):
        from coldsnap_vllm import compat

        compat.disabled("emptying the prefix cache after a restore",
                        "vllm.v1.engine.core has no EngineCore.add_request and reset_prefix_cache; a restored "
                        "server must run with --no-enable-prefix-caching")
        return
    if getattr(add_request, "__coldsnap_prefix_reset__", False):
        return
    engine_core.add_request = _resetting_prefix_cache(add_request, RestoreWatch())

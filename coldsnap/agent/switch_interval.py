"""The interpreter's thread switch interval while the agent works (:class:`PromptHandoffs`)."""

from __future__ import annotations

import sys
import threading

__all__ = ["AGENT_SWITCH_INTERVAL_S", "PromptHandoffs", "prompt_handoffs"]


AGENT_SWITCH_INTERVAL_S = 0.0001
"""The interpreter's thread switch interval while the agent works (CPython's default: 5 ms)."""


class PromptHandoffs:
    """While a command or a lease is being served, a waiting thread gets the GIL after at most
    :data:`AGENT_SWITCH_INTERVAL_S` instead of CPython's 5 ms. An engine's main loop may spin holding the
    GIL (SGLang's scheduler polls its sockets without sleeping, and the agent does not pause it), and
    every blocking call of the agent's (a socket read, a CUDA call, a lock) gives the GIL away and waits
    up to a switch interval to get it back (100 such calls beside a spinning thread: 0.56 s against
    0.02 s). SGLang's resume after a restore varies 0.17–0.86 s for ~0.1 s of timed work on the H200;
    this did not remove that variance, whose cause is not found yet. Process-wide, so only while the
    agent works: the first user lowers the interval, the last one puts the engine's own back."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._saved = 0.0

    def enter(self) -> None:
        with self._lock:
            if self._users == 0:
                self._saved = sys.getswitchinterval()
                sys.setswitchinterval(min(self._saved, AGENT_SWITCH_INTERVAL_S))
            self._users += 1

    def exit(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0:
                sys.setswitchinterval(self._saved)


prompt_handoffs = PromptHandoffs()

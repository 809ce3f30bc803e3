"""The in-process agent: a small control server inside each engine process that owns model memory.

The launcher talks to it over a unix socket (``COLDSNAP_CONTROL``; a name starting with ``@`` is an
abstract socket, which leaves no file behind to trip a restore), in the typed messages of
:mod:`coldsnap.agent.protocol` through :class:`coldsnap.agent.client.AgentClient`:

- ``status`` → state, pid, serving port, layout digest, regions;
- ``prepare`` {pack_dir, graph_policy} → drain (hold the serving lock), release or keep CUDA graphs,
  tear collectives down, write the native payload and residual packs from the live regions, release
  the regions' physical memory (addresses kept) and the pinned staging ring, so the process image
  holds neither weights nor KV;
- ``resume`` {layout_digest, payload, residual, safetensors, adopted chunks} → map the regions again
  at the same addresses, fill them (chunks the launcher hydrated, a native pack, or recovery replay
  from safetensors), zero the KV cache, rebuild collectives and graphs, release the serving lock;
- ``lease`` → the restored tree lives only as long as the restoring launcher, until it says ``release``.

An engine attaches with :func:`attach` (weights and KV cache in their regions, a serving lock, hooks);
it starts the agent only under ``coldsnap capture`` and does nothing otherwise.

Engine plugins add what only they know through :class:`AgentHooks` (graph policy, NCCL teardown and
rebuild). The launcher side imports :mod:`~coldsnap.agent.protocol` and :mod:`~coldsnap.agent.client`
only; the server (and what it imports) loads on first use of the names below.
"""

import importlib
from typing import Any

__all__ = ["AgentHooks", "AgentServer", "attach", "start_agent"]


_HOMES = {"AgentHooks": "hooks", "AgentServer": "server", "attach": "engine_entry", "start_agent": "engine_entry"}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(f"coldsnap.agent.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'coldsnap.agent' has no attribute {name!r}")

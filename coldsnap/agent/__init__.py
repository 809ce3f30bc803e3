"""The in-process agent: a small control server inside each engine process that owns model memory.

The launcher talks to it over a unix socket (``COLDSNAP_CONTROL``; a name starting with ``@`` is an
abstract socket, which leaves no file behind to trip a restore). One JSON object per line each way:

- ``status`` → state, pid, serving port, layout digest, regions;
- ``prepare`` {pack_dir, generate_pack} → drain (hold the serving lock), write the native payload and
  residual packs from the live regions, release the regions' physical memory (addresses kept) and
  the pinned staging ring, so the process image holds neither weights nor KV;
- ``resume`` {payload, residual, safetensors, layout_digest} → map the regions again at the same
  addresses, hydrate the weights (native pack, or recovery replay from safetensors), zero the KV
  cache, release the serving lock.

Engine plugins add what only they know through :class:`AgentHooks` (graph policy, NCCL teardown and
rebuild).
"""

from coldsnap.agent.server import AgentHooks, AgentServer, request, start_agent

__all__ = ["AgentHooks", "AgentServer", "request", "start_agent"]

"""coldsnap's agent in a vLLM worker: attached once the worker's model memory is complete, with the
graph and collective hooks of :mod:`coldsnap_vllm.distributed`; and the model runner it manages noted
when vLLM initializes the KV cache (V1, V2 and CPU runners)."""

from __future__ import annotations

import importlib
import logging
import threading
from typing import Any

from coldsnap_vllm.process import ProcessState, distributed_rank

__all__ = ["attach_agent", "remember_runners"]

log = logging.getLogger("vllm.coldsnap")  # under vLLM's logger: the lines show in the engine's log


def attach_agent() -> None:
    """Attach coldsnap's agent to this worker's model memory (it starts only under ``coldsnap capture``).

    One agent per worker that owns model memory (EngineCore's worker at TP=1, every WorkerProc at TP>1),
    each at its rank's control socket. vLLM's engine loop is idle whenever the launcher drives the agents
    (after the canary, before resume); the lock only keeps two commands from overlapping."""
    if ProcessState.memory is None:
        return
    from coldsnap.agent import attach
    from coldsnap.agent.hooks import AgentHooks
    from coldsnap_vllm.distributed import VllmCollectives, VllmGraphs
    from coldsnap_vllm.graph_memory import GraphRegionPoison

    rank, world = distributed_rank()
    # Recovery needs the files vLLM loaded and its loaders to refill them; a start from a pack has neither.
    hooks = AgentHooks(recovery_files=list(ProcessState.recovery_files), replay_weights=ProcessState.recovery,
                       recovery_plan=lambda: ProcessState.recovery_plan)
    if ProcessState.runner is not None:
        from coldsnap_vllm.sampler_state import PenaltyStatistics

        graphs = VllmGraphs(ProcessState.runner, world, ProcessState.graph_region)
        hooks.release_graphs, hooks.recapture_graphs = graphs.release_graphs, graphs.recapture_graphs
        penalties = PenaltyStatistics(ProcessState.runner)
        hooks.before_release.append(penalties.release)
        hooks.after_resume.append(penalties.restore)
    if ProcessState.graph_region is not None and GraphRegionPoison.wanted():
        hooks.after_resume.append(GraphRegionPoison(ProcessState.graph_region))
    ProcessState.agent = attach(ProcessState.memory, serving_lock=threading.Lock(), rank=rank, world=world, hooks=hooks,
                                collectives=VllmCollectives(rank, world) if world > 1 else None)
    if ProcessState.agent is not None:
        log.info("coldsnap: agent of rank %d/%d listening at %s", rank, world, ProcessState.agent.control)


def _remembering_runner(initialize_kv_cache: Any) -> Any:
    def initialize(self: Any, *args: Any, **kwargs: Any) -> Any:
        ProcessState.runner = self
        return initialize_kv_cache(self, *args, **kwargs)

    initialize.__wrapped__ = initialize_kv_cache  # type: ignore[attr-defined]
    return initialize


def remember_runners() -> None:
    """Wrap the model runners' ``initialize_kv_cache`` (V1, V2, CPU) to note which runner this is."""
    for module_name, class_name in (("vllm.v1.worker.gpu_model_runner", "GPUModelRunner"),
                                    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner"),
                                    ("vllm.v1.worker.cpu_model_runner", "CPUModelRunner")):
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError):
            continue  # not in this vLLM build
        method = cls.__dict__.get("initialize_kv_cache")
        if method is not None and not hasattr(method, "__wrapped__"):
            cls.initialize_kv_cache = _remembering_runner(method)

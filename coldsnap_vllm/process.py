"""This vLLM process's coldsnap state, shared by the load format, the KV-cache hook, the agent
bootstrap and the sleep backend: the placed weights, then the model memory (once the KV cache is in its
region), then the agent and the model runner whose graphs it manages."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from coldsnap.agent.memory import ModelMemory
from coldsnap_vllm.placement import PlacedModel

if TYPE_CHECKING:
    from coldsnap.memory import StableRegion
    from coldsnap.agent.server import AgentServer
    from coldsnap.hydrate.recovery_plan import RecoveryPlan

__all__ = ["ProcessState", "distributed_rank", "process_memory"]


class ProcessState:
    """Class attributes: one state per process (vLLM loads one model per worker process)."""

    placed: PlacedModel | None = None
    memory: ModelMemory | None = None
    agent: "AgentServer | None" = None
    allocating_kv = False  # inside a hooked KV allocation: a hooked function calling another is served once
    graph_region: "StableRegion | None" = None  # where the CUDA graphs' pool lives (coldsnap_vllm.graph_memory)
    runner: Any = None  # the model runner whose KV cache was placed (its graphs are the agent's to release)
    recovery: "Callable[[list[str]], int] | None" = None  # refills the weights region through vLLM's loaders
    recovery_files: list[str] = []  # the safetensors vLLM loaded the weights from (none: started from a pack)
    recovery_plan: "RecoveryPlan | None" = None  # where their bytes landed unchanged (coldsnap.agent.weight_copies)


def process_memory() -> ModelMemory | None:
    """This process's model memory once weights and KV cache are in their regions (else None)."""
    return ProcessState.memory


def distributed_rank() -> tuple[int, int]:
    """This worker's global rank and the world size (0 of 1 when vLLM runs no process group)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1

"""This SGLang scheduler process's coldsnap state, shared by the load format, the memory saver and the
agent bootstrap: whether the ``coldsnap`` load format is in use here, the placed weights, then the
model memory (once the KV cache is in its region), the agent and the model runner it manages."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from coldsnap.agent.memory import ModelMemory
from coldsnap.agent.placement import PlacedModel

if TYPE_CHECKING:
    from coldsnap.agent.server import AgentServer
    from coldsnap.hydrate.recovery_plan import RecoveryPlan

__all__ = ["ProcessState"]


class ProcessState:
    """Class attributes: one state per scheduler process (one target model per process)."""

    active = False  # a LoadConfig asked for the `coldsnap` load format in this process
    placed: PlacedModel | None = None
    memory: ModelMemory | None = None
    agent: "AgentServer | None" = None
    runner: Any = None  # the target ModelRunner whose graphs the agent may release and recapture
    recovery: "Callable[[list[str]], int] | None" = None  # refills the weights region through SGLang's loaders
    recovery_files: list[str] = []  # the safetensors SGLang loaded the weights from (none: started from a pack)
    recovery_plan: "RecoveryPlan | None" = None  # where their bytes landed unchanged (coldsnap.agent.weight_copies)

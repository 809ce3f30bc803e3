"""This SGLang scheduler process's coldsnap state, shared by the load format, the memory saver and the
agent bootstrap: whether the ``coldsnap`` load format is in use here, the placed weights (the target's,
and a speculative draft's after them), then the model memory (once the KV cache is in its region), the
agent and the model runner and scheduler whose graphs it manages."""

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
    placed: PlacedModel | None = None  # every model's storages in the weights region: the target's, then the draft's
    draft: PlacedModel | None = None  # the speculative draft's own storages (after the target's)
    draft_expected: bool = False  # SGLang said a draft follows the target: the region has room for it
    draft_in_pack: bool = False  # the target's pack held the draft too: the draft's bytes came with the target's
    memory: ModelMemory | None = None
    agent: "AgentServer | None" = None
    runner: Any = None  # the target ModelRunner whose graphs the agent may release and recapture
    scheduler: Any = None  # SGLang's Scheduler (its ``draft_worker``: the speculative worker and its draft graphs)
    recovery: "Callable[[list[str]], int] | None" = None  # refills the weights region through SGLang's loaders
    replays: "list[Callable[[list[str]], int]]" = []  # one per model: what ``recovery`` runs, in placement order
    recovery_files: list[str] = []  # the safetensors SGLang loaded the weights from (none: started from a pack)
    recovery_plan: "RecoveryPlan | None" = None  # where their bytes landed unchanged (coldsnap.agent.weight_copies)

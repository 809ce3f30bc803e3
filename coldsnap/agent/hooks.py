"""What an engine plugin adds around the agent's memory work (:class:`AgentHooks`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from coldsnap.hydrate.recovery_plan import RecoveryPlan

__all__ = ["AgentHooks", "Hook"]

Hook = Callable[[], None]


@dataclass
class AgentHooks:
    """What an engine plugin adds around the memory work (each runs in the agent's thread)."""

    before_release: list[Hook] = field(default_factory=list)
    """After draining and the collectives' teardown, before the regions are unmapped (e.g. handing
    cached allocator blocks back)."""
    after_resume: list[Hook] = field(default_factory=list)
    """After hydration, KV remap and the collectives' rebuild, before graphs are recaptured."""
    release_graphs: Callable[[str], list[str]] | None = None
    """Given the graph policy (``retain`` | ``recreate``), drop the CUDA graphs that will not be kept and
    return their names. Graphs holding NCCL kernels are always dropped: a rebuilt communicator is a new
    one, and kernels captured against the old one must not replay. Runs before the teardown."""
    recapture_graphs: Callable[[], list[str]] | None = None
    """Capture again what ``release_graphs`` dropped (every rank at once: warm-ups run collectives)."""
    recovery_files: list[str] = field(default_factory=list)
    """The safetensors files the engine loaded its weights from (absolute paths): the recovery source a
    capture pins. Empty: this engine has none, and restores need the native pack."""
    recovery_plan: Callable[[], "RecoveryPlan | None"] | None = None
    """The recovery plan the engine's load recorded (:mod:`coldsnap.agent.weight_copies`), asked for at
    prepare; written beside the packs with its gap pack, so recovery restores skip ``replay_weights``."""
    replay_weights: Callable[[list[str]], int] | None = None
    """Recovery: fill the mapped ``weights`` region from these safetensors files the engine's own way
    (e.g. through its weight loaders, when its tensors are not the files' tensors by name); returns the
    bytes read. None: coldsnap places each file tensor at the captured address of the layout tensor of
    the same name (:func:`coldsnap.hydrate.replay_safetensors`)."""

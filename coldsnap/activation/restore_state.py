"""A restore's state, typed: what its steps read (:class:`RestorePlan`), what they start and hand on
(:class:`RestoreHeld`), and a driver's pipeline as the steps themselves (:class:`Step`).

A driver (:mod:`coldsnap.activation.n610`, :mod:`coldsnap.activation.n580`) builds the plan from admission's
findings and lists its steps; :class:`coldsnap.activation.restore_steps.RestoreSequence` runs them over that one
plan and one held state, and unwinds everything held after a failure.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from coldsnap.activation.admission import WeightSource
from coldsnap.activation.artifact_dir import ArtifactDir
from coldsnap.activation.early_restore import EarlyRestore
from coldsnap.activation.restore_place import GpuPlacement, Replica
from coldsnap.activation.staging import WeightStager
from coldsnap.activation.units import UnitRendezvous
from coldsnap.agent.client import Lease
from coldsnap.contracts.artifact import ArtifactDescriptor, UnitRecord, WorkerRecord
from coldsnap.contracts.capsule import ActivationMetadata, CapsuleManifest, WorkerActivation
from coldsnap.operation import OperationContext
from coldsnap.snapshot.criu import PendingRestore

__all__ = ["RestoreHeld", "RestorePlan", "Step"]


@dataclass(frozen=True)
class RestorePlan:
    """What every step of one restore reads and none changes: admission's findings and this restore's place."""

    context: OperationContext
    artifact: ArtifactDir
    descriptor: ArtifactDescriptor
    unit: UnitRecord
    workers: list[WorkerRecord]
    """The unit's ranks, in rank order."""
    records: dict[int, WorkerActivation]
    """Rank → what the capture recorded of it (its regions, its agent)."""
    metadata: ActivationMetadata
    sources: dict[int, WeightSource]
    """Rank → where admission found its weights."""
    replica: Replica | None
    """This restore's place (admission's); a standby's wake has none: its tree is restored already."""
    serving_port: int
    controls: dict[int, str]
    """Rank → its agent's control socket in this restored tree."""
    gpus: GpuPlacement | None
    early: EarlyRestore | None
    """The tree the program's entry started restoring for this replica (admission adopted it): its CRIU is
    waited for, not started."""

    @property
    def units(self) -> UnitRendezvous | None:
        """One unit of several: its seat at the activation's coordinator."""
        return self.context.units

    @property
    def first_unit(self) -> bool:
        """Unit 0 (or the only one): serves HTTP and answers the canary."""
        return self.unit.unit_id == self.descriptor.units[0].unit_id

    @classmethod
    def of(cls, context: OperationContext, artifact: ArtifactDir, descriptor: ArtifactDescriptor,
           capsule: CapsuleManifest, sources: dict[int, WeightSource], replica: Replica | None,
           gpus: GpuPlacement | None = None, early: EarlyRestore | None = None, controls: list[str] | None = None,
           serving_port: int | None = None) -> "RestorePlan":
        """``controls``, ``serving_port``: a standby's, from its record (no replica is planned for a wake)."""
        unit = next(u for u in descriptor.units if u.unit_id == capsule.unit_id)
        workers = sorted(unit.workers, key=lambda w: w.rank)
        records = {record.rank: record for record in capsule.metadata.workers}
        # (a standby's record lists its agents in this unit's rank order: unit K's ranks are not 0..R-1)
        by_rank = (dict(zip((w.rank for w in workers), controls)) if controls is not None
                   else replica.controls if replica is not None
                   else {rank: record.control for rank, record in records.items()})
        port = serving_port or (replica.serving_port if replica is not None else capsule.metadata.serving_port)
        return cls(context, artifact, descriptor, unit, workers, records, capsule.metadata, sources, replica, port,
                   by_rank, gpus, early)


@dataclass
class RestoreHeld:
    """What the steps have started and hand on, each field set by the step named: after any failure
    :meth:`RestoreSequence.unwind` releases all of it."""

    criu: PendingRestore | None = None
    """``restore_tree``: CRIU under way, killed by unwind until it has restored the tree."""
    restored_pid: int | None = None
    """``restore_tree`` (a standby's: from the start): what unwind kills."""
    host_pids: dict[int, int] = field(default_factory=dict)
    """``restore_tree``: captured pid → its pid on this host (a replica's namespace)."""
    stagers: dict[int, WeightStager] = field(default_factory=dict)
    """``restore_tree``: the launcher's staging of each rank's weights."""
    early_staged: set[int] = field(default_factory=set)
    """``restore_tree``: ranks whose staging the program's entry started."""
    warmer: threading.Thread | None = None
    """``restore_tree``: the payload's read-ahead."""
    prefetch_errors: list[BaseException] = field(default_factory=list)
    lease: Lease | None = None
    """``take_lease``: until the canary matched, the restored tree dies with this launcher."""
    staged: dict[int, tuple[dict[str, int], dict[str, Any]]] = field(default_factory=dict)
    """``collect_staged_weights``: rank → (adopted chunks, staging stats)."""
    fds_by_rank: dict[int, list[int]] = field(default_factory=dict)
    """``collect_staged_weights``: rank → the descriptors of its staged memory, sent with its resume."""
    handed_over: list[int] = field(default_factory=list)
    """``collect_staged_weights``: every such descriptor, closed once sent (or on failure)."""


@dataclass(frozen=True)
class Step:
    """One step of a driver's pipeline: the sequence's method it runs, and the units' barrier after it."""

    run: Callable[[Any], None]
    barrier: str | None = None
    """One unit of several: after this step it waits for every unit (``<op>.units.<barrier>``)."""
    first_unit_only: bool = False
    """Run by unit 0 alone (the canary: asked through its serving port; its answer needs every unit's ranks)."""

    @property
    def name(self) -> str:
        return self.run.__name__

"""Snapshot driver n610: the initialized serving process is captured, CUDA state included (NVIDIA driver
610+, seeds), and restored as it was: no engine start at restore.

This module declares the driver's pipelines as ordered lists of named steps over the shared step
implementations — capture: :class:`~coldsnap.activation.capture_steps.CaptureSequence`; restore, warm,
wake: :class:`~coldsnap.activation.restore_steps.RestoreSequence` — and what n610 admits on top of the
common admission (:mod:`coldsnap.activation.admission`): the GPUs the request places the ranks on and
their free memory. Warm parks the restored ranks as a standby (:func:`park`); wake takes it from there.
"""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING, Callable

from coldsnap.activation.admission import Admitted, WeightSource, gpu_placement, launcher_stages
from coldsnap.activation.artifact_dir import ArtifactDir
from coldsnap.activation.gpu_memory import admit_gpu_memory
from coldsnap.activation.ranks import ActivationCoordinator, call_every_rank, rank_prefix
from coldsnap.activation.restore_place import GpuPlacement
from coldsnap.activation.restore_state import RestoreHeld, RestorePlan, Step
from coldsnap.activation.restore_steps import RestoreSequence
from coldsnap.activation.standby import StandbyRecord, record_path
from coldsnap.agent.client import AgentClient
from coldsnap.agent.protocol import Standby, StandbyReply
from coldsnap.atomic import write_atomic
from coldsnap.contracts.artifact import ArtifactDescriptor, WorkerRecord
from coldsnap.contracts.capsule import CapsuleManifest
from coldsnap.host import live_start_ticks
from coldsnap.operation import OperationContext, OperationFailed, OperationOutcome
from coldsnap.settings import SETTINGS

if TYPE_CHECKING:
    from coldsnap.activation.capture_state import CheckRestore

__all__ = ["CAPTURE_STEPS", "RESTORE_STEPS", "WAKE_STEPS", "WARM_STEPS", "capture", "restore", "warm", "wake"]

CAPTURE_STEPS = ("start_reference", "launch", "wait_until_ready", "record_canary", "check_reference",
                 "hold_served_requests", "prepare_ranks", "refuse_outside_connections", "checkpoint_cuda", "dump",
                 "commit_checked")
def capture(context: OperationContext, artifact: ArtifactDir, ready_timeout: float,
            check_restore: CheckRestore) -> OperationOutcome:
    from coldsnap.activation.capture_steps import CaptureSequence  # (a restore never imports the capture's steps)

    return CaptureSequence(context, artifact, ready_timeout, check_restore).run(CAPTURE_STEPS)


def admit_placement(context: OperationContext, artifact: ArtifactDir, admitted: Admitted) -> GpuPlacement:
    """The GPUs the ranks go to (``admission.gpu``) and their room (``admission.gpu_memory``)."""
    op = context.request.operation
    with context.timer.span(f"{op}.admission.gpus"):
        gpus = gpu_placement(admitted.inputs, admitted.capsule)
    with context.timer.span(f"{op}.admission.gpu_memory") as span:
        # (a standby's agents hydrate at its wake: the launcher stages nothing for a warm)
        staging = launcher_stages(op, admitted.descriptor, admitted.capsule, admitted.sources)
        early = admitted.early.staging.decided() if admitted.early is not None and admitted.early.staging else None
        if early is not None and early.skipped:  # (the entry staged nothing: why, beside the room it admitted)
            span["early_staging_skipped"] = early.skipped
        admit_gpu_memory(context, admitted.capsule, gpus, staging, span, held=early.held if early is not None else None)
    return gpus


class StandbySequence(RestoreSequence):
    """Warm's restore, whose last step parks the ranks for ``ttl_s`` seconds."""

    def __init__(self, plan: RestorePlan, ttl_s: int):
        super().__init__(plan)
        self.ttl_s = ttl_s

    def park(self) -> None:
        park(self)


# The n610 driver's pipelines, in order (the registry: :mod:`coldsnap.activation.drivers`). One unit of several
# waits for the others at each barrier: no unit lets its tree go before unit 0's canary matched, nor leaves a
# standby before every unit's is parked (one failure is every unit's).
_CANARY = Step(RestoreSequence.check_canary, barrier="released", first_unit_only=True)
RESTORE_STEPS = (Step(RestoreSequence.restore_tree), Step(RestoreSequence.take_lease), Step(RestoreSequence.restore_cuda),
                 Step(RestoreSequence.collect_staged_weights), Step(RestoreSequence.resume_ranks),
                 Step(RestoreSequence.install_served_key), _CANARY)
WARM_STEPS = (Step(RestoreSequence.restore_tree), Step(RestoreSequence.take_lease), Step(RestoreSequence.restore_cuda),
              Step(RestoreSequence.collect_staged_weights), Step(StandbySequence.park, barrier="parked"))
"""Restored (CUDA included) and parked, not serving; the weights' pack read into the page cache for the wake."""
WAKE_STEPS = (Step(RestoreSequence.take_lease), Step(RestoreSequence.resume_ranks),
              Step(RestoreSequence.install_served_key), _CANARY)
"""A parked standby hydrated, resumed and proven by the canary."""


def restore(context: OperationContext, artifact: ArtifactDir, admitted: Admitted, gpus: GpuPlacement) -> OperationOutcome:
    return RestoreSequence(RestorePlan.of(context, artifact, admitted.descriptor, admitted.capsule, admitted.sources,
                                          admitted.replica, gpus, admitted.early)).run(RESTORE_STEPS)


def warm(context: OperationContext, artifact: ArtifactDir, admitted: Admitted, gpus: GpuPlacement,
         ttl_s: int) -> OperationOutcome:
    plan = RestorePlan.of(context, artifact, admitted.descriptor, admitted.capsule, admitted.sources, admitted.replica,
                          gpus)
    return StandbySequence(plan, ttl_s).run(WARM_STEPS)


def wake(context: OperationContext, artifact: ArtifactDir, descriptor: ArtifactDescriptor, capsule: CapsuleManifest,
         sources: dict[int, WeightSource], record: StandbyRecord) -> OperationOutcome:
    """No replica is planned: the parked tree's pid, agents and port come from its record."""
    plan = RestorePlan.of(context, artifact, descriptor, capsule, sources, None, controls=record.controls,
                          serving_port=record.serving_port)
    try:
        return RestoreSequence(plan, RestoreHeld(restored_pid=record.pid)).run(WAKE_STEPS)
    finally:  # served or stopped: either way no longer a standby
        record_path(artifact).unlink(missing_ok=True)


def park(sequence: "StandbySequence") -> None:
    """Every rank parks (collectives rebuilt together), then the standby is recorded."""
    ttl_s = sequence.ttl_s
    assert sequence.held.restored_pid is not None
    path = record_path(sequence.plan.artifact)
    controls = [sequence.plan.controls[w.rank] for w in sequence.plan.workers]
    with sequence.step("warm.standby", "warm.standby") as span, \
            ActivationCoordinator(len(sequence.plan.workers), sequence.plan.units) as coordinator:
        calls: list[tuple[int, Callable[[], StandbyReply]]] = [(w.rank, functools.partial(AgentClient(control).standby, Standby(
                    ttl_s=ttl_s, record=str(path), coordinator=coordinator.command_field(),
                    pin_payload=_pinnable_payload(sequence, w))))
                 for w, control in zip(sequence.plan.workers, controls)]
        for reply in call_every_rank(calls, coordinator):
            prefix = rank_prefix(reply.rank)
            span.update({f"{prefix}{name}_ns": int(seconds * 1e9) for name, seconds in reply.seconds.items()})
            span[f"{prefix}pinned_bytes"] = reply.pinned_bytes
            if reply.graphs_recaptured:
                span[f"{prefix}graphs_recaptured"] = ",".join(reply.graphs_recaptured)
            if reply.pin_error:
                sequence.plan.context.warn(f"rank {reply.rank}: the payload pack could not be pinned ({reply.pin_error}); "
                                           "its wake hydrates through the staging ring")
        start_ticks = live_start_ticks(sequence.held.restored_pid)
        if start_ticks is None:
            raise OperationFailed("warm.standby", f"the standby (pid {sequence.held.restored_pid}) exited while parking")
        record = StandbyRecord(format=1, standby_id=path.parent.name, artifact=str(sequence.plan.artifact.root),
                               operation_id=sequence.plan.context.request.operation_id, pid=sequence.held.restored_pid,
                               start_ticks=start_ticks, controls=controls,
                               serving_port=sequence.plan.serving_port, warmed_unix_ns=time.time_ns(), ttl_s=ttl_s)
        write_atomic(path, record.canonical_json() + b"\n")
        span["standby_id"] = record.standby_id
        span["ttl_s"] = ttl_s
    sequence.plan.context.progress(f"standby {record.standby_id} parked; `coldsnap wake {sequence.plan.artifact.root}` "
                                   f"makes it serve (it stops itself after {ttl_s} s)")


def _pinnable_payload(sequence: RestoreSequence, worker: WorkerRecord) -> str | None:
    """The rank's payload pack when its wake will hydrate GPU weights from it (and pinning is not
    switched off with ``COLDSNAP_STANDBY_PIN_PACK=0``): the standby pins it ahead of the wake."""
    weights = sequence.plan.records[worker.rank].regions.get("weights")
    if (not SETTINGS.flag("COLDSNAP_STANDBY_PIN_PACK") or worker.payload is None
            or sequence.plan.sources[worker.rank] != "native" or weights is None or weights.backend != "cuda"):
        return None
    return str(sequence.plan.artifact.root / worker.payload.path)



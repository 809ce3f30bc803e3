"""The lifecycle operations — capture, restore, warm, wake — as ``coldsnap CMD`` runs them inside the
operation envelope (:mod:`coldsnap.operation`): each checks what is common to every snapshot driver,
looks the request's driver up (:mod:`coldsnap.activation.drivers`) and runs its pipeline.

    capture: the unit's port free and locked → the driver's capture steps (n610's commit restores the
             capsule once through :func:`restore`, handed down: ``capture.verify``)
    restore: admission (:mod:`coldsnap.activation.admission`) → the driver's own admission (n610: GPUs
             and their room; n580: the placement) → ``--prepare-only`` stops → the driver's restore steps
             (a CLI restore's entry may have started CRIU already: :mod:`coldsnap.activation.early_restore`)
    warm:    one standby per artifact (a live one: converged) → admission → the driver's warm steps
    wake:    the live standby, its locks, its weight sources → the driver's wake steps

Each first claims what it may write, for the operation's owner (:mod:`coldsnap.ownership`): a capture its
output directory (once it is known not to hold a committed artifact) and every operation its paths under
the state root (:func:`~coldsnap.activation.artifact_dir.claim_state`).
"""

from __future__ import annotations

from pathlib import Path

from coldsnap.activation.admission import Admitted, admit, restore_inputs, weight_sources
from coldsnap.activation.artifact_dir import ArtifactDir, claim_state
from coldsnap.activation.drivers import driver_for
from coldsnap.activation.early_restore import NOT_RUN, FastEntry
from coldsnap.activation.operation_locks import hold_port, hold_standby
from coldsnap.activation.standby import DEFAULT_TTL_S, live_standby
from coldsnap.activation.state import artifact_id
from coldsnap.activation.units import (UnitRendezvous, join_capture_request, packed_addresses, selected_unit,
                                      unit_activation)
from coldsnap.contracts.base import ContractError
from coldsnap.operation import OperationContext, OperationFailed, OperationOutcome
from coldsnap.snapshot.moved_sockets import connections_to

__all__ = ["capture", "restore", "warm", "wake"]


def capture(context: OperationContext, ready_timeout: float | None = None) -> OperationOutcome:
    """``ready_timeout``: how long the engine may take to serve (default :data:`~coldsnap.activation.capture_steps.READY_TIMEOUT_S`)."""
    from coldsnap.activation.capture_steps import READY_TIMEOUT_S, port_taken  # (a restore never imports them)

    ready_timeout = READY_TIMEOUT_S if ready_timeout is None else ready_timeout
    driver = driver_for(context.request.snapshot_driver)
    if len(context.request.units) != 1 and context.request.unit is None:
        raise OperationFailed("capture.topology", f"a capture of {len(context.request.units)} launch units runs on "
                              "each unit's host, one unit each: give every one the request's `unit` selection "
                              "(coldsnap capture --units N --unit K --rendezvous HOST:PORT ...)")
    if context.request.unit is not None and driver.name != "n610":
        raise OperationFailed("capture.topology", f"snapshot driver {driver.name} captures one launch unit")
    artifact = ArtifactDir(Path(context.request.artifact))
    if artifact.committed():  # (before any unit waits for the others)
        raise OperationFailed("capture.exists", f"{artifact.root} already holds a committed artifact; capture into a new directory")
    with unit_activation(context) as units:
        if units is not None:
            context.request = join_capture_request(context, units)
        request_ = context.request
        index = selected_unit(request_) or 0
        port = request_.units[index].serving_port
        if port is None and index == 0:
            raise OperationFailed("capture.port", "the unit has no serving_port: the canary needs the engine's HTTP port")
        if port is not None:
            # One operation per port: a restore or capture onto it meanwhile loses at its admission.
            hold_port(context, port, str(artifact.root), code="capture.port")
            if port_taken(port):  # the canary would ask whatever holds it
                raise OperationFailed("capture.port", f"serving port {port} is taken: stop what listens there, or "
                                      "serve on another port")
        artifact.claim(context.hand_over)
        claim_state(context.hand_over)  # (the pinned safetensors' records; the check restore claims its own)
        return driver.capture(context, artifact, ready_timeout, restore)


def restore(context: OperationContext, artifact: ArtifactDir | None = None, entry: FastEntry = NOT_RUN
            ) -> OperationOutcome:
    """``artifact``: the request's by default; a capture's check restore passes its pending one. ``entry``: what
    the program's entry did for this restore (:func:`coldsnap.activation.early_restore.start_tree`): its tree is
    adopted by admission, or killed here."""
    checking = artifact is not None  # (a capture's own restore: no program entry to speak of)
    artifact = artifact or ArtifactDir(Path(context.request.artifact))
    if entry.tree is not None:
        context.timer.add_timeline_span(f"{context.request.operation}.admission.early", *entry.tree.checked_ns,
                                        decision="taken")
        context.progress(f"the fast entry took it: CRIU started {entry.tree.criu_started_ns / 1e9:.2f} s after exec")
    elif context.request.operation == "restore" and not checking:
        # the fast entry declined (or never ran: a restore in-process): why, in the receipt
        now = context.timer.now_ns()
        context.timer.add_timeline_span("restore.admission.early", now, now, decision="declined",
                                        reason=entry.declined or "")
        context.progress(f"the fast entry declined ({entry.declined}); the full path restores")
    try:
        return _restore(context, artifact, entry)
    finally:
        entry.abandon()  # (a no-op once adopted)


def _restore(context: OperationContext, artifact: ArtifactDir, entry: FastEntry) -> OperationOutcome:
    with unit_activation(context) as units:
        claim_state(context.hand_over, artifact)
        admitted = admit(context, artifact, entry)
        driver = driver_for(admitted.descriptor.snapshot_driver)
        placement = driver.admit_placement(context, artifact, admitted)
        if units is not None:
            _every_unit_admitted(context, units, artifact, admitted)
        if context.request.prepare_only:
            context.progress("admission passed; --prepare-only: nothing started")
            return OperationOutcome(artifact=str(artifact.root))
        return driver.restore(context, artifact, admitted, placement)


def _every_unit_admitted(context: OperationContext, units: UnitRendezvous, artifact: ArtifactDir,
                         admitted: Admitted) -> None:
    """Every unit admitted, at one port generation, before any starts (restore and warm)."""
    with context.timer.span(f"{context.request.operation}.units.admitted"):
        shifts = units.every_unit("restore/port_shift", admitted.replica.generation.shift)
        if len(set(shifts)) != 1:
            raise OperationFailed("admission.port", f"the units' port generations differ (shifts {shifts}): "
                                  "restore every unit onto the same serving port")
        captured = admitted.capsule.metadata.address
        others = {a for a in units.placed if a != captured}  # (published at admission: admission._plan_replica)
        if shifts[0] and connections_to(artifact.images(admitted.capsule.unit_id), packed_addresses(others)):
            raise OperationFailed("admission.port", f"the units' trees are connected to each other, which "
                                  f"ties their ports to the capture's: restore onto the captured serving port "
                                  f"{admitted.capsule.metadata.serving_port}, not with a shift of {shifts[0]}")
        units.barrier(f"{context.request.operation}.admitted")


def warm(context: OperationContext) -> OperationOutcome:
    artifact = ArtifactDir(Path(context.request.artifact))
    driver = driver_for(context.request.snapshot_driver)
    if driver.warm is None:  # (the request profiles refuse this before it gets here)
        raise OperationFailed("request.unsupported", f"snapshot driver {driver.name} has no warm standby")
    with unit_activation(context) as units:
        claim_state(context.hand_over, artifact)
        if artifact.committed():  # one standby per artifact: a second warm of it meanwhile, on any port, loses here
            hold_standby(context, artifact_id(artifact.root), str(artifact.root), "admission.standby")
        existing = live_standby(artifact) if artifact.committed() else None
        if units is not None:  # converged only when every unit's standby is there
            present = units.every_unit("warm/standby", existing is not None)
            if any(present) and not all(present):
                raise OperationFailed("admission.standby", f"units {[k for k, p in enumerate(present) if p]} of "
                                      f"{units.units} hold a warm standby of this artifact, the others none: wake or "
                                      "stop those first, then warm every unit together")
        if existing is not None:  # convergent: the standby asked for is there
            context.progress(f"already warm: pid {existing.pid}, port {existing.serving_port} (warmed by "
                             f"{existing.operation_id})")
            return OperationOutcome(artifact=str(artifact.root), warnings=[
                f"a warm standby of this artifact already runs (pid {existing.pid}); no second one was started"])
        admitted = admit(context, artifact)
        placement = driver.admit_placement(context, artifact, admitted)
        if units is not None:
            _every_unit_admitted(context, units, artifact, admitted)
        return driver.warm(context, artifact, admitted, placement, context.request.standby_ttl_s or DEFAULT_TTL_S)


def wake(context: OperationContext) -> OperationOutcome:
    artifact = ArtifactDir(Path(context.request.artifact))
    driver = driver_for(context.request.snapshot_driver)
    if driver.wake is None:
        raise OperationFailed("request.unsupported", f"snapshot driver {driver.name} has no warm standby")
    with unit_activation(context) as units:
        claim_state(context.hand_over, artifact)
        with context.timer.span("wake.admission.standby") as span:
            if not artifact.committed():
                raise OperationFailed("admission.artifact", f"{artifact.root} holds no committed artifact (no artifact.json)")
            record = live_standby(artifact)
            if record is None:
                raise OperationFailed("wake.standby", f"no live warm standby of {artifact.root} (`coldsnap warm` it "
                                      "first; `coldsnap status` lists the standbys)")
            span["pid"] = record.pid
            try:
                descriptor = artifact.load()
                unit = descriptor.units[selected_unit(context.request) or 0]  # (one unit of several: this host's)
                capsule = artifact.read_capsule(unit.unit_id)
            except (OSError, ContractError) as exc:
                raise OperationFailed("admission.artifact", f"{artifact.root}: {exc}") from None
            # A second wake of it loses here; the winner of such a race may have woken it meanwhile.
            hold_standby(context, artifact_id(artifact.root), str(artifact.root), "admission.standby")
            hold_port(context, record.serving_port or capsule.metadata.serving_port, str(artifact.root))
            if live_standby(artifact) is None:
                raise OperationFailed("wake.standby", f"the warm standby of {artifact.root} was woken or stopped meanwhile")
        with context.timer.span("wake.admission.payload") as span:
            mode = restore_inputs(context, artifact, descriptor, capsule).weights_mode
            sources = weight_sources(context, artifact, unit.workers, mode, span)
        if units is not None:  # every unit's standby is there before any rank hydrates
            with context.timer.span("wake.units.admitted"):
                units.barrier("wake.admitted")
        return driver.wake(context, artifact, descriptor, capsule, sources, record)

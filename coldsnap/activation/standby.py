"""Warm standby: an artifact restored ahead of demand into a process that does not serve yet.

``coldsnap warm DIR`` runs restore's admission and its steps through the CUDA restore (UUIDs remapped
onto this host's GPUs), then parks every rank (:class:`~coldsnap.agent.protocol.Standby`): the
collectives are rebuilt, the model memory stays released (no weights, no KV cache on the GPU), the
serving lock stays held — the port is bound, and a request that arrives waits for the wake — and the
pack is read into the page cache. The standby is recorded in the state directory and the launcher
leaves; nothing holds the standby but its own deadline (``standby_ttl_s``, default 3600 s), past
which it removes its record and stops its process group.

``coldsnap wake DIR|ID`` takes the standby's lease, lets every rank map and hydrate its weights (from
the pack, read by its own agent), zero its KV cache and recapture dropped graphs, and requires the
canary's captured tokens; then the standby is the serving process and its record is gone. A failed
or interrupted wake stops the standby (half-hydrated is no state to leave).

One standby per artifact (CRIU restores the captured pids and port): a second ``warm`` finds the
first and succeeds without starting another; ``restore`` refuses while one holds the port.

    STATE/<artifact id>/standby.json   the record: which process, its agents, its port, its deadline

A record whose process is gone (killed, expired, the host restarted) is stale: every command that
reads the registry removes it.
"""

from __future__ import annotations

import functools
import json
import os
import time
from pathlib import Path
from typing import Callable, ClassVar, Literal

from pydantic import Field

from coldsnap.activation.artifact_dir import ArtifactDir, state_root
from coldsnap.activation.gpu_memory import admit_gpu_memory
from coldsnap.activation.operation_locks import hold_port, hold_standby
from coldsnap.activation.restore import RestoreSequence, admit, gpu_placement, weight_sources
from coldsnap.activation.ranks import ActivationCoordinator, call_every_rank, rank_prefix
from coldsnap.activation.state import STANDBY_RECORD, artifact_id, standby_record_file
from coldsnap.agent.client import AgentClient, AgentError
from coldsnap.agent.protocol import Standby, StandbyReply
from coldsnap.atomic import write_atomic
from coldsnap.contracts.artifact import WorkerRecord
from coldsnap.contracts.base import Contract, ContractError, load_document
from coldsnap.host import live_start_ticks
from coldsnap.operation import OperationContext, OperationFailed, OperationOutcome

__all__ = ["DEFAULT_TTL_S", "StandbyRecord", "list_standbys", "live_standby", "record_path", "warm", "wake"]

DEFAULT_TTL_S = 3600


class StandbyRecord(Contract):
    """One warm standby (``STATE/<artifact id>/standby.json``)."""

    SUPPORTED_FORMATS: ClassVar[tuple[int, ...]] = (1,)

    format: Literal[1]
    """Record format version."""
    standby_id: str
    """The artifact id (the state directory's name): what ``coldsnap wake ID`` takes."""
    artifact: str
    """The artifact directory it was restored from."""
    operation_id: str
    """The ``warm`` operation that made it."""
    pid: int = Field(ge=1)
    """Root of the restored process tree."""
    start_ticks: int = Field(ge=0)
    """The root's start time (``/proc/<pid>/stat`` field 22): a reused pid is not the standby."""
    controls: list[str] = Field(min_length=1)
    """Each rank's agent control socket, in rank order."""
    serving_port: int | None
    """The port it will serve on (bound already)."""
    warmed_unix_ns: int = Field(ge=0)
    """When it was parked."""
    ttl_s: int | None
    """Seconds after parking at which it stops itself (None: never)."""


def record_path(artifact: ArtifactDir) -> Path:
    return artifact.state_dir() / STANDBY_RECORD


def _read_live(path: Path) -> StandbyRecord | None:
    """The record at ``path`` if its process still runs; a stale or unreadable record is removed."""
    if not path.exists():
        return None
    try:
        record = load_document(StandbyRecord, path)
    except ContractError:  # torn or from another build: nothing can wake it through this record
        path.unlink(missing_ok=True)
        return None
    if live_start_ticks(record.pid) != record.start_ticks:
        path.unlink(missing_ok=True)
        return None
    return record


def live_standby(artifact: ArtifactDir) -> StandbyRecord | None:
    """The artifact's live standby, if any."""
    try:
        return _read_live(record_path(artifact))
    except OSError:  # no state directory can be made: then no standby was recorded either
        return None


def list_standbys() -> list[tuple[StandbyRecord, str]]:
    """Every live standby under the state root with its agents' state (``standby``, or what else rank 0
    says, or ``unreachable``); stale records are removed on the way."""
    found: list[tuple[StandbyRecord, str]] = []
    for path in sorted(state_root().glob(f"*/{STANDBY_RECORD}")):
        record = _read_live(path)
        if record is None:
            continue
        state: str
        try:
            state = AgentClient(record.controls[0], timeout=5).status().state
        except (AgentError, OSError) as exc:
            state = f"unreachable ({exc})"
        found.append((record, state))
    return found


def warm(context: OperationContext) -> OperationOutcome:
    artifact = ArtifactDir(Path(context.request.artifact))
    if artifact.committed():  # one standby per artifact: a second warm of it meanwhile, on any port, loses here
        hold_standby(context, artifact_id(artifact.root), str(artifact.root), "admission.standby")
    existing = live_standby(artifact) if artifact.committed() else None
    if existing is not None:  # convergent: the standby asked for is there
        context.progress(f"already warm: pid {existing.pid}, port {existing.serving_port} (warmed by "
                         f"{existing.operation_id})")
        return OperationOutcome(artifact=str(artifact.root), warnings=[
            f"a warm standby of this artifact already runs (pid {existing.pid}); no second one was started"])
    descriptor, capsule, sources, replica = admit(context, artifact)
    ttl_s = context.request.standby_ttl_s or DEFAULT_TTL_S
    gpus = gpu_placement(context, artifact, capsule)
    with context.timer.span("warm.admission.gpu_memory") as span:
        admit_gpu_memory(context, capsule, gpus, False, span)  # (a standby's agents hydrate at wake)
    return RestoreSequence(context, artifact, descriptor, capsule, sources, replica, gpus=gpus).run_warm(
        lambda sequence: _park(sequence, ttl_s))


def _park(sequence: RestoreSequence, ttl_s: int) -> None:
    """Every rank parks (collectives rebuilt together), then the standby is recorded."""
    assert sequence.restored_pid is not None
    path = record_path(sequence.artifact)
    controls = [sequence.controls[w.rank] for w in sequence.workers]
    with sequence.step("warm.standby", "warm.standby") as span, \
            ActivationCoordinator(len(sequence.workers)) as coordinator:
        calls: list[tuple[int, Callable[[], StandbyReply]]] = [(w.rank, functools.partial(AgentClient(control).standby, Standby(
                    ttl_s=ttl_s, record=str(path), coordinator=coordinator.command_field(),
                    pin_payload=_pinnable_payload(sequence, w))))
                 for w, control in zip(sequence.workers, controls)]
        for reply in call_every_rank(calls, coordinator):
            prefix = rank_prefix(reply.rank)
            span.update({f"{prefix}{name}_ns": int(seconds * 1e9) for name, seconds in reply.seconds.items()})
            span[f"{prefix}pinned_bytes"] = reply.pinned_bytes
            if reply.graphs_recaptured:
                span[f"{prefix}graphs_recaptured"] = ",".join(reply.graphs_recaptured)
            if reply.pin_error:
                sequence.context.warn(f"rank {reply.rank}: the payload pack could not be pinned ({reply.pin_error}); "
                                      "its wake hydrates through the staging ring")
        start_ticks = live_start_ticks(sequence.restored_pid)
        if start_ticks is None:
            raise OperationFailed("warm.standby", f"the standby (pid {sequence.restored_pid}) exited while parking")
        record = StandbyRecord(format=1, standby_id=path.parent.name, artifact=str(sequence.artifact.root),
                               operation_id=sequence.context.request.operation_id, pid=sequence.restored_pid,
                               start_ticks=start_ticks, controls=controls,
                               serving_port=sequence.serving_port, warmed_unix_ns=time.time_ns(), ttl_s=ttl_s)
        write_atomic(path, record.canonical_json() + b"\n")
        span["standby_id"] = record.standby_id
        span["ttl_s"] = ttl_s
    sequence.context.progress(f"standby {record.standby_id} parked; `coldsnap wake {sequence.artifact.root}` "
                              f"makes it serve (it stops itself after {ttl_s} s)")


def _pinnable_payload(sequence: RestoreSequence, worker: WorkerRecord) -> str | None:
    """The rank's payload pack when its wake will hydrate GPU weights from it (and pinning is not
    switched off with ``COLDSNAP_STANDBY_PIN_PACK=0``): the standby pins it ahead of the wake."""
    weights = sequence.records[worker.rank].regions.get("weights")
    if (os.environ.get("COLDSNAP_STANDBY_PIN_PACK", "1") == "0" or worker.payload is None
            or sequence.sources[worker.rank] != "native" or weights is None or weights.backend != "cuda"):
        return None
    return str(sequence.artifact.root / worker.payload.path)


def wake(context: OperationContext) -> OperationOutcome:
    artifact = ArtifactDir(Path(context.request.artifact))
    with context.timer.span("wake.admission.standby") as span:
        if not artifact.committed():
            raise OperationFailed("admission.artifact", f"{artifact.root} holds no committed artifact (no artifact.json)")
        record = live_standby(artifact)
        if record is None:
            raise OperationFailed("wake.standby", f"no live warm standby of {artifact.root} (`coldsnap warm` it first; "
                                  "`coldsnap status` lists the standbys)")
        span["pid"] = record.pid
        try:
            descriptor = artifact.load()
            capsule = artifact.read_capsule(descriptor.units[0].unit_id)
        except (OSError, ContractError) as exc:
            raise OperationFailed("admission.artifact", f"{artifact.root}: {exc}") from None
        # A second wake of it loses here; the winner of such a race may have woken it meanwhile.
        hold_standby(context, artifact_id(artifact.root), str(artifact.root), "admission.standby")
        hold_port(context, record.serving_port or capsule.metadata.serving_port, str(artifact.root))
        if live_standby(artifact) is None:
            raise OperationFailed("wake.standby", f"the warm standby of {artifact.root} was woken or stopped meanwhile")
    with context.timer.span("wake.admission.payload") as span:
        sources = weight_sources(context, artifact, descriptor.units[0].workers, span)
    sequence = RestoreSequence(context, artifact, descriptor, capsule, sources, None, restored_pid=record.pid,
                               controls=record.controls)
    sequence.serving_port = record.serving_port or capsule.metadata.serving_port
    try:
        outcome = sequence.run_wake()
    finally:  # served or stopped: either way no longer a standby
        record_path(artifact).unlink(missing_ok=True)
    return outcome


def standby_artifact(target: str) -> Path:
    """The artifact directory ``coldsnap wake`` means by ``target``: a directory, else a standby id
    (a state directory's name); raises ValueError naming what was looked for."""
    given = Path(target)
    if (given / "artifact.json").exists():
        return given.resolve()
    try:
        return Path(json.loads(standby_record_file(target).read_text())["artifact"])
    except (OSError, ValueError, KeyError, TypeError):
        raise ValueError(f"{target}: neither an artifact directory nor the id of a standby under {state_root()} "
                         "(`coldsnap status` lists them)") from None

"""The warm standbys' registry: their records, the live one of an artifact, the list ``coldsnap status``
shows. (The warm and wake pipelines are the snapshot driver's: :mod:`coldsnap.activation.n610`.)

A warm standby is an artifact restored ahead of demand into a process that does not serve yet.

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

import json
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field

from coldsnap.activation.artifact_dir import ArtifactDir
from coldsnap.activation.state import STANDBY_RECORD, standby_record_file
from coldsnap.agent.client import AgentClient, AgentError
from coldsnap.contracts.base import Contract, ContractError, load_document
from coldsnap.host import live_start_ticks, state_root

__all__ = ["DEFAULT_TTL_S", "StandbyRecord", "list_standbys", "live_standby", "record_path", "standby_artifact"]

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

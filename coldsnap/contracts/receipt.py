"""Operation receipt, format 2, with its timing envelope (span tree + clock inventory).

Clocks on different processes and hosts are independent: every span names the clock it was measured
on, every clock carries its own Unix origin, and a reader may *place* spans of several clocks on one
picture by those origins but must never add or subtract durations across clocks. Spans marked
``aggregate`` are profiler counters that may overlap and start at their clock's origin; ``timeline``
spans are real intervals.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Mapping, Union

from pydantic import Field, model_validator

from coldsnap.contracts.base import Contract, Identifier, Sha256Hex
from coldsnap.contracts.common import (
    EngineName,
    OperationName,
    OperationState,
    ReplaySemantics,
    SnapshotDriverName,
)

__all__ = [
    "RECEIPT_FORMAT",
    "MAX_SPANS",
    "MAX_CLOCKS",
    "Clock",
    "Span",
    "TimingEnvelope",
    "ErrorRecord",
    "OperationReceipt",
    "restored_pid",
]

RECEIPT_FORMAT = 2
MAX_SPANS = 4096
MAX_CLOCKS = 256

AttributeValue = Union[str, int, bool]


class Clock(Contract):
    """One monotonic clock that spans were measured on."""

    clock_id: Identifier
    """Identity referenced by spans."""
    owner: Literal["manager", "controller", "adapter", "unit", "worker"]
    """Which layer's clock this is."""
    description: str
    """Human description, e.g. ``worker rank 0 (pid 1234)``."""
    unix_origin_ns: int = Field(ge=0)
    """Unix time in nanoseconds at which this clock read zero."""


class Span(Contract):
    """A named interval on one clock."""

    span_id: Identifier
    """Identity within the envelope."""
    parent_id: Identifier | None
    """Enclosing span, ``None`` for a root."""
    name: str = Field(min_length=1, max_length=200)
    """Phase name, dotted (``controller.validate``, ``unit.criu_restore``)."""
    clock_id: Identifier
    """The clock ``start_ns`` and ``duration_ns`` are measured on."""
    placement: Literal["timeline", "aggregate"]
    """``timeline``: a real interval; ``aggregate``: an overlapping counter starting at the clock origin."""
    start_ns: int = Field(ge=0)
    """Start, nanoseconds after the clock's origin."""
    duration_ns: int = Field(ge=0)
    """Length in nanoseconds."""
    attributes: dict[str, AttributeValue] = Field(default_factory=dict)
    """Small facts about the span (bytes moved, thread count, outcome)."""

    @model_validator(mode="after")
    def _aggregate_starts_at_origin(self) -> "Span":
        if self.placement == "aggregate" and self.start_ns != 0:
            raise ValueError(f"span {self.span_id!r}: aggregate spans start at their clock's origin (start_ns 0)")
        return self


class TimingEnvelope(Contract):
    """All timing of one operation."""

    clocks: list[Clock] = Field(max_length=MAX_CLOCKS)
    """Clock inventory."""
    spans: list[Span] = Field(max_length=MAX_SPANS)
    """Span tree (by ``parent_id``)."""

    @model_validator(mode="after")
    def _check_references(self) -> "TimingEnvelope":
        clock_ids = [c.clock_id for c in self.clocks]
        if len(set(clock_ids)) != len(clock_ids):
            raise ValueError(f"clocks: duplicate clock_id in {clock_ids}")
        span_ids = {s.span_id for s in self.spans}
        if len(span_ids) != len(self.spans):
            raise ValueError("spans: duplicate span_id")
        for span in self.spans:
            if span.clock_id not in clock_ids:
                raise ValueError(f"span {span.span_id!r} names unknown clock {span.clock_id!r}")
            if span.parent_id is not None and span.parent_id not in span_ids:
                raise ValueError(f"span {span.span_id!r} names unknown parent {span.parent_id!r}")
        return self


class ErrorRecord(Contract):
    """Why an operation failed."""

    code: str = Field(pattern=r"^[a-z][a-z0-9_.-]*$")
    """Stable machine-readable code, one of :data:`coldsnap.contracts.errors.ERROR_CODES` (``restore.criu``,
    ``admission.driver_floor``...)."""
    message: str
    """One readable line."""


class OperationReceipt(Contract):
    """The one result document of an operation (receipt format 2)."""

    SUPPORTED_FORMATS: ClassVar[tuple[int, ...]] = (RECEIPT_FORMAT,)

    format: Literal[2]
    """Receipt format version; only 2 is accepted."""
    operation: OperationName
    """The operation performed."""
    operation_id: Identifier
    """From the request."""
    request_sha256: Sha256Hex
    """Canonical SHA-256 of the resolved request this receipt answers (of the request as sent when it was
    refused with ``request.unsupported``: this build has nothing to resolve it with)."""
    engine: EngineName
    """Engine adapter selected."""
    snapshot_driver: SnapshotDriverName
    """Snapshot driver selected."""
    prepare_only: bool
    """Whether this was a ``restore --prepare-only`` admission."""
    state: OperationState
    """Outcome. The process exit status agrees: non-zero exactly when ``failed``."""
    replay_semantics: ReplaySemantics
    """What repeating this operation's request would do (``safe-to-repeat`` when it was refused with
    ``request.unsupported``: nothing was done, and this build refuses it again)."""
    started_unix_ns: int = Field(ge=0)
    """Operation start, Unix nanoseconds (controller clock)."""
    finished_unix_ns: int = Field(ge=0)
    """Operation end, Unix nanoseconds (controller clock)."""
    artifact: str | None = None
    """Artifact directory the operation wrote or read, if any."""
    error: ErrorRecord | None = None
    """Set exactly when ``state`` is ``failed``."""
    warnings: list[str] = Field(default_factory=list)
    """Non-fatal problems (missing optional telemetry, timing-stream failures)."""
    timing: TimingEnvelope
    """Span tree and clock inventory."""

    @model_validator(mode="after")
    def _check_state(self) -> "OperationReceipt":
        if (self.state == "failed") != (self.error is not None):
            raise ValueError("error must be set exactly when state is failed")
        if self.finished_unix_ns < self.started_unix_ns:
            raise ValueError("finished_unix_ns is before started_unix_ns")
        return self


def restored_pid(receipt: Mapping[str, Any]) -> int | None:
    """The root of the tree a restore (or warm) receipt's operation restored, as the host sees it: its
    CRIU step's ``pid`` attribute (a restored tree runs in pid namespaces of its own, where it keeps its
    captured pids). ``None`` when nothing was restored. Works on a receipt's JSON value."""
    for span in receipt["timing"]["spans"]:
        if span["name"].endswith(".criu_restore") and "pid" in span.get("attributes", {}):
            return int(span["attributes"]["pid"])
    return None

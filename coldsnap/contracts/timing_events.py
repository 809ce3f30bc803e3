"""Timing events, format 1: the optional, append-only NDJSON side channel of an operation.

Lifecycle: ``stream_start``, one or more ``clock``, ``span_start``/``span_complete`` (a
``span_complete`` may come without a start for telemetry learned late), then ``stream_complete``,
which binds the final state and the canonical SHA-256 of the receipt's timing envelope. A consumer
falls back to the receipt whenever the stream is absent, truncated, malformed or its digest differs.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal, Union

from pydantic import ConfigDict, Field, TypeAdapter

from coldsnap.contracts.base import Contract, Identifier, Sha256Hex
from coldsnap.contracts.common import OperationState
from coldsnap.contracts.receipt import Clock, Span

__all__ = [
    "TIMING_EVENT_FORMAT",
    "MAX_EVENTS",
    "MAX_EVENT_BYTES",
    "StreamStart",
    "ClockEvent",
    "SpanStart",
    "SpanComplete",
    "StreamComplete",
    "TimingEvent",
    "TIMING_EVENT_ADAPTER",
]

TIMING_EVENT_FORMAT = 1
MAX_EVENTS = 8192
MAX_EVENT_BYTES = 64 * 1024


class _EventBase(Contract):
    SUPPORTED_FORMATS: ClassVar[tuple[int, ...]] = (TIMING_EVENT_FORMAT,)

    timing_event_format: Literal[1]
    """Timing-event format version."""
    sequence: int = Field(ge=0, lt=MAX_EVENTS)
    """Global sequence number, from 0, without gaps."""
    operation_id: Identifier
    """Operation this stream belongs to."""
    request_sha256: Sha256Hex
    """Canonical SHA-256 of the operation's resolved request."""


class StreamStart(_EventBase):
    """First event of a stream."""

    event: Literal["stream_start"]
    """Event kind."""
    started_unix_ns: int = Field(ge=0)
    """Unix time the operation started."""


class ClockEvent(_EventBase):
    """Declares a clock before spans use it."""

    event: Literal["clock"]
    """Event kind."""
    clock: Clock
    """The clock."""


class SpanStart(_EventBase):
    """A span began (its duration is not known yet)."""

    event: Literal["span_start"]
    """Event kind."""
    span_id: Identifier
    """Span identity."""
    parent_id: Identifier | None
    """Enclosing span."""
    name: str = Field(min_length=1, max_length=200)
    """Phase name."""
    clock_id: Identifier
    """Clock of ``start_ns``."""
    start_ns: int = Field(ge=0)
    """Start on that clock."""


class SpanComplete(_EventBase):
    """A span ended; carries the whole span as the receipt will hold it."""

    event: Literal["span_complete"]
    """Event kind."""
    span: Span
    """The completed span."""


class StreamComplete(_EventBase):
    """Last event: binds the outcome and the receipt's timing envelope."""

    event: Literal["stream_complete"]
    """Event kind."""
    state: OperationState
    """Operation outcome."""
    timing_envelope_sha256: Sha256Hex
    """Canonical SHA-256 of the receipt's ``timing`` object."""


TimingEvent = Annotated[
    Union[StreamStart, ClockEvent, SpanStart, SpanComplete, StreamComplete],
    Field(discriminator="event"),
]
# Built when first used (every operation imports this module; few read a timing stream back).
TIMING_EVENT_ADAPTER: TypeAdapter[TimingEvent] = TypeAdapter(TimingEvent, config=ConfigDict(defer_build=True))

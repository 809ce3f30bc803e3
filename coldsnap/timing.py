"""Operation timing: spans on explicit clocks, folded into a receipt's timing envelope, and the
optional NDJSON event stream (timing-event format 1) that mirrors them live; and :func:`timed`, the
seconds-per-step tally the in-process agent and the collectives report in their replies.

The event stream is advisory: a failure to write it becomes a warning and never changes the
operation's result. It is capped at 8,192 events and 64 KiB per event; past the cap events are
dropped (and a warning says so) rather than producing an invalid stream.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from typing import IO, Any, Callable, Iterator, TypeVar

from coldsnap.contracts.canonical import canonical_json, canonical_sha256
from coldsnap.contracts.receipt import MAX_CLOCKS, MAX_SPANS, Clock, Span, TimingEnvelope
from coldsnap.contracts.timing_events import MAX_EVENT_BYTES, MAX_EVENTS, TIMING_EVENT_FORMAT

__all__ = ["OperationTimer", "TimingEventStream", "timed"]

T = TypeVar("T")


def timed(seconds: dict[str, float], name: str, work: Callable[[], T]) -> T:
    """``work()``, its seconds added to ``seconds[name]`` (a step run twice, like a barrier, sums)."""
    started = time.perf_counter()
    try:
        return work()
    finally:
        seconds[name] = round(seconds.get(name, 0.0) + time.perf_counter() - started, 6)


class TimingEventStream:
    """Writes timing events as NDJSON lines to an open binary handle; never raises on output errors."""

    def __init__(self, handle: IO[bytes], operation_id: str, request_sha256: str):
        self._handle: IO[bytes] | None = handle
        self._operation_id = operation_id
        self._request_sha256 = request_sha256
        self._sequence = 0
        self.warnings: list[str] = []

    def emit(self, event: str, **fields: Any) -> None:
        if self._handle is None:
            return
        # stream_complete always gets the last slot, so the cap never cuts the stream's end.
        if self._sequence >= MAX_EVENTS - (0 if event == "stream_complete" else 1):
            self.warnings.append(f"timing events: cap of {MAX_EVENTS} events reached; {event} dropped")
            return
        document = {
            "timing_event_format": TIMING_EVENT_FORMAT,
            "sequence": self._sequence,
            "operation_id": self._operation_id,
            "request_sha256": self._request_sha256,
            "event": event,
            **fields,
        }
        line = canonical_json(document) + b"\n"
        if len(line) > MAX_EVENT_BYTES:
            self.warnings.append(f"timing events: {event} of {len(line)} bytes exceeds {MAX_EVENT_BYTES}; dropped")
            return
        try:
            self._handle.write(line)
            self._handle.flush()
        except OSError as exc:
            self.warnings.append(f"timing events: output failed ({exc}); stream abandoned")
            self._handle = None
            return
        self._sequence += 1


class OperationTimer:
    """Collects spans on the controller clock (and clocks imported from units and workers)."""

    CONTROLLER_CLOCK = "controller"

    def __init__(self, events: TimingEventStream | None = None, description: str = "coldsnap controller",
                 origin: tuple[int, int] | None = None):
        """``origin``: (monotonic, unix) nanoseconds the clock starts at (default now): a restore's, where its
        process's entry started work before the operation (:mod:`coldsnap.activation.early_restore`)."""
        self._origin_monotonic_ns, self.unix_origin_ns = origin or (time.monotonic_ns(), time.time_ns())
        self._events = events
        self._clocks: list[Clock] = []
        self._spans: list[Span] = []
        self._stack: list[str] = []
        self._ids = itertools.count(1)
        self.warnings: list[str] = []
        if events is not None:
            events.emit("stream_start", started_unix_ns=self.unix_origin_ns)
        self.add_clock(
            Clock(
                clock_id=self.CONTROLLER_CLOCK,
                owner="controller",
                description=description,
                unix_origin_ns=self.unix_origin_ns,
            )
        )

    def now_ns(self) -> int:
        """Nanoseconds since this timer's origin, on the controller clock."""
        return time.monotonic_ns() - self._origin_monotonic_ns

    def add_clock(self, clock: Clock) -> None:
        self._clocks.append(clock)
        if self._events is not None:
            self._events.emit("clock", clock=clock.to_json_value())

    def add_span(self, span: Span) -> None:
        """Record a completed span (e.g. imported from a worker's own clock)."""
        if len(self._spans) >= MAX_SPANS:
            self.warnings.append(f"timing: more than {MAX_SPANS} spans; {span.name} dropped")
            return
        self._spans.append(span)
        if self._events is not None:
            self._events.emit("span_complete", span=span.to_json_value())

    @contextlib.contextmanager
    def span(self, name: str, started_ns: int | None = None,
             **attributes: str | int | bool) -> Iterator[dict[str, str | int | bool]]:
        """Time a phase on the controller clock; the yielded dict takes attributes learned inside.
        ``started_ns``: when the phase began, if before now (work started earlier and waited for here)."""
        span_id = f"s{next(self._ids)}"
        parent_id = self._stack[-1] if self._stack else None
        start = self.now_ns() if started_ns is None else started_ns
        if self._events is not None:
            self._events.emit(
                "span_start",
                span_id=span_id,
                parent_id=parent_id,
                name=name,
                clock_id=self.CONTROLLER_CLOCK,
                start_ns=start,
            )
        self._stack.append(span_id)
        attrs: dict[str, str | int | bool] = dict(attributes)
        try:
            yield attrs
        except BaseException as exc:
            attrs.setdefault("outcome", f"error: {type(exc).__name__}")
            raise
        finally:
            self._stack.pop()
            self.add_span(
                Span(
                    span_id=span_id,
                    parent_id=parent_id,
                    name=name,
                    clock_id=self.CONTROLLER_CLOCK,
                    placement="timeline",
                    start_ns=start,
                    duration_ns=self.now_ns() - start,
                    attributes=attrs,
                )
            )

    def add_timeline_span(self, name: str, start_ns: int, end_ns: int, **attributes: str | int | bool) -> None:
        """A phase that ran beside the current one (in another thread), measured with :meth:`now_ns`;
        recorded under the current parent when it is joined."""
        self.add_span(Span(span_id=f"s{next(self._ids)}", parent_id=self._stack[-1] if self._stack else None,
                           name=name, clock_id=self.CONTROLLER_CLOCK, placement="timeline", start_ns=start_ns,
                           duration_ns=max(0, end_ns - start_ns), attributes=dict(attributes)))

    def import_envelope(self, envelope: TimingEnvelope, prefix: str, description: str) -> None:
        """Another launcher's whole envelope (a unit of the same activation, on its own host), each of its
        clocks kept as a clock of its own (``PREFIX``, ``PREFIX.CLOCK``) with its own Unix origin; its root
        spans nested under the current span as foreign-clock attribution, never added to this clock's."""
        clocks = {c.clock_id: prefix if c.clock_id == self.CONTROLLER_CLOCK else f"{prefix}.{c.clock_id}"
                  for c in envelope.clocks}
        if len(self._clocks) + len(clocks) > MAX_CLOCKS:
            self.warnings.append(f"timing: more than {MAX_CLOCKS} clocks; {prefix}'s spans dropped")
            return
        for clock in envelope.clocks:
            self.add_clock(clock.model_copy(update={
                "clock_id": clocks[clock.clock_id],
                "owner": "unit" if clock.clock_id == self.CONTROLLER_CLOCK else clock.owner,
                "description": description if clock.clock_id == self.CONTROLLER_CLOCK else f"{prefix}: {clock.description}"}))
        parent = self._stack[-1] if self._stack else None
        for span in envelope.spans:
            self.add_span(span.model_copy(update={
                "span_id": f"{prefix}.{span.span_id}", "clock_id": clocks[span.clock_id],
                "parent_id": f"{prefix}.{span.parent_id}" if span.parent_id is not None else parent}))

    def envelope_so_far(self) -> TimingEnvelope:
        """The envelope while spans are still open (the operation's own, when a unit hands its spans to unit
        0): the closed spans, those whose parent is open made roots."""
        closed = {span.span_id for span in self._spans}
        return TimingEnvelope(clocks=list(self._clocks), spans=[
            span if span.parent_id is None or span.parent_id in closed else span.model_copy(update={"parent_id": None})
            for span in self._spans])

    def envelope(self) -> TimingEnvelope:
        return TimingEnvelope(clocks=list(self._clocks), spans=list(self._spans))

    def complete(self, state: str, envelope: TimingEnvelope) -> None:
        """Close the event stream, binding it to the receipt's timing envelope."""
        if self._events is not None:
            self._events.emit(
                "stream_complete", state=state, timing_envelope_sha256=canonical_sha256(envelope.to_json_value())
            )


"""The residual: the preserved stable bytes that the native payload does not hold.

A worker's stable regions hold *allocations* (what its region allocator handed out: the weights, and
whatever else must survive a restore). The payload pack stores the model's bytes among them; the
residual pack stores every other allocated byte. Together they must cover the allocations exactly
once: a byte in neither would come back as garbage, a byte in both would be written twice from two
sources that may disagree, and a byte outside the allocations would be written into unmapped or
foreign memory. :func:`check_cover` is that rule; :func:`residual_extents` computes the residual
that satisfies it.

Ranges are ``(offset, length)`` in bytes from the region's base. Adjacent ranges are merged: inside a
region the addresses are contiguous, so one copy serves both.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

from coldsnap.payload.errors import CoverError
from coldsnap.payload.pack import PackTable
from coldsnap.payload.pack_writer import PlannedExtent

__all__ = ["Allocations", "residual_extents", "plan_residual", "check_cover"]

Allocations = Mapping[str, Iterable[tuple[int, int]]]
"""Region tag → the ``(offset, length)`` ranges the region's allocator handed out."""

_Spans = dict[str, list[tuple[int, int]]]  # tag -> sorted, disjoint, non-adjacent [start, end)


def _spans(tag: str, ranges: Iterable[tuple[int, int]], what: str) -> list[tuple[int, int]]:
    """Sorted half-open spans with adjacent ones merged; overlapping or negative ranges are refused."""
    spans = []
    for offset, length in ranges:
        if offset < 0 or length < 0:
            raise CoverError(f"{what} {tag} ({offset}, {length}) has a negative offset or length")
        if length:
            spans.append((offset, offset + length))
    spans.sort()
    merged: list[tuple[int, int]] = []
    for start, end in spans:
        if merged and start < merged[-1][1]:
            raise CoverError(f"{what} {tag} {_show(merged[-1])} and {_show((start, end))} overlap")
        if merged and start == merged[-1][1]:
            merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def _allocation_spans(allocations: Allocations) -> _Spans:
    return {tag: spans for tag, ranges in allocations.items() if (spans := _spans(tag, ranges, "allocation"))}


def _table_spans(table: PackTable | Sequence[PlannedExtent], what: str) -> _Spans:
    ranges: dict[str, list[tuple[int, int]]] = {}
    for extent in table.extents if isinstance(table, PackTable) else table:
        ranges.setdefault(extent.region, []).append((extent.region_offset, extent.length))
    return {tag: _spans(tag, found, what) for tag, found in ranges.items()}


def _subtract(spans: list[tuple[int, int]], removed: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``spans`` minus ``removed`` (both sorted and disjoint)."""
    result = []
    index = 0
    for start, end in spans:
        while index < len(removed) and removed[index][1] <= start:
            index += 1
        cursor = start
        scan = index
        while scan < len(removed) and removed[scan][0] < end:
            if removed[scan][0] > cursor:
                result.append((cursor, removed[scan][0]))
            cursor = max(cursor, removed[scan][1])
            scan += 1
        if cursor < end:
            result.append((cursor, end))
    return result


def _intersect(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> list[tuple[int, int]]:
    result = []
    i = j = 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            result.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return result


def _show(span: tuple[int, int]) -> str:
    return f"[{span[0]}, {span[1]})"


def _check_inside(spans: _Spans, allocated: _Spans, what: str) -> None:
    for tag, found in spans.items():
        outside = _subtract(found, allocated.get(tag, []))
        if outside:
            raise CoverError(f"{what} bytes {tag} {_show(outside[0])} lie outside the preserved allocations")


def residual_extents(allocations: Allocations,
                     payload_table: PackTable | Sequence[PlannedExtent]) -> dict[str, list[tuple[int, int]]]:
    """The allocated ranges the payload does not hold, per tag (tags with nothing left are omitted).
    ``payload_table``: the written pack's table, or the extents it would hold (a capture without one).

    Raises :class:`CoverError` when the allocations overlap or the payload reaches outside them.
    """
    allocated = _allocation_spans(allocations)
    payload = _table_spans(payload_table, "payload")
    _check_inside(payload, allocated, "payload")
    residual = {}
    for tag, spans in allocated.items():
        left = _subtract(spans, payload.get(tag, []))
        if left:
            residual[tag] = [(start, end - start) for start, end in left]
    return residual


def plan_residual(allocations: Allocations, payload_table: PackTable | Sequence[PlannedExtent]) -> list[PlannedExtent]:
    """:func:`residual_extents` as the extents :func:`~coldsnap.payload.pack_writer.write_pack` writes."""
    return [
        PlannedExtent(region=tag, region_offset=offset, length=length)
        for tag, ranges in residual_extents(allocations, payload_table).items()
        for offset, length in ranges
    ]


def check_cover(allocations: Allocations, payload_table: PackTable, residual_table: PackTable) -> None:
    """Raise :class:`CoverError` unless payload and residual cover the allocations exactly once.

    That is: both lie inside the allocations, they share no byte, and every allocated byte is in one.
    """
    allocated = _allocation_spans(allocations)
    payload = _table_spans(payload_table, "payload")
    residual = _table_spans(residual_table, "residual")
    _check_inside(payload, allocated, "payload")
    _check_inside(residual, allocated, "residual")
    for tag, spans in payload.items():
        both = _intersect(spans, residual.get(tag, []))
        if both:
            raise CoverError(f"bytes {tag} {_show(both[0])} are in both the payload and the residual")
    for tag, spans in allocated.items():
        missing = _subtract(_subtract(spans, payload.get(tag, [])), residual.get(tag, []))
        if missing:
            raise CoverError(f"allocated bytes {tag} {_show(missing[0])} are in neither the payload nor the residual")

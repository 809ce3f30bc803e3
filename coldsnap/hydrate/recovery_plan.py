"""A recovery plan: which byte ranges of which pinned safetensors files land unchanged at which offsets of
the ``weights`` region — recorded while the engine loaded them its own way (fused projections, renamed
tensors and all, :mod:`coldsnap.agent.weight_copies`), so that a restore without a usable native pack
streams the files through the hydration engine straight into the captured layout instead of running the
engine's loaders again (on vLLM 8B: 23–25 s through its loaders, against ~0.3 s of copies here).

What the plan does not cover (a weight the engine transformed after loading it, padding its loaders
filled) rides in the *recovery gap*, a pack of those bytes written at capture beside the residual: plan
+ gap cover the payload's extents exactly, so a recovery restore puts back the same bytes a native one
does.

File: ``payload/<sha256>.recovery.json``, canonical JSON::

    {"format": 1, "layout_digest": "...", "copies": [[path, file_offset, length, region_tag, region_offset], ...]}
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

from coldsnap.hydrate.engine import CopyItem, HydrationError, HydrationStats, hydrate_items
from coldsnap.memory.regions import StableRegion

__all__ = ["PlannedCopy", "RecoveryPlan", "subtract_extents"]

PLAN_FORMAT = 1


@dataclass(frozen=True, order=True)
class PlannedCopy:
    path: str
    file_offset: int
    length: int
    region: str
    region_offset: int


@dataclass
class RecoveryPlan:
    layout_digest: str
    copies: list[PlannedCopy] = field(default_factory=list)

    def to_json(self) -> bytes:
        return json.dumps({"format": PLAN_FORMAT, "layout_digest": self.layout_digest,
                           "copies": [[c.path, c.file_offset, c.length, c.region, c.region_offset] for c in self.copies]},
                          separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> "RecoveryPlan":
        try:
            document = json.loads(Path(path).read_bytes())
            if document.get("format") != PLAN_FORMAT:
                raise ValueError(f"format {document.get('format')!r}, this coldsnap reads {PLAN_FORMAT}")
            copies = [PlannedCopy(str(p), int(o), int(n), str(t), int(r)) for p, o, n, t, r in document["copies"]]
            return cls(layout_digest=str(document["layout_digest"]), copies=copies)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise HydrationError(f"recovery plan {path}: {exc}") from None

    def extents(self) -> dict[str, list[tuple[int, int]]]:
        """Region tag → the (offset, length) ranges the plan fills, sorted."""
        out: dict[str, list[tuple[int, int]]] = {}
        for copy in self.copies:
            out.setdefault(copy.region, []).append((copy.region_offset, copy.length))
        return {tag: sorted(ranges) for tag, ranges in out.items()}

    def apply(self, regions: Mapping[str, StableRegion], pinned: Iterable[str], **engine_options: object
              ) -> list[HydrationStats]:
        """Copy every planned range from its file to its region (each file by the hydration engine, its
        extents checked against the mapped bytes first). Every file must be one of ``pinned`` (admission
        verified their bytes)."""
        allowed = set(pinned)
        by_file: dict[str, list[CopyItem]] = {}
        targets: dict[str, StableRegion] = {}
        for copy in self.copies:
            if copy.path not in allowed:
                raise HydrationError(f"recovery plan reads {copy.path}, which the capture did not pin")
            region = regions.get(copy.region)
            if region is None:
                raise HydrationError(f"recovery plan fills region {copy.region!r}, which is not mapped")
            targets[copy.region] = region
            by_file.setdefault(copy.path, []).append(CopyItem(copy.file_offset, copy.length, region.base + copy.region_offset))
        return [hydrate_items(path, sorted(items), targets.values(), **engine_options)  # type: ignore[arg-type]
                for path, items in sorted(by_file.items())]


def subtract_extents(ranges: list[tuple[int, int]], taken: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of ``ranges`` (offset, length) that no range of ``taken`` covers; both sorted."""
    out: list[tuple[int, int]] = []
    for start, length in ranges:
        cursor, end = start, start + length
        for t_start, t_length in taken:
            t_end = t_start + t_length
            if t_end <= cursor or t_start >= end:
                continue
            if t_start > cursor:
                out.append((cursor, t_start - cursor))
            cursor = max(cursor, t_end)
        if cursor < end:
            out.append((cursor, end - cursor))
    return out

"""What a restore needs on each GPU of this host, and whether it is there (standard library only).

:mod:`coldsnap.activation.gpu_memory` admits a restore by it, from the decoded capsule; a restore's entry
(:mod:`coldsnap.activation.early_restore`) asks the same before its launcher stages weights on a GPU, from
the capsule's JSON, before pydantic is imported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

__all__ = ["GpuNeed", "LAUNCHER_CONTEXT_BYTES", "needs_per_gpu", "shortfalls"]

LAUNCHER_CONTEXT_BYTES = 600 << 20
"""The launcher's own CUDA context on each GPU it stages weights onto (it hands the staged weights over:
they are the rank's, counted once)."""


@dataclass
class GpuNeed:
    """What a restore needs on one GPU of this host, and of what."""

    serving_bytes: int = 0
    region_bytes: dict[str, int] = field(default_factory=dict)
    launcher_bytes: int = 0

    @property
    def total(self) -> int:
        return self.serving_bytes + self.launcher_bytes

    def describe(self) -> str:
        parts = [f"{tag} {size / 2**30:.1f} GiB" for tag, size in sorted(self.region_bytes.items()) if size]
        rest = self.serving_bytes - sum(self.region_bytes.values())
        if rest > 0:
            parts.append(f"graphs, contexts and other device state {rest / 2**30:.1f} GiB")
        if self.launcher_bytes:
            parts.append(f"the launcher's context {self.launcher_bytes / 2**30:.1f} GiB")
        return ", ".join(parts)


def needs_per_gpu(uses: Iterable[tuple[str, int, int]], cuda_regions: dict[int, dict[str, int]],
                  moved: dict[str, str], staging: bool) -> dict[str, GpuNeed]:
    """This host's GPU UUID → what the restore needs there. ``uses``: each recorded process's ``(captured
    GPU UUID, pid, serving bytes)``, counted on the GPU ``moved`` maps its GPU to (unmoved: the same);
    ``cuda_regions``: each rank's pid → its CUDA regions' high-water bytes by tag; ``staging``: the
    launcher holds a context of its own on every such GPU."""
    needs: dict[str, GpuNeed] = {}
    for uuid, pid, serving_bytes in uses:
        need = needs.setdefault(moved.get(uuid, uuid), GpuNeed())
        need.serving_bytes += serving_bytes
        for tag, size in cuda_regions.get(pid, {}).items():
            need.region_bytes[tag] = need.region_bytes.get(tag, 0) + size
    if staging:
        for need in needs.values():
            need.launcher_bytes = LAUNCHER_CONTEXT_BYTES
    return needs


def shortfalls(needs: dict[str, GpuNeed], free: dict[str, int], span: dict | None = None) -> list[str]:
    """One line per GPU whose free bytes fall short of its need (a GPU not in ``free`` is not judged:
    placement refuses one that is not there); ``span`` takes each GPU's need and free bytes."""
    short = []
    for uuid, need in sorted(needs.items()):
        available = free.get(uuid)
        if span is not None:
            span[f"{uuid}.need_bytes"] = need.total
        if available is None:
            continue
        if span is not None:
            span[f"{uuid}.free_bytes"] = available
        if need.total > available:
            short.append(f"{uuid} needs {need.total / 2**30:.1f} GiB ({need.describe()}), {available / 2**30:.1f} GiB free")
    return short

"""GPU memory admission: a restore starts only where every GPU it goes to has room for what the capsule's
processes used there while serving (weights, KV cache, graphs, contexts; recorded at capture), plus the
launcher's own CUDA context where it stages weights. Found out after CRIU and the CUDA restore ran, a
shortage cost an H200 5.4 s and failed at ``restore.resume``; a manager that evicts on a prepare-only
success must hear it from admission.

On a machine without a GPU the check runs against a stand-in: ``COLDSNAP_STANDIN_GPU_FREE_BYTES=N``
makes admission treat a capsule's host-backed regions as one GPU's needs and that GPU as having N bytes
free — for tests of the refusal path only; it never applies to a capsule that has GPU processes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from coldsnap.activation.replica import GpuPlacement
from coldsnap.contracts.capsule import CapsuleManifest
from coldsnap.operation import OperationContext, OperationFailed

__all__ = ["GpuNeed", "LAUNCHER_CONTEXT_BYTES", "STANDIN_FREE_ENV", "admit_gpu_memory", "gpu_needs"]

STANDIN_FREE_ENV = "COLDSNAP_STANDIN_GPU_FREE_BYTES"
STANDIN_GPU = "stand-in GPU (host memory)"

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


def gpu_needs(capsule: CapsuleManifest, gpus: GpuPlacement | None, staging: bool) -> dict[str, GpuNeed]:
    """This host's GPU UUID → what the restore needs there: each recorded process's serving bytes on the
    GPU its capture GPU maps to, with the regions of the rank it is."""
    metadata = capsule.metadata
    moved = dict(gpus.pairs) if gpus is not None else {}
    ranks = {worker.pid: worker for worker in metadata.workers}
    needs: dict[str, GpuNeed] = {}
    for used in metadata.gpu_memory:
        need = needs.setdefault(moved.get(used.gpu_uuid, used.gpu_uuid), GpuNeed())
        need.serving_bytes += used.serving_bytes
        worker = ranks.get(used.pid)
        for tag, region in (worker.regions.items() if worker is not None else ()):
            if region.backend == "cuda":
                need.region_bytes[tag] = need.region_bytes.get(tag, 0) + region.high_water
    if staging:
        for need in needs.values():
            need.launcher_bytes = LAUNCHER_CONTEXT_BYTES
    return needs


def _standin_needs(capsule: CapsuleManifest) -> dict[str, GpuNeed]:
    regions: dict[str, int] = {}
    for worker in capsule.metadata.workers:
        for tag, region in worker.regions.items():
            if region.backend == "host":
                regions[tag] = regions.get(tag, 0) + region.high_water
    return {STANDIN_GPU: GpuNeed(serving_bytes=sum(regions.values()), region_bytes=regions)} if regions else {}


def admit_gpu_memory(context: OperationContext, capsule: CapsuleManifest, gpus: GpuPlacement | None,
                     staging: bool, span: dict) -> None:
    """``admission.gpu_memory`` unless every GPU the restore goes to has the room it needs; nothing to
    check for a capsule without recorded GPU use (CPU, or NVML could not tell at capture)."""
    standin = os.environ.get(STANDIN_FREE_ENV)
    if capsule.metadata.gpu_memory:
        needs = gpu_needs(capsule, gpus, staging)
        from coldsnap.snapshot.nvml import NvmlError, device_memory

        try:
            free = {uuid: memory.free for uuid, memory in device_memory().items()}
        except NvmlError as exc:
            context.warn(f"GPU memory not admitted: {exc}")
            return
    elif standin is not None and not capsule.metadata.gpu_pids:
        needs, free = _standin_needs(capsule), {STANDIN_GPU: int(standin)}
    else:
        return
    short = []
    for uuid, need in sorted(needs.items()):
        available = free.get(uuid)
        span[f"{uuid}.need_bytes"] = need.total
        if available is None:
            continue  # (placement refuses a GPU that is not there)
        span[f"{uuid}.free_bytes"] = available
        if need.total > available:
            short.append(f"{uuid} needs {need.total / 2**30:.1f} GiB ({need.describe()}), {available / 2**30:.1f} GiB free")
    if short:
        raise OperationFailed("admission.gpu_memory", "not enough GPU memory: " + "; ".join(short)
                              + " — free the GPU, or place the restore on another (--gpu)")

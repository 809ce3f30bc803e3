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


from coldsnap.activation.gpu_room import GpuNeed, needs_per_gpu, shortfalls
from coldsnap.activation.restore_place import GpuPlacement
from coldsnap.contracts.capsule import CapsuleManifest
from coldsnap.operation import OperationContext, OperationFailed
from coldsnap.settings import SETTINGS

__all__ = ["STANDIN_FREE_ENV", "admit_gpu_memory", "gpu_needs"]

STANDIN_FREE_ENV = "COLDSNAP_STANDIN_GPU_FREE_BYTES"
STANDIN_GPU = "stand-in GPU (host memory)"


def gpu_needs(capsule: CapsuleManifest, gpus: GpuPlacement | None, staging: bool) -> dict[str, GpuNeed]:
    """This host's GPU UUID → what the restore needs there (:func:`~coldsnap.activation.gpu_room.needs_per_gpu`):
    each recorded process's serving bytes on the GPU its capture GPU maps to, with the regions of the rank
    it is."""
    metadata = capsule.metadata
    cuda_regions = {worker.pid: {tag: region.high_water for tag, region in worker.regions.items()
                                 if region.backend == "cuda"} for worker in metadata.workers}
    return needs_per_gpu([(used.gpu_uuid, used.pid, used.serving_bytes) for used in metadata.gpu_memory], cuda_regions,
                         dict(gpus.pairs) if gpus is not None else {}, staging)


def _standin_needs(capsule: CapsuleManifest) -> dict[str, GpuNeed]:
    regions: dict[str, int] = {}
    for worker in capsule.metadata.workers:
        for tag, region in worker.regions.items():
            if region.backend == "host":
                regions[tag] = regions.get(tag, 0) + region.high_water
    return {STANDIN_GPU: GpuNeed(serving_bytes=sum(regions.values()), region_bytes=regions)} if regions else {}


def admit_gpu_memory(context: OperationContext, capsule: CapsuleManifest, gpus: GpuPlacement | None,
                     staging: bool, span: dict, held: dict[str, int] | None = None) -> None:
    """``admission.gpu_memory`` unless every GPU the restore goes to has the room it needs; nothing to
    check for a capsule without recorded GPU use (CPU, or NVML could not tell at capture). ``held``: GPU
    UUID → bytes this launcher holds there already for the restore (the weights its entry is staging, and
    its context): free for it."""
    standin = SETTINGS.number(STANDIN_FREE_ENV)
    if capsule.metadata.gpu_memory:
        needs = gpu_needs(capsule, gpus, staging)
        from coldsnap.snapshot.nvml import NvmlError, device_memory

        try:
            free = {uuid: memory.free + (held or {}).get(uuid, 0) for uuid, memory in device_memory().items()}
        except NvmlError as exc:
            context.warn(f"GPU memory not admitted: {exc}")
            return
    elif standin is not None and not capsule.metadata.gpu_pids:
        needs, free = _standin_needs(capsule), {STANDIN_GPU: standin}
    else:
        return
    short = shortfalls(needs, free, span)
    if short:
        raise OperationFailed("admission.gpu_memory", "not enough GPU memory: " + "; ".join(short)
                              + " — free the GPU, or place the restore on another (--gpu)")

"""Capsule manifest, format 1: one launch unit's CRIU images and what activating them needs.

``DIR/units/<unit>/capsule.json``, written by capture after the dump and covered by the artifact
descriptor's digest of it. ``files`` lists every image with its size and SHA-256 (restore admission
checks them before CRIU runs); ``metadata`` is what the launcher needs to bring the tree back and
talk to it: each rank's agent socket and memory regions, how CRIU dumped it, which processes hold
CUDA state on which GPUs — or, for an n580 capsule, the template it places.
"""

from __future__ import annotations

from typing import Any, ClassVar, Final, Literal

from pydantic import Field

from coldsnap.contracts.artifact import RelativePath
from coldsnap.contracts.base import Contract, Identifier, Sha256Hex

__all__ = ["CAPSULE_FORMAT", "ActivationMetadata", "CapsuleFile", "CapsuleManifest", "GpuProcessMemory", "RegionRecord",
           "TemplateRecord", "WorkerActivation"]

CAPSULE_FORMAT: Final = 1


class CapsuleFile(Contract):
    """One CRIU image file."""

    path: RelativePath
    """Path relative to the unit's ``images/`` folder."""
    size_bytes: int = Field(ge=0)
    """File size at capture."""
    sha256: Sha256Hex
    """SHA-256 of the file's bytes."""


class RegionRecord(Contract):
    """A stable memory region of a rank as the agent reported it when it released the region."""

    backend: Literal["cuda", "host"]
    """Where the region lives."""
    device: int
    """CUDA device ordinal (``-1``/``0`` for host regions, as the agent reports it)."""
    base: int = Field(ge=0)
    """Virtual address the region is mapped at, in the process and after every restore."""
    size: int = Field(ge=0)
    """Reserved address range in bytes."""
    mapped: int = Field(ge=0)
    """Bytes mapped when the agent reported (0 once released)."""
    high_water: int = Field(ge=0)
    """Bytes that were mapped before the release: what a restore maps and fills again."""
    chunk_bytes: int = Field(ge=0)
    """Physical allocation granularity of the region."""


class WorkerActivation(Contract):
    """One rank of the unit."""

    rank: int = Field(ge=0)
    """Global rank."""
    control: str = Field(min_length=1)
    """The rank's agent socket (``@name``: abstract), restored with the process."""
    pid: int = Field(gt=0)
    """The rank's process id (CRIU restores it unchanged)."""
    layout: dict[str, Any]
    """The rank's model memory layout (:class:`coldsnap.contracts.layout.MemoryLayout`'s JSON value)."""
    layout_digest: Sha256Hex
    """Digest of ``layout``: packs and resume commands are bound to it."""
    regions: dict[str, RegionRecord]
    """The rank's regions by tag (``weights``, ``kv_cache``, ...)."""
    graphs_released: list[str]
    """CUDA graphs the agent dropped before the snapshot (recaptured at resume)."""


class TemplateRecord(Contract):
    """An n580 capsule's process: the template launcher stopped before the engine started."""

    control: str = Field(min_length=1)
    """The template's socket (``@name``), restored with it: where the restore sends the placement."""
    placement_abi: int = Field(ge=1)
    """The placement ABI the template speaks (:mod:`coldsnap.contracts.placement`)."""
    preload: list[str]
    """The modules it imported before the boundary."""
    command: list[str] = Field(min_length=1)
    """The engine's command it runs once placed."""
    nvidia_driver: str | None
    """The capture host's NVIDIA driver (an ABI-1 template restores only under this version)."""


class GpuProcessMemory(Contract):
    """What one process of the tree used on one GPU (NVML), recorded at capture: restore admission
    checks the GPU it goes to has room for it before anything starts (``admission.gpu_memory``)."""

    pid: int = Field(gt=0)
    """The process (its captured pid)."""
    gpu_uuid: str = Field(min_length=1)
    """The capture host's GPU."""
    serving_bytes: int = Field(ge=0)
    """While it served, before capture released anything: weights, KV cache, graphs, contexts — what it
    needs there again once restored."""
    checkpointed_bytes: int = Field(ge=0)
    """At the CUDA checkpoint, weights and KV released: what the driver's restore allocates."""


class ActivationMetadata(Contract):
    """What the launcher needs to activate the unit's images."""

    control: str = Field(min_length=1)
    """Rank 0's agent socket (each other rank's is derived from it)."""
    serving_port: int = Field(ge=1, le=65535)
    """The port the restored server listens on (checked free at admission)."""
    root_pid: int = Field(gt=0)
    """Root of the dumped process tree."""
    workers: list[WorkerActivation] = Field(min_length=1)
    """Every rank, in rank order."""
    criu_options: list[str]
    """The CRIU options of the dump."""
    criu_tcp: Literal["established", "none"]
    """Whether connected TCP sockets were dumped (``--tcp-established``); restore does as the dump did."""
    gpu_pids: list[int]
    """Processes of the tree that held CUDA state (CUDA-restored after CRIU); empty on CPU."""
    gpu_uuids: list[str]
    """The capture host's GPU UUIDs by ordinal, remapped onto this host's at restore."""
    gpu_memory: list[GpuProcessMemory] = Field(default_factory=list)
    """Each GPU process's use of each GPU at capture (empty on CPU, or where NVML could not tell)."""
    host_file_mtimes_ns: dict[str, int] = Field(default_factory=dict)
    """Modification time (ns) at capture of each regular host file the image opens read-only by path:
    restore admission names any that changed (``admission.files``) before CRIU runs."""
    address: str | None = None
    """One unit of several: the unit's address on the activation's network at capture. A restore onto a
    host of another address maps it in its copy of the socket images (placement, not identity)."""
    template: TemplateRecord | None = None
    """n580: the image is this template, not the serving process (``workers`` then describe the
    capture's run of the engine, from which its packs were written)."""


class CapsuleManifest(Contract):
    """``units/<unit>/capsule.json``."""

    SUPPORTED_FORMATS: ClassVar[tuple[int, ...]] = (CAPSULE_FORMAT,)

    format: Literal[1]
    """Manifest format."""
    unit_id: Identifier
    """The launch unit the images belong to."""
    files: list[CapsuleFile]
    """Every image file, sorted by path."""
    metadata: ActivationMetadata
    """Activation metadata."""

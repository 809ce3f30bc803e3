"""Memory layout and semantic manifest: the two identities an artifact is bound to.

The *memory layout* says which stable regions a worker preserved and which named tensors live where
inside them; its digest is written into the native pack header and the artifact, so a pack is only
hydrated into the layout it was cut from. The *semantic manifest* is the part of a request that
defines what was captured (engine, model, commands, topology, driver, graph policy) without its
placement (hosts, ports, device ordinals); two captures with equal manifests are interchangeable.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from coldsnap.contracts.base import Contract, Identifier
from coldsnap.contracts.common import EngineName, GraphPolicyMode, RegionTag, SnapshotDriverName
from coldsnap.contracts.request import ModelSpec, OperationRequest

__all__ = ["TensorExtent", "RegionLayout", "MemoryLayout", "SemanticUnit", "SemanticManifest"]


class TensorExtent(Contract):
    """One named tensor inside a region."""

    name: str = Field(min_length=1)
    """Engine parameter name (e.g. ``model.layers.0.mlp.up_proj.weight``)."""
    dtype: str = Field(pattern=r"^[a-z][a-z0-9_]*$")
    """torch dtype name without the ``torch.`` prefix (``bfloat16``, ``float8_e4m3fn``...)."""
    shape: list[int] = Field(max_length=16)
    """Tensor shape; ``[]`` for a scalar."""
    offset: int = Field(ge=0)
    """Byte offset of the first element from the region's base address."""
    length: int = Field(ge=0)
    """Byte length of the tensor's storage."""

    @model_validator(mode="after")
    def _check_shape(self) -> "TensorExtent":
        if any(d < 0 for d in self.shape):
            raise ValueError(f"shape {self.shape} has a negative dimension")
        return self


class RegionLayout(Contract):
    """A stable region: one reserved virtual address range with one tag."""

    tag: RegionTag
    """What the region holds."""
    size_bytes: int = Field(ge=0)
    """Reserved size (granularity-aligned)."""
    tensors: list[TensorExtent] = Field(default_factory=list)
    """Named tensors in the region, sorted by offset, non-overlapping, inside ``size_bytes``."""

    @model_validator(mode="after")
    def _check_extents(self) -> "RegionLayout":
        end = 0
        for tensor in self.tensors:
            if tensor.offset < end:
                raise ValueError(f"tensor {tensor.name!r} at offset {tensor.offset} overlaps or is out of order")
            end = tensor.offset + tensor.length
            if end > self.size_bytes:
                raise ValueError(f"tensor {tensor.name!r} ends at {end}, past the region's {self.size_bytes} bytes")
        return self


class MemoryLayout(Contract):
    """The stable allocation layout of one worker."""

    SUPPORTED_FORMATS: ClassVar[tuple[int, ...]] = (1,)

    format: Literal[1]
    """Layout format version."""
    regions: list[RegionLayout]
    """Regions in reservation order; a tag appears at most once."""

    @model_validator(mode="after")
    def _check_tags(self) -> "MemoryLayout":
        tags = [r.tag for r in self.regions]
        if len(set(tags)) != len(tags):
            raise ValueError(f"regions: a tag appears twice in {tags}")
        return self

    def digest(self) -> str:
        """The layout digest (canonical SHA-256) written into packs and artifacts."""
        return self.canonical_sha256()


class SemanticUnit(Contract):
    """A launch unit without its placement."""

    unit_id: Identifier
    """Launch-unit identity."""
    command: list[str]
    """Exact argv."""
    worker_ranks: list[int]
    """Ranks of the unit's workers, in order."""


class SemanticManifest(Contract):
    """What was captured, independent of where it runs."""

    SUPPORTED_FORMATS: ClassVar[tuple[int, ...]] = (1,)

    format: Literal[1]
    """Manifest format version."""
    engine: EngineName
    """Engine adapter."""
    snapshot_driver: SnapshotDriverName
    """Snapshot driver; capsules are driver-specific."""
    model: ModelSpec
    """Model name and pinned revision."""
    graph_policy: GraphPolicyMode
    """Resolved CUDA graph policy."""
    units: list[SemanticUnit]
    """Topology and commands."""

    @classmethod
    def from_request(cls, request: OperationRequest) -> "SemanticManifest":
        """The manifest of a *resolved* request (see :func:`coldsnap.contracts.profiles.resolve_request`)."""
        if request.policy.graphs.mode is None:
            raise ValueError("resolve the request's policy before deriving its manifest")
        return cls(
            format=1,
            engine=request.engine,
            snapshot_driver=request.snapshot_driver,
            model=request.model,
            graph_policy=request.policy.graphs.mode,
            units=[
                SemanticUnit(unit_id=u.unit_id, command=list(u.command), worker_ranks=[w.rank for w in u.workers])
                for u in request.units
            ],
        )

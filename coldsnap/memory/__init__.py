"""Stable memory: tagged regions at fixed virtual addresses whose physical memory can be released
before a process snapshot and mapped again, at the same addresses, after restore.

Two real backends behind one API: CUDA VMM (``backend="cuda"``) and host memory (``backend="host"``,
for CPU engines). Torch allocations made inside ``with region("weights"):`` land in that region.
Nothing here imports torch or touches a GPU until a region is reserved or a tensor is asked for.
"""

from coldsnap.memory.regions import (
    DISCARDED_TAGS,
    REGION_TAGS,
    AllocationError,
    RegionError,
    StableRegion,
    engine_graph_pool,
    get_region,
    graph_pool,
    region,
    regions,
    release_all,
    reserve,
    reserve_staging,
)

__all__ = [
    "DISCARDED_TAGS",
    "REGION_TAGS",
    "AllocationError",
    "RegionError",
    "StableRegion",
    "engine_graph_pool",
    "get_region",
    "graph_pool",
    "region",
    "regions",
    "release_all",
    "reserve",
    "reserve_staging",
]

"""Hydration: bytes from files (native packs, safetensors) into stable regions, GPU or host.

The copying is done by the C++ engine in ``coldsnap._C`` (parallel reads into a bounded pinned ring,
multi-stream asynchronous copies, the GIL released); this package plans the copies and checks that
each one lands inside a mapped region before anything is read.
"""

from coldsnap.hydrate.engine import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_RING_BYTES,
    DEFAULT_THREADS,
    CopyItem,
    HydrationError,
    HydrationStats,
    hydrate_items,
    prefetch_file,
    read_file,
)
from coldsnap.hydrate.native_pack import (PinnedPack, hydrate_pack, hydrate_pack_as_it_arrives, payload_extents,
                                         write_pack_from_regions)
from coldsnap.hydrate.replay import SafetensorsIndex, replay_safetensors

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_RING_BYTES",
    "DEFAULT_THREADS",
    "CopyItem",
    "HydrationError",
    "HydrationStats",
    "PinnedPack",
    "SafetensorsIndex",
    "hydrate_items",
    "hydrate_pack",
    "hydrate_pack_as_it_arrives",
    "payload_extents",
    "write_pack_from_regions",
    "prefetch_file",
    "read_file",
    "replay_safetensors",
]

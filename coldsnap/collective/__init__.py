"""A rank's collective communicators, torn down before a snapshot and rebuilt after it.

NCCL state cannot survive a process snapshot (its transports are sockets, shared memory and peer
mappings of other processes), so every communicator of a rank is destroyed once the rank is drained
and created again after restore from a fresh unique id that rank 0 makes and the activation's
coordinator hands to the other ranks, with barriers before and after each step
(:class:`RankCollectives`). Engines hold a :class:`ManagedCommunicator`, a stable handle whose
connection is swapped underneath.

Backends: :class:`NcclBackend` (GPU; ``libnccl`` loaded at run time by ``coldsnap._C``) and
:class:`HostBackend` (CPU tensors over loopback TCP, the same unique-id → connect → close life cycle,
so a CPU-only host runs the whole tensor-parallel sequence).
"""

from coldsnap.collective.base import Backend, CollectiveError, Communicator
from coldsnap.collective.group import ManagedCommunicator, RankCollectives
from coldsnap.collective.host import HostBackend
from coldsnap.collective.nccl import NcclBackend, nccl_library

__all__ = ["Backend", "CollectiveError", "Communicator", "HostBackend", "ManagedCommunicator", "NcclBackend",
           "RankCollectives", "nccl_library"]

"""Names shared by several contracts: engines, snapshot drivers, operations, policies.

These are the contract's whole vocabulary (the operator contract's, docs/design.md), not what this build implements: a request may
name any of them and is then refused with ``request.unsupported`` if this build lacks it (the registry
in :mod:`coldsnap.contracts.profiles`, which ``coldsnap capabilities`` prints).
"""

from __future__ import annotations

from typing import Literal

__all__ = [
    "EngineName",
    "SnapshotDriverName",
    "OperationName",
    "ReplaySemantics",
    "WeightsMode",
    "NativeMaterialization",
    "GraphPolicyMode",
    "RegionTag",
    "OperationState",
]

EngineName = Literal["vllm", "sglang", "torch-lm"]
"""``torch-lm`` is coldsnap's own reference workload (``coldsnap.workloads.torch_lm``)."""
SnapshotDriverName = Literal["n580", "n610"]
OperationName = Literal["capture", "restore", "warm", "sleep", "wake", "status"]
OperationState = Literal["succeeded", "failed"]

ReplaySemantics = Literal[
    "safe-to-repeat",
    "content-idempotent",
    "convergent",
    "replacement-oriented",
    "conflicts-with-existing-output",
]
"""What repeating an operation with the same request does (the operator contract, docs/design.md)."""

WeightsMode = Literal["auto", "native", "recovery", "cache-only-auto"]
NativeMaterialization = Literal["off", "async", "required"]
GraphPolicyMode = Literal["retain", "recreate"]
RegionTag = Literal["weights", "kv_cache", "cudagraph", "runtime"]

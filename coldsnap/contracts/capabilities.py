"""Capabilities: the static contract ``coldsnap capabilities`` prints for managers to negotiate.

It states what this build accepts and can drive — exactly the registry of
:mod:`coldsnap.contracts.profiles`, which also refuses requests for anything else — and does not
assert that a given host has CRIU or a GPU (``coldsnap doctor`` and restore admission check that).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from coldsnap.contracts.artifact import ARTIFACT_FORMAT
from coldsnap.contracts.base import Contract
from coldsnap.contracts.common import (
    EngineName,
    NativeMaterialization,
    OperationName,
    ReplaySemantics,
    SnapshotDriverName,
)
from coldsnap.contracts.profiles import ENGINE_ADAPTERS, OPERATIONS, SNAPSHOT_DRIVERS
from coldsnap.contracts.receipt import RECEIPT_FORMAT
from coldsnap.contracts.request import REQUEST_FORMAT
from coldsnap.contracts.timing_events import MAX_EVENT_BYTES, MAX_EVENTS, TIMING_EVENT_FORMAT

__all__ = ["Capabilities", "HOST_PROVIDER_FORMAT", "HostProviderStatus", "build_capabilities", "FEATURES"]

HOST_PROVIDER_FORMAT = 1
"""The manager host-provider protocol's format this build speaks as a client (docs/host-provider.md)."""

FEATURES = ("operation-timing-spans", "operation-timing-events-ndjson-v1", "request-owner")
"""``request-owner``: a request may carry ``owner`` (uid, gid), who gets the files the operation writes."""


class ProtocolFormats(Contract):
    """Wire and storage format versions."""

    request_formats: list[int]
    """Accepted request formats."""
    artifact_formats: list[int]
    """Accepted artifact descriptor formats."""
    receipt_format: int
    """Receipt format written."""
    timing_event_format: int
    """Timing-event format written by ``--timing-events``."""
    timing_event_limits: dict[str, int]
    """Caps of a timing-event stream (``max_events``, ``max_event_bytes``)."""
    host_provider_format: int
    """The manager host-provider protocol's format this build speaks (docs/host-provider.md)."""


class HostProviderStatus(Contract):
    """The manager's host provider as this process found it (``COLDSNAP_HOST_PROVIDER_SOCKET``)."""

    given: bool
    """Whether a provider's socket was named."""
    connected: bool
    """Whether its handshake succeeded (the token matched, the format is spoken)."""
    provider: str | None = None
    """The provider's name, from its welcome."""
    operations: list[str] = Field(default_factory=list)
    """What it offers."""
    hosts: list[str] = Field(default_factory=list)
    """The hosts it reaches."""
    problem: str | None = None
    """Why it could not be connected (given, not connected)."""


class EngineCapability(Contract):
    """One engine adapter this build drives."""

    name: EngineName
    """Engine name as requests spell it."""
    python_package: str
    """The coldsnap plugin package inside the serving image."""
    native_materialization: list[NativeMaterialization]
    """Native materialization modes this build runs for the engine (a request naming another is refused)."""
    default_native_materialization: NativeMaterialization
    """Mode used when a request omits it."""


class SnapshotDriverCapability(Contract):
    """One snapshot process driver this build implements."""

    name: SnapshotDriverName
    """Driver name as requests spell it."""
    minimum_nvidia_driver: int
    """Lowest NVIDIA driver major the driver supports (always enforced)."""
    boundary: str
    """What a capture with this driver holds."""
    default_graph_policy: Literal["retain", "recreate"]
    """Graph policy when a request omits it."""
    operations: list[OperationName]
    """The operations it runs (a subset of the build's)."""


class Capabilities(Contract):
    """What this coldsnap build accepts and drives."""

    controller: str
    """Build identity: ``coldsnap <version>``."""
    protocol: ProtocolFormats
    """Format versions."""
    engines: list[EngineCapability]
    """The engine adapters this build drives; a request naming another engine is refused."""
    snapshot_drivers: list[SnapshotDriverCapability]
    """The snapshot drivers this build implements, with their NVIDIA driver floors; others are refused."""
    operations: dict[OperationName, ReplaySemantics]
    """The operations this build runs, with their replay semantics; others are refused."""
    features: list[str] = Field(min_length=1)
    """Negotiable features."""
    host_provider: HostProviderStatus
    """The host provider this process was given, if any, and whether it answered."""


def build_capabilities(version: str, host_provider: HostProviderStatus | None = None) -> Capabilities:
    """``host_provider``: what the caller found of the manager's provider (default: none given)."""
    return Capabilities(
        controller=f"coldsnap {version}",
        protocol=ProtocolFormats(
            request_formats=[REQUEST_FORMAT],
            artifact_formats=[ARTIFACT_FORMAT],
            receipt_format=RECEIPT_FORMAT,
            timing_event_format=TIMING_EVENT_FORMAT,
            timing_event_limits={"max_events": MAX_EVENTS, "max_event_bytes": MAX_EVENT_BYTES},
            host_provider_format=HOST_PROVIDER_FORMAT,
        ),
        engines=[
            EngineCapability(
                name=adapter.name,
                python_package=adapter.python_package,
                native_materialization=sorted(adapter.native_materialization),
                default_native_materialization=adapter.native_materialization[0],
            )
            for adapter in ENGINE_ADAPTERS.values()
        ],
        snapshot_drivers=[
            SnapshotDriverCapability(
                name=p.name,
                minimum_nvidia_driver=p.minimum_nvidia_driver,
                boundary=p.boundary,
                default_graph_policy=p.default_graph_mode,
                operations=list(p.operations),
            )
            for p in SNAPSHOT_DRIVERS.values()
        ],
        operations=dict(OPERATIONS),
        features=list(FEATURES),
        host_provider=host_provider or HostProviderStatus(given=False, connected=False),
    )

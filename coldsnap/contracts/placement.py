"""The placement record an n580 template accepts (placement ABI 2): what a restore applies to a process
captured before the engine started, and when a template may be given one.

An n580 capsule is a launcher stopped at the pre-CUDA boundary: Python started and the engine's modules
imported, no CUDA, NVML or distributed socket yet. Restored on any host, it is handed the destination's
placement, validates and applies it, then runs the engine's normal startup. Placement ABI 2 templates hold
no NVIDIA userspace-driver mapping (checked at capture), so they may be restored under another NVIDIA
driver; ABI 1 templates could, and are refused for cross-driver restore (seeds, architecture: "Older
placement-ABI-1 n580 capsules remain usable on their captured driver generation but are rejected for
cross-driver restore").
"""

from __future__ import annotations

import re

from pydantic import Field

from coldsnap.contracts.base import Contract

__all__ = ["NATIVE_PACK_ENV", "PLACEMENT_ABI", "PRELOAD_ENV", "PlacementRecord", "PlacementRefused", "WEIGHTS_MODE_ENV",
           "check_placement_abi"]

PLACEMENT_ABI = 2
"""The placement ABI this build's templates speak."""

NATIVE_PACK_ENV = "COLDSNAP_NATIVE_PACK"
"""Placement env: the native pack the engine's load format hydrates its weights from at load time."""
WEIGHTS_MODE_ENV = "COLDSNAP_WEIGHTS_MODE"
"""Placement env: the load format's mode (``native``, ``auto``, ``recovery``) when its own config names none."""

PRELOAD_ENV = "COLDSNAP_TEMPLATE_PRELOAD"
"""A capture unit's env: the modules its n580 template imports (comma-separated), instead of the engine
adapter's list (:data:`coldsnap.contracts.profiles.ENGINE_ADAPTERS`)."""

ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"


class PlacementRecord(Contract):
    """What the template applies before it starts the engine."""

    abi: int = Field(ge=1)
    """Placement ABI of the sender; the template refuses one it does not speak."""
    serving_port: int | None = Field(default=None, ge=1, le=65535)
    """The port the engine serves on (replaces the command's ``--port`` value); None keeps the captured one."""
    visible_devices: str | None = Field(default=None, pattern=r"^[A-Za-z0-9,:-]+$")
    """``CUDA_VISIBLE_DEVICES`` for the engine (ordinals or GPU UUIDs); None keeps the environment's."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment additions (transport, offline mode, ...), applied before the engine starts."""


class PlacementRefused(ValueError):
    """A placement the template cannot take: another ABI, or a template unfit for this host's driver."""


def check_placement_abi(template_abi: int, record: PlacementRecord, captured_driver: str | None = None,
                        host_driver: str | None = None) -> None:
    """Raise :class:`PlacementRefused` unless a template of ``template_abi`` may take ``record``: the ABIs
    must match, and an ABI-1 template (which could hold NVIDIA userspace mappings) is restored only under
    the NVIDIA driver generation (major version) it was captured with."""
    if record.abi != template_abi:
        raise PlacementRefused(f"placement ABI {record.abi} sent to a template of placement ABI {template_abi}")
    for name in record.env:
        if not re.match(ENV_NAME, name):
            raise PlacementRefused(f"placement env name {name!r} is not an environment variable name")
    if template_abi < 2 and captured_driver and host_driver and captured_driver.split(".")[0] != host_driver.split(".")[0]:
        raise PlacementRefused(f"a placement-ABI-{template_abi} template (it may hold NVIDIA userspace mappings) "
                               f"captured under driver {captured_driver} cannot be restored under {host_driver}")

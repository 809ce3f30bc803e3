"""The placement record an n580 template accepts (placement ABI 2): what a restore applies to a process
captured before the engine started, and when a template may be given one.

An n580 capsule is a launcher stopped at the pre-CUDA boundary: Python started and the engine's modules
imported, no CUDA, NVML or distributed socket yet. Restored on any host, it is handed the destination's
placement, validates and applies it, then runs the engine's normal startup. Placement ABI 2 templates hold
no NVIDIA userspace-driver mapping (checked at capture), so they may be restored under another NVIDIA
driver; ABI 1 templates may map its libraries, and are refused for cross-driver restore (seeds,
architecture: "Older placement-ABI-1 n580 capsules remain usable on their captured driver generation but
are rejected for cross-driver restore" — here: the captured driver version exactly, since CRIU maps
those library files again).
"""

from __future__ import annotations

import re

from pydantic import Field

from coldsnap.contracts.base import Contract

__all__ = ["GRAPHS_AFTER_READY", "GRAPHS_ENV", "NATIVE_PACK_ENV", "PLACEMENT_ABI", "PLACEMENT_ABIS", "PLACEMENT_ABI_ENV",
           "PRELOAD_ENV", "PlacementRecord", "PlacementRefused", "WEIGHTS_MODE_ENV", "check_placement_abi"]

PLACEMENT_ABI = 2
"""The placement ABI of a template by default: it holds no NVIDIA userspace-driver mapping."""
PLACEMENT_ABIS = (1, 2)
"""The placement ABIs this build's templates speak. ABI 1 (opt-in): the template may map the NVIDIA
userspace driver's libraries (a preloaded ``torch`` with CUDA does: cuBLASLt loads ``libcuda`` when it
is loaded) but holds no NVIDIA device (CUDA and NVML never initialized); it restores only under the
driver it was captured with."""
PLACEMENT_ABI_ENV = "COLDSNAP_PLACEMENT_ABI"
"""A capture unit's env: the placement ABI of its n580 template (default :data:`PLACEMENT_ABI`)."""

NATIVE_PACK_ENV = "COLDSNAP_NATIVE_PACK"
"""Placement env: the native pack the engine's load format hydrates its weights from at load time."""
WEIGHTS_MODE_ENV = "COLDSNAP_WEIGHTS_MODE"
"""Placement env: the load format's mode (``native``, ``auto``, ``recovery``) when its own config names none."""

GRAPHS_ENV = "COLDSNAP_GRAPHS"
"""Placement env: ``after-ready`` (graph policy ``recreate``) asks the engine to serve eagerly first and
capture its CUDA graphs once it has answered (the reference workload does; vLLM and SGLang capture theirs
in their own startup, before readiness)."""
GRAPHS_AFTER_READY = "after-ready"

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
    must match, and an ABI-1 template (it maps the capture host's NVIDIA userspace-driver libraries, which
    CRIU restores from those very files) is restored only under the NVIDIA driver it was captured with."""
    if record.abi != template_abi:
        raise PlacementRefused(f"placement ABI {record.abi} sent to a template of placement ABI {template_abi}")
    for name in record.env:
        if not re.match(ENV_NAME, name):
            raise PlacementRefused(f"placement env name {name!r} is not an environment variable name")
    if template_abi < 2 and captured_driver and captured_driver != host_driver:
        raise PlacementRefused(f"a placement-ABI-{template_abi} template (it maps the NVIDIA userspace driver's "
                               f"libraries) captured under driver {captured_driver} cannot be restored under "
                               f"{host_driver or 'no NVIDIA driver'}; capture a placement-ABI-2 template to move "
                               "across drivers")

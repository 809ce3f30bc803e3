"""The snapshot driver's NVIDIA driver floor, and the one host-owner override of it.

n610 requires NVIDIA driver 610 or newer (seeds: the floor is part of the driver contract, and a
request cannot relax it). A qualification host can still need to run the n610 sequence on an older
driver whose CUDA checkpoint API already works — the project's H200 runs 580.159, where the project
verified checkpoint + VMM + graphs. ``COLDSNAP_ALLOW_UNQUALIFIED_DRIVER=1`` in the environment of
``coldsnap capture`` / ``coldsnap restore`` turns the refusal into a receipt warning naming the
shortfall. It is deliberately not a request field: orchestrators cannot set it, a host owner must.
"""

from __future__ import annotations


from coldsnap.contracts.profiles import SNAPSHOT_DRIVERS, UNSUPPORTED
from coldsnap.operation import OperationContext, OperationFailed
from coldsnap.settings import SETTINGS

__all__ = ["ALLOW_UNQUALIFIED_DRIVER_ENV", "check_driver_floor", "require_implemented_driver"]

ALLOW_UNQUALIFIED_DRIVER_ENV = "COLDSNAP_ALLOW_UNQUALIFIED_DRIVER"


def require_implemented_driver(snapshot_driver: str) -> None:
    """Refuse (``request.unsupported``) a snapshot driver this build cannot run, before anything starts.

    ``run_operation`` already refuses such a request when it resolves it (the registry in
    :mod:`coldsnap.contracts.profiles`); this repeats the check for callers that build a context themselves.
    """
    if snapshot_driver not in SNAPSHOT_DRIVERS:
        raise OperationFailed(UNSUPPORTED, f"snapshot_driver: {snapshot_driver} is not implemented in this build "
                              f"(implemented: {', '.join(SNAPSHOT_DRIVERS)})")


def check_driver_floor(context: OperationContext, snapshot_driver: str, nvidia_driver: str, code: str) -> None:
    """Refuse (``code``) a host below the snapshot driver's floor, or warn when the host owner allowed it."""
    require_implemented_driver(snapshot_driver)
    floor = SNAPSHOT_DRIVERS[snapshot_driver].minimum_nvidia_driver
    major = int(nvidia_driver.split(".")[0])
    if major >= floor:
        return
    shortfall = f"snapshot driver {snapshot_driver} needs NVIDIA driver {floor}+, this host has {nvidia_driver}"
    if SETTINGS.flag(ALLOW_UNQUALIFIED_DRIVER_ENV):
        context.warn(f"unqualified: {shortfall} ({ALLOW_UNQUALIFIED_DRIVER_ENV}=1)")
        return
    raise OperationFailed(code, f"{shortfall} (a host owner can set {ALLOW_UNQUALIFIED_DRIVER_ENV}=1 to run it unqualified)")

"""The snapshot drivers, by the name a request gives (``snapshot_driver``): what each runs for capture,
restore, warm and wake. One module per driver declares its pipelines as ordered lists of named steps
(:mod:`coldsnap.activation.n610`, :mod:`coldsnap.activation.n580`); :mod:`coldsnap.activation.lifecycle`
looks the driver up here and runs them.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from coldsnap.activation.qualification import require_implemented_driver

if TYPE_CHECKING:
    from coldsnap.activation.admission import Admitted
    from coldsnap.activation.artifact_dir import ArtifactDir
    from coldsnap.activation.capture_state import CheckRestore
    from coldsnap.operation import OperationContext, OperationOutcome

__all__ = ["SnapshotDriver", "driver_for"]


@dataclass(frozen=True)
class SnapshotDriver:
    """A driver's pipelines. ``admit_placement`` is what it admits on top of the common admission (n610:
    the GPUs and their room; n580: the template's placement); its answer goes to ``restore`` (and
    ``warm``). ``warm`` and ``wake`` exist where the driver has a warm boundary (n610; the request
    profiles refuse them for n580)."""

    name: str
    capture: Callable[[OperationContext, ArtifactDir, float, CheckRestore], OperationOutcome]
    admit_placement: Callable[[OperationContext, ArtifactDir, Admitted], Any]
    restore: Callable[[OperationContext, ArtifactDir, Admitted, Any], OperationOutcome]
    warm: Callable[..., OperationOutcome] | None = None
    wake: Callable[..., OperationOutcome] | None = None


# Each driver's module is imported when a request names it: a restore does not import the other driver's
# pipeline (n580's capture steps and template placement), and every module counts before CRIU starts.
_DRIVER_MODULES = {"n610": "coldsnap.activation.n610", "n580": "coldsnap.activation.n580"}


def driver_for(name: str) -> SnapshotDriver:
    """The driver a request names (one this build implements: ``request.unsupported`` otherwise)."""
    require_implemented_driver(name)
    module = importlib.import_module(_DRIVER_MODULES[name])
    return SnapshotDriver(name, module.capture, module.admit_placement, module.restore,
                          getattr(module, "warm", None), getattr(module, "wake", None))

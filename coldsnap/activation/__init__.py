"""The launcher's side of a snapshot: capture a serving command into an artifact, restore it.

The two load apart (PEP 562): a restore does not import capture.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from coldsnap.activation.capture import capture
    from coldsnap.activation.restore import admit, restore

__all__ = ["admit", "capture", "restore"]
_HOMES = {"admit": "restore", "capture": "capture", "restore": "restore"}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'coldsnap.activation' has no attribute {name!r}")
    return getattr(importlib.import_module(f"coldsnap.activation.{_HOMES[name]}"), name)

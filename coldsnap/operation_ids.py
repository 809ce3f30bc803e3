"""Operation ids (standard library only: a restore's first step names its operation before the rest of
coldsnap is imported, :mod:`coldsnap.activation.early_restore`)."""

from __future__ import annotations

import os
import time

__all__ = ["new_operation_id"]


def new_operation_id(operation: str) -> str:
    """``OPERATION-<local time>-<pid>``: two operations started in the same second (a race, a retry loop)
    still have ids of their own."""
    return f"{time.strftime(f'{operation}-%Y%m%dT%H%M%S')}-{os.getpid()}"

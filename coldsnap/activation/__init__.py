"""The launcher's side of a snapshot: capture a serving command into an artifact, restore it."""

from coldsnap.activation.capture import capture
from coldsnap.activation.restore import admit, restore

__all__ = ["admit", "capture", "restore"]

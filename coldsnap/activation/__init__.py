"""The launcher's side of a snapshot: capture a serving command into an artifact, restore it.

:func:`coldsnap.activation.capture.capture` and :func:`coldsnap.activation.restore.restore` (with
:func:`~coldsnap.activation.restore.admit`) are imported from their modules: this package re-exports
nothing, so a restore does not import capture.
"""

"""The launcher's side of a snapshot: capture a serving command into an artifact, restore it.

Entry points: :mod:`coldsnap.activation.lifecycle` (capture, restore, warm, wake). They run the common
admission (:mod:`~coldsnap.activation.admission`), then the request's snapshot driver
(:mod:`~coldsnap.activation.drivers`: :mod:`~coldsnap.activation.n610`, :mod:`~coldsnap.activation.n580`),
whose pipelines are ordered lists of named steps over :mod:`~coldsnap.activation.capture_steps` and
:mod:`~coldsnap.activation.restore_steps`. This package re-exports nothing: importing one module loads
only what it needs.
"""

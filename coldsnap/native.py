"""Lazy access to the native extension ``coldsnap._C`` (never imported at ``import coldsnap``)."""

from __future__ import annotations

import functools
from types import ModuleType

__all__ = ["NativeUnavailable", "native", "probe_cuda"]


class NativeUnavailable(ImportError):
    """``coldsnap._C`` is not built or does not load here."""


@functools.cache
def _load() -> ModuleType | str:
    try:
        from coldsnap import _C
    except ImportError as exc:
        return f"coldsnap._C does not load: {exc} (build it with `pip install -e .` or `python setup.py build_ext --inplace`)"
    return _C


def native() -> ModuleType:
    """The loaded ``coldsnap._C`` module; raises :class:`NativeUnavailable` with the reason."""
    loaded = _load()
    if isinstance(loaded, str):
        raise NativeUnavailable(loaded)
    return loaded


def probe_cuda() -> dict:
    """``coldsnap._C.cuda_probe()`` plus ``native_extension``; never raises. Without the extension it
    reports CUDA unavailable with the reason."""
    try:
        probe = native().cuda_probe()
    except NativeUnavailable as exc:
        return {"available": False, "reason": str(exc), "native_extension": False, "devices": [],
                "checkpoint_api": False, "vmm_api": False}
    return {"native_extension": True, **probe}

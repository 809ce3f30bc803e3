"""Lazy access to the native extension ``coldsnap._C`` (never imported at ``import coldsnap``)."""

from __future__ import annotations

import functools
from types import ModuleType

__all__ = ["NativeUnavailable", "native"]


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

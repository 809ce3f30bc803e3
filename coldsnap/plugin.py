"""Idempotent engine-plugin registration shared by ``coldsnap_vllm`` and ``coldsnap_sglang``.

Engines load their plugins once in *every* process they start, sometimes more than once in one
process; installing a hook twice would wrap it twice. The registration runs its installer once per
process, under a lock, and remembers a failure instead of retrying a half-installed state.

A plugin never breaks its engine: engines do not catch what a plugin function raises (vLLM's
``load_general_plugins`` calls it bare), so a failing installer is reported as one warning and the
engine runs without coldsnap.

Some hooks live in engine modules a plugin must not import at registration (importing a GPU worker
module in an engine's API server costs seconds): :func:`after_import` runs a hook when the engine
itself imports the module.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import logging
import re
import sys
import threading
from types import ModuleType
from typing import Any, Callable, cast

__all__ = ["PluginRegistration", "after_import", "lookup", "exists", "release"]

log = logging.getLogger(__name__)


class PluginRegistration:
    """A callable entry point that runs ``install`` at most once per process."""

    def __init__(self, engine: str, install: Callable[[], None]):
        self.engine = engine
        self._install = install
        self._lock = threading.Lock()
        self._state = "pending"  # pending -> installed | failed

    @property
    def installed(self) -> bool:
        return self._state == "installed"

    def __call__(self) -> None:
        with self._lock:
            if self._state != "pending":
                return
            try:
                self._install()
            except Exception as exc:  # noqa: BLE001 - whatever it is, the engine must still start
                self._state = "failed"
                log.warning("coldsnap %s plugin disabled: it could not register (%s: %s); the engine runs without "
                            "coldsnap", self.engine, type(exc).__name__, exc)
                log.debug("coldsnap %s plugin registration failure", self.engine, exc_info=True)
                return
            self._state = "installed"
            log.debug("coldsnap %s plugin registered", self.engine)


def _run_hook(hook: Callable[[ModuleType], None], module: ModuleType) -> None:
    try:
        hook(module)
    except Exception as exc:  # noqa: BLE001 - a hook that fails loses its feature, never the engine
        log.warning("coldsnap: a hook on %s failed (%s: %s); the engine runs without it", module.__name__,
                    type(exc).__name__, exc)


class _HookedLoader:
    """The module's own loader, then the hook; everything else (``get_source``, ...) is the original's."""

    def __init__(self, loader: Any, hook: Callable[[ModuleType], None]):
        self._loader = loader
        self._hook = hook

    def create_module(self, spec: Any) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _run_hook(self._hook, module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class _AfterImportFinder(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, hook: Callable[[ModuleType], None]):
        self.name = name
        self.hook = hook

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # once; and the lookup below must not find this finder again
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        # Not an importlib.abc.Loader subclass: that base's defaults would shadow the original's methods.
        spec.loader = cast(importlib.abc.Loader, _HookedLoader(spec.loader, self.hook))
        return spec


def after_import(name: str, hook: Callable[[ModuleType], None]) -> None:
    """Run ``hook(module)`` once the module ``name`` is imported: now if it already is, else right after
    the engine imports it. A hook that raises is reported as one warning."""
    module = sys.modules.get(name)
    if module is not None:
        _run_hook(hook, module)
        return
    if not any(isinstance(f, _AfterImportFinder) and f.name == name and f.hook is hook for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImportFinder(name, hook))


def lookup(symbol: str) -> Any:
    """The object ``module:attr.attr`` names; LookupError when the module or an attribute is missing."""
    module_name, _, path = symbol.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise LookupError(f"{module_name}: {exc}") from None
    for part in path.split(".") if path else ():
        try:
            target = getattr(target, part)
        except AttributeError:
            raise LookupError(f"{symbol}: no {part}") from None
    return target


def exists(symbol: str) -> bool:
    """Whether :func:`lookup` finds ``symbol``."""
    try:
        lookup(symbol)
        return True
    except LookupError:
        return False


def release(version: str) -> tuple[int, int] | None:
    """(major, minor) of a version string ("0.5.17" → (0, 5)); None when it is not one."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else None

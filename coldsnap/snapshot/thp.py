"""The host's transparent-huge-page mode, switched to ``always`` for a restore's page fill — on request only.

CRIU 4.2 fills a restored process's private memory into fresh 4 KiB pages and applies the dumped
``MADV_HUGEPAGE`` only after the fill (docs/design.md, "CRIU's page fill"), and the kernel has no
per-process opt-in: the one way to fill with huge pages is the host-wide mode
``/sys/kernel/mm/transparent_hugepage/enabled``. With ``always`` for the fill an 8B vLLM restore's CRIU
step went 3.80 → 2.58 s on the H200. That setting is the host owner's, and every process allocating
meanwhile gets huge pages too, so coldsnap never changes it unless asked (``coldsnap restore --host-thp``
or ``COLDSNAP_HOST_THP=always``).

Restores running at once share one window: the first one in records the mode it found and sets
``always``, the last one out puts the recorded mode back (a record and a lock in the state root, holders
by pid, so one killed mid-fill is dropped by the next restore that enters or leaves).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
from pathlib import Path
from typing import Iterator

from coldsnap.host import pid_alive
from coldsnap.settings import SETTINGS, SettingError

__all__ = ["HOST_THP_ENV", "RECORD_FILES", "THP_ENABLED", "ThpError", "host_thp_requested", "huge_pages_for_the_fill", "thp_mode"]


HOST_THP_ENV = "COLDSNAP_HOST_THP"
"""``always``: switch the host's THP mode to always for each restore's CRIU fill (the CLI's ``--host-thp``)."""
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_RECORD = "host-thp.json"
RECORD_FILES = (_RECORD, _RECORD + ".lock")
"""What the THP switch keeps in the state root (the mode to put back and its holders; their lock)."""


class ThpError(RuntimeError):
    """The host's THP mode cannot be read or set (not root, no THP in this kernel)."""


def host_thp_requested() -> bool:
    try:
        return SETTINGS.choice(HOST_THP_ENV) == "always"
    except SettingError as exc:
        raise ThpError(str(exc)) from None


def thp_mode(path: Path = THP_ENABLED) -> str:
    """The selected mode (``always``, ``madvise`` or ``never``: the bracketed word of the sysfs file)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ThpError(f"cannot read {path}: {exc.strerror or exc}") from None
    found = re.search(r"\[(\w+)\]", text)
    if found is None:
        raise ThpError(f"{path}: no selected mode in {text.strip()!r}")
    return found[1]


def _set_mode(path: Path, mode: str) -> None:
    try:
        path.write_text(mode)
    except OSError as exc:
        raise ThpError(f"cannot set {path} to {mode}: {exc.strerror or exc}") from None


@contextlib.contextmanager
def _locked_record(state_root: Path) -> Iterator[dict]:
    state_root.mkdir(parents=True, exist_ok=True)
    record_path = state_root / _RECORD
    with open(state_root / (_RECORD + ".lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            record = json.loads(record_path.read_text())
        except (OSError, ValueError):
            record = {}
        record["holders"] = [p for p in record.get("holders", []) if isinstance(p, int) and pid_alive(p)]
        yield record
        if record.get("holders"):
            temporary = record_path.with_suffix(".tmp")
            temporary.write_text(json.dumps(record))
            os.replace(temporary, record_path)
        else:
            record_path.unlink(missing_ok=True)


def _leave(state_root: Path, path: Path) -> str | None:
    """Drop this process from the window; the last one out restores the recorded mode (returned)."""
    with _locked_record(state_root) as record:
        if os.getpid() in record["holders"]:  # one entry per window: a process may hold several at once
            record["holders"].remove(os.getpid())
        if record["holders"] or "previous" not in record:
            return None
        previous = record.pop("previous")
        _set_mode(path, previous)
        return previous


@contextlib.contextmanager
def huge_pages_for_the_fill(state_root: Path, path: Path = THP_ENABLED) -> Iterator[str]:
    """THP ``always`` on this host while the block runs (see the module docstring); yields the mode that
    was selected before. Raises :class:`ThpError` before the block when the mode cannot be set."""
    with _locked_record(state_root) as record:
        if not record["holders"]:
            stale = record.get("previous")  # a window whose holders all died: their mode is still the one to restore
            record["previous"] = stale or thp_mode(path)
        if thp_mode(path) != "always":
            _set_mode(path, "always")
        record["holders"].append(os.getpid())
        before = record["previous"]
    try:
        yield before
    finally:
        try:
            _leave(state_root, path)
        except ThpError as exc:  # the restore itself is not failed for it; the next window restores the mode
            import logging  # (only here: a restore's entry imports this module for its names, on its hot path)

            logging.getLogger(__name__).warning("coldsnap: %s; the host's THP mode stays always until the next restore's window ends", exc)

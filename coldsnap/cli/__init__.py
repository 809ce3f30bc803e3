"""The ``coldsnap`` command line.

Machine-facing output (capabilities, receipts, ``--json``) goes to stdout; everything for people goes
to stderr. Bad input exits with status 2 and one line per problem, never a traceback.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from coldsnap.activation.early_restore import FastEntry

# the package's parts: flags (the flags commands share, standard library only: the restore's fast entry
# parses with them), parser (one function per command), requests (what the friendly flags stand for),
# handlers (what each command does); the tests reach the request builders through here. They are imported
# when first named, so that importing coldsnap.cli.flags alone imports none of them.
_PARTS = {"VALIDATORS": "handlers", "build_parser": "parser", "capture_request": "parser",
          "_artifact_request": "requests", "_capture_request": "requests", "_infer_engine": "requests",
          "new_operation_id": "requests", "port_number": "requests"}
__all__ = [*_PARTS, "main", "run"]


def __getattr__(name: str) -> Any:
    if name not in _PARTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_PARTS[name]}"), name)


def main(argv: list[str] | None = None, entry: FastEntry | None = None) -> int:
    """``entry``: what the program's entry did for a ``coldsnap restore`` (:func:`coldsnap.activation.early_restore.start_tree`),
    handed to the restore it is for."""
    from coldsnap.cli.parser import build_parser
    from coldsnap.operation import EXIT_OK, EXIT_USAGE
    from coldsnap.settings import SettingError

    args = build_parser().parse_args(argv)
    args.entry = entry
    try:
        return args.func(args)
    except SettingError as exc:  # a COLDSNAP_* variable its type does not allow (coldsnap/settings.py)
        print(f"coldsnap: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:
        return EXIT_OK
    except KeyboardInterrupt:
        print("coldsnap: interrupted", file=sys.stderr)
        return 130


def run(entry: FastEntry | None = None) -> None:
    """The ``coldsnap`` program: :func:`main`, then out without tearing down what the OS reclaims anyway.

    By then everything is written and closed (receipt, timing events, staged memory); the interpreter's
    own shutdown (module teardown, the CUDA driver's exit handlers after the admission probe) only
    delays the exit a restore's caller waits for (~0.1 s on the H200). coldsnap registers no exit
    handlers of its own."""
    try:
        status = main(entry=entry)
    finally:
        if entry is not None:  # a tree the entry started that no restore adopted (a usage error came first)
            entry.abandon()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except OSError:  # a reader that went away (`| head`): nothing left to tell it
            pass
    os._exit(status)


if __name__ == "__main__":
    run()

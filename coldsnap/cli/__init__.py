"""The ``coldsnap`` command line.

Machine-facing output (capabilities, receipts, ``--json``) goes to stdout; everything for people goes
to stderr. Bad input exits with status 2 and one line per problem, never a traceback.
"""

from __future__ import annotations

import os
import sys

from coldsnap.cli.handlers import VALIDATORS
from coldsnap.cli.parser import build_parser, capture_request
from coldsnap.cli.requests import _artifact_request, _capture_request, _infer_engine, new_operation_id, port_number
from coldsnap.operation import EXIT_OK, EXIT_USAGE
from coldsnap.settings import SettingError

# the package's parts: parser (one function per command), requests (what the friendly flags stand for),
# handlers (what each command does); the tests reach the request builders through here
__all__ = ["VALIDATORS", "_artifact_request", "_capture_request", "_infer_engine", "build_parser", "capture_request",
           "main", "new_operation_id", "port_number", "run"]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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


def run() -> None:
    """The ``coldsnap`` program: :func:`main`, then out without tearing down what the OS reclaims anyway.

    By then everything is written and closed (receipt, timing events, staged memory); the interpreter's
    own shutdown (module teardown, the CUDA driver's exit handlers after the admission probe) only
    delays the exit a restore's caller waits for (~0.1 s on the H200). coldsnap registers no exit
    handlers of its own."""
    try:
        status = main()
    finally:
        early = sys.modules.get("coldsnap.activation.early_restore")
        if early is not None:  # a tree the entry started that no restore adopted (a usage error came first)
            early.abandon_unadopted()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except OSError:  # a reader that went away (`| head`): nothing left to tell it
            pass
    os._exit(status)


if __name__ == "__main__":
    run()

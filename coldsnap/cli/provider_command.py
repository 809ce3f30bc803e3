"""``coldsnap provider serve``: the reference host provider (:mod:`coldsnap.provider.server`) for one operation."""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from coldsnap.operation import EXIT_OK, EXIT_USAGE

__all__ = ["add_provider", "drive_unit_hosts"]

SERVE_DESCRIPTION = """\
Serve the manager host-provider protocol (docs/host-provider.md) for one operation, reaching the hosts of
--hosts by their transport: local (this machine), nsenter (a network namespace of it) or ssh (OpenSSH's client,
the host's key checked, never prompted for). The socket is private (mode 0600, in a directory of its own) and
opened with a fresh token.

With a command after --, it runs that command with COLDSNAP_HOST_PROVIDER_SOCKET and COLDSNAP_HOST_PROVIDER_TOKEN
set, serves while it runs, and exits with its status; everything a client started on a host through the provider
is killed when that client goes. Without one, it prints the socket's path on stdout, writes the token to
--token-file and serves until SIGINT or SIGTERM.

Example: coldsnap provider serve --hosts hosts.toml -- coldsnap capabilities
"""


def add_provider(commands: Any) -> None:
    p = commands.add_parser("provider", help="the reference host provider: serve the manager host-provider protocol",
                            description="The manager host-provider protocol's reference server (docs/host-provider.md).")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    serve = actions.add_parser("serve", help="serve the protocol for one operation (the command after --)",
                               description=SERVE_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    serve.add_argument("--hosts", required=True, metavar="FILE", help="hosts.toml: one [hosts.NAME] table per host "
                       "(docs/host-provider.md)")
    serve.add_argument("--socket", metavar="PATH", help="where to serve (default: a new private directory under $TMPDIR)")
    serve.add_argument("--token-file", metavar="F", help="also write the token here (mode 0600); needed without a command")
    serve.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD ...", help="the operation to serve")
    serve.set_defaults(func=_cmd_provider_serve)


def _cmd_provider_serve(args: argparse.Namespace) -> int:
    from coldsnap.provider.client import SOCKET_ENV, TOKEN_ENV
    from coldsnap.provider.hosts import HostsError, read_hosts
    from coldsnap.provider.server import ProviderServer

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command and not args.token_file:
        print("coldsnap provider serve: give the command to serve after --, or --token-file F to serve until "
              "stopped", file=sys.stderr)
        return EXIT_USAGE
    try:
        hosts = read_hosts(Path(args.hosts))
    except HostsError as exc:
        print(f"coldsnap provider serve: {exc}", file=sys.stderr)
        return EXIT_USAGE
    private = None if args.socket else tempfile.mkdtemp(prefix="coldsnap-provider-")  # (mode 0700)
    path = Path(args.socket) if args.socket else Path(private or "") / "socket"
    token = secrets.token_urlsafe(32)
    if args.token_file:
        descriptor = os.open(args.token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "w") as out:
            out.write(token + "\n")
    try:
        server = ProviderServer(path, token, hosts).start()
    except OSError as exc:
        print(f"coldsnap provider serve: cannot serve {path}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        print(f"coldsnap provider: serving {len(hosts)} host(s) ({', '.join(sorted(hosts))}) at {path}", file=sys.stderr)
        if not command:
            print(path, flush=True)
            stop = threading.Event()
            for signum in (signal.SIGINT, signal.SIGTERM):
                signal.signal(signum, lambda *_: stop.set())
            stop.wait()
            return EXIT_OK
        try:
            done = subprocess.run(command, env={**os.environ, SOCKET_ENV: str(path), TOKEN_ENV: token})
        except OSError as exc:
            print(f"coldsnap provider serve: {command[0]}: {exc.strerror or exc}", file=sys.stderr)
            return EXIT_USAGE
        return done.returncode if done.returncode >= 0 else 128 - done.returncode
    finally:
        server.close()
        if private is not None:
            os.rmdir(private)


def drive_unit_hosts(args: argparse.Namespace) -> int:
    """``coldsnap restore DIR --unit-hosts H0,H1,...``: every unit on its host through the provider
    (:func:`coldsnap.provider.units.drive_units`); unit 0's receipt (every unit's spans) is this command's."""
    from coldsnap.atomic import write_atomic
    from coldsnap.provider.client import HostProvider, ProviderError
    from coldsnap.provider.units import UnitFailed, drive_units

    operation = args.operation
    hosts = [host for host in args.unit_hosts.split(",") if host]
    given = [flag for flag, value in (("--units", args.units), ("--unit", args.unit), ("--rendezvous", args.rendezvous),
                                      ("--request-json", args.request_json), ("--prepare-only", args.prepare_only))
             if value]
    if given or len(hosts) < 2 or args.artifact.startswith("oci://"):
        print(f"coldsnap {operation}: --unit-hosts takes DIR and two or more hosts, unit 0's first (the units, their "
              f"rendezvous and token are its own{f'; not {given[0]}' if given else ''})", file=sys.stderr)
        return EXIT_USAGE
    try:
        provider = HostProvider.from_settings()
    except ProviderError as exc:
        print(f"coldsnap {operation}: the host provider: {exc}", file=sys.stderr)
        return 1
    if provider is None:
        print(f"coldsnap {operation}: --unit-hosts needs the manager's host provider (COLDSNAP_HOST_PROVIDER_SOCKET and "
              "_TOKEN; `coldsnap provider serve --hosts hosts.toml -- coldsnap ...` serves one)", file=sys.stderr)
        return EXIT_USAGE
    unknown = [host for host in hosts if host not in provider.welcome.hosts]
    if unknown:
        print(f"coldsnap {operation}: the host provider has no host {unknown[0]!r} (its hosts: "
              f"{', '.join(provider.welcome.hosts)})", file=sys.stderr)
        return EXIT_USAGE
    extra = [word for flag, value in (("--port", args.port), ("--gpu", args.gpu), ("--weights", args.weights),
                                      ("--state-dir", args.state_dir)) if value is not None for word in (flag, str(value))]
    receipt: dict[str, Any] | None
    with provider:
        try:
            outcome = drive_units(provider, operation, args.artifact, hosts, extra)
            receipt, status = outcome.receipts[0], EXIT_OK
            print(f"coldsnap {operation}: every unit's {operation} succeeded in {outcome.seconds:.2f} s", file=sys.stderr)
        except UnitFailed as failed:
            print(f"coldsnap {operation}: {failed}", file=sys.stderr)
            receipt, status = failed.receipt, 1
        except ProviderError as exc:
            print(f"coldsnap {operation}: the host provider failed: {exc}", file=sys.stderr)
            receipt, status = None, 1
    if args.receipt_json and receipt is not None:
        text = json.dumps(receipt, sort_keys=True) + "\n"
        if args.receipt_json == "-":
            sys.stdout.write(text)
        else:
            write_atomic(Path(args.receipt_json), text.encode())
    return status

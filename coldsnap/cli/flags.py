"""The flags several ``coldsnap`` commands share, and ``coldsnap restore``'s own (standard library only).

The restore's fast entry (:mod:`coldsnap.activation.early_restore`) parses its argv with the very parser
these build, before the rest of coldsnap is imported: a flag is defined once, for both ways into a restore.
"""

from __future__ import annotations

import argparse

__all__ = ["add_api_key_flag", "add_host_thp_flag", "add_operation_flags", "add_owner_flag", "add_state_dir_flag",
           "add_unit_flags", "add_weights_flag", "parse_port", "port_argument", "positive_int", "restore_arguments"]


def parse_port(text: str | int, what: str = "the serving port") -> int:
    """``text`` as a TCP port (1–65535), or a :class:`ValueError` saying what was wrong."""
    try:
        port = int(text)
    except ValueError:
        raise ValueError(f"{what} must be a number from 1 to 65535, not {text!r}") from None
    if not 1 <= port <= 65535:
        raise ValueError(f"{what} must be from 1 to 65535, not {port}")
    return port


def port_argument(text: str) -> int:
    """argparse's type for a port option: 1–65535, else argparse's one-line error."""
    try:
        return parse_port(text, "a port")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"want a whole number, not {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"want at least 1, not {value}")
    return value


def add_operation_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--request-json", metavar="PATH|-", help="strict request (format 4) instead of the friendly flags; - for stdin")
    p.add_argument("--receipt-json", metavar="PATH|-", help="write the one receipt (format 2) here; - for stdout (progress stays on stderr)")
    p.add_argument("--timing-events", metavar="PATH|-", help="live NDJSON timing events (needs --receipt-json); a new absolute path or -")
    p.add_argument("--operation-id", help="operation identity echoed in the receipt (default: "
                   "OPERATION-<local time>-<pid>, e.g. restore-20261202T090450-3850)")
    add_owner_flag(p)


def add_owner_flag(p: argparse.ArgumentParser) -> None:
    """``--owner UID:GID`` (a command that writes artifacts or state as root: the lifecycle operations,
    publish, pull); :func:`coldsnap.ownership.resolve_owner` takes its value."""
    p.add_argument("--owner", metavar="UID:GID", help="who gets every file and directory this writes under the "
                   "artifact directory and the state directory, modes kept, failures included (default: the "
                   "request's owner, else SUDO_UID:SUDO_GID under sudo, else they stay root's)")


def add_weights_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--weights", choices=["auto", "native", "recovery"], metavar="MODE",
                   help="where the weights come from: auto (the native pack, else — missing or failing verification — "
                   "the safetensors the capture pinned, with a warning), native (the pack or nothing), recovery (the "
                   "pinned safetensors, replayed into the captured layout); default: the capture's policy (auto)")


def add_host_thp_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host-thp", action="store_true",
                   help="switch this HOST's transparent huge pages to `always` while CRIU fills the restored memory "
                   "(faster fill: CRIU 4.2 fills 4 KiB pages otherwise), then back to the mode it found (the last "
                   "of concurrent restores puts it back). Every process on the host allocating meanwhile gets huge "
                   "pages too: the host owner's call. Needs root. Same as COLDSNAP_HOST_THP=always")


def add_state_dir_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--state-dir", metavar="STATE",
                   help="where restores write (STATE/<artifact id>/port-<P>/logs/<unit>.log is the log of the "
                   "server restored on port P, STATE/<artifact id>/standby.json a warm standby's record); default "
                   "$COLDSNAP_STATE_DIR, else $XDG_RUNTIME_DIR/coldsnap, else /run/coldsnap (root) or /tmp/coldsnap-<uid>")


def add_unit_flags(p: argparse.ArgumentParser) -> None:
    """Unit K of an activation of N launch units, each on its own host, meeting at a coordinator."""
    units = p.add_argument_group(
        "one unit of several (each unit's host runs its own `coldsnap` with its own --unit; like torchrun's "
        "--nnodes/--node-rank/--rdzv-endpoint)")
    units.add_argument("--units", type=positive_int, metavar="N", help="the activation's launch units (2 or more)")
    units.add_argument("--unit", type=int, metavar="K", help="the unit this host runs, 0..N-1 (unit 0 serves HTTP "
                       "and answers the canary)")
    units.add_argument("--rendezvous", metavar="HOST:PORT", help="the activation's coordinator every unit joins "
                       "(`coldsnap coordinator --units N`, or unit 0's --serve-rendezvous)")
    units.add_argument("--rendezvous-token-file", metavar="F", help="the activation's token (>= 16 bytes), the same "
                       "file content on every unit's host")
    units.add_argument("--serve-rendezvous", metavar="HOST:PORT", help="this unit serves the coordinator itself, "
                       "listening there (e.g. 0.0.0.0:29600 on unit 0); --rendezvous then defaults to --address:PORT")
    units.add_argument("--rendezvous-timeout", type=positive_int, metavar="SECONDS", help="how long to wait for the "
                       "coordinator to answer first (default 60: a unit may start before the one serving it)")
    units.add_argument("--address", metavar="ADDR", help="this unit's address, where the other units reach it "
                       "(default: this host's address on its route to --rendezvous)")


def add_api_key_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api-key-file", metavar="F", help="the restored server requires this API key from now on (vLLM, "
                   "SGLang: what their --api-key does; F holds the key, one line): installed in its HTTP process "
                   "before the canary, which asks with it. A capture never holds a key (docs/secrets.md); the "
                   "request records the path, never the key")


def restore_arguments(p: argparse.ArgumentParser) -> None:
    """``coldsnap restore``'s operand and flags (the CLI's parser and the fast entry's)."""
    p.add_argument("artifact", nargs="?", metavar="DIR", help="artifact directory written by coldsnap capture, or "
                   "oci://REF: pulled (verified) into STATE/oci/ first, before anything else")
    p.add_argument("--prepare-only", action="store_true", help="admission only: check everything, start nothing")
    p.add_argument("--port", type=port_argument, metavar="P", help="serve on port P (default: the captured port); the "
                   "tree's other bound ports move by the same shift")
    p.add_argument("--gpu", metavar="N[,M...]", help="the GPU(s) to place the ranks on, in rank order "
                   "(CUDA_VISIBLE_DEVICES of this host: ordinals or UUIDs; default: the capture's)")
    p.add_argument("--unit-hosts", metavar="H0,H1,...", help="an artifact of several launch units: restore unit K on "
                   "host HK, all from this one command, through the manager's host provider "
                   "(COLDSNAP_HOST_PROVIDER_SOCKET; docs/host-provider.md); DIR is where each host holds its unit")
    add_weights_flag(p)
    add_api_key_flag(p)
    add_host_thp_flag(p)
    add_state_dir_flag(p)
    add_unit_flags(p)
    add_operation_flags(p)

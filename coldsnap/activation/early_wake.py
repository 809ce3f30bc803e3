"""The first thing `coldsnap wake DIR|ID` does: tell the standby to start filling its weights.

A wake's interpreter start and imports take ~0.2 s and its hydration from the pinned pack ~0.3 s for
16 GB; run one after the other they are half a second before the canary. So the program's entry
(:mod:`coldsnap.__main__`), before it imports anything else, finds the standby's record and sends each
rank's agent :class:`~coldsnap.agent.protocol.Prefill` as its plain JSON line, then the wake proceeds
as usual (admission, lease, resume, canary) while the weights are filled. This module therefore uses
the standard library only.

It starts nothing that the wake would not do: the fill is of the standby's own pack, verified at warm
and mapped since; the resume takes the filled weights only for that pack, after the wake's admission
passed (else it releases them and fills its own way); weights filled for a wake that never resumes
(its admission failed) are released again after 30 s. Anything unusual — flags that choose another
source (``--weights``), a request on stdin, no live standby, an agent that does not answer — and this
does nothing, silently: the wake then fills the weights at its resume, as without it.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

from coldsnap.activation.state import standby_record_file
from coldsnap.host import live_start_ticks

__all__ = ["start_prefill"]

PREFILL_LINE = b'{"command":"prefill"}\n'
""":class:`coldsnap.agent.protocol.Prefill`, encoded (its only field is the command)."""


def start_prefill(arguments: list[str]) -> int:
    """``arguments``: the wake's own (after ``wake``). Returns the number of ranks that started; never raises."""
    try:
        record = _standby_record(arguments)
        if record is None:
            return 0
        return sum(_send_prefill(control) for control in record["controls"])
    except Exception:  # an optimization only: the wake proper reports every real problem
        return 0


# `coldsnap wake`'s options that take a value (see coldsnap.cli); the one positional is DIR|ID.
VALUE_OPTIONS = ("--state-dir", "--receipt-json", "--timing-events", "--operation-id", "--owner", "--api-key-file",
                 # one unit of several: its standby fills its own ranks' weights early, like any other
                 "--units", "--unit", "--rendezvous", "--rendezvous-token-file", "--serve-rendezvous",
                 "--rendezvous-timeout", "--address")


def _standby_record(arguments: list[str]) -> dict | None:
    options: dict[str, str] = {}
    targets: list[str] = []
    rest = iter(arguments)
    for argument in rest:
        name, given, value = argument.partition("=")
        if name in VALUE_OPTIONS:
            options[name] = value if given else next(rest, "")
        elif argument.startswith("-"):  # --weights, --request-json, --help...: not the plain wake
            return None
        else:
            targets.append(argument)
    if len(targets) != 1:
        return None
    root = Path(options["--state-dir"]).resolve() if options.get("--state-dir") else None
    record = json.loads(standby_record_file(targets[0], root).read_text())
    if live_start_ticks(int(record["pid"])) != record["start_ticks"]:
        return None
    return record


def _send_prefill(control: str) -> bool:
    address = b"\0" + control[1:].encode() if control.startswith("@") else control
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.settimeout(2.0)
        connection.connect(address)
        connection.sendall(PREFILL_LINE)
        answer = connection.makefile("rb").readline()
    return b'"started":true' in answer

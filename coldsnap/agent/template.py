"""The n580 template: a launcher stopped at the pre-CUDA boundary, waiting for its placement.

    python -m coldsnap.agent.template --control @NAME [--preload MOD,MOD] -- CMD ARG...

It imports what the engine will need (``--preload``: for the reference workload torch and its model
code; for vLLM, its heavy dependencies — not vLLM itself, whose import probes NVML) and nothing that
touches a GPU, then listens on the abstract unix socket ``--control`` and waits. That is the process an n580 capture dumps: Python started
and the imports paid, no CUDA, NVML or distributed socket. On the socket, one JSON line per connection:

- ``{"op": "status"}`` → ``{"state": "boundary", "abi": 2, "pid": ..., "preloaded": [...]}`` (``abi``:
  ``--placement-abi``, 2 by default);
- ``{"op": "place", "placement": {PlacementRecord}}`` → ``{"ok": true}``, then the template applies the
  placement (environment additions, ``CUDA_VISIBLE_DEVICES``, the command's ``--port``) and runs ``CMD``
  in this process, so the engine starts with its modules already imported: ``python -m MODULE ...`` through
  ``runpy``, a console script (``vllm serve ...``) through its entry point. A placement it cannot take
  (another ABI, a malformed record) gets ``{"ok": false, "error": ...}`` and the template keeps waiting.
  The placing connection stays open: until the launcher sends ``handover`` on it (it holds the engine's
  agent lease by then), its closing stops the template's process group (:func:`watch_launcher`).

Restored by CRIU, the process is the same one, blocked in ``accept``: the restore connects to the same
socket name and places it (:class:`coldsnap.agent.client.TemplateClient`). Placement ABI:
:mod:`coldsnap.contracts.placement`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import runpy
import signal
import socket
import sys
import threading
from typing import Any, Callable

from coldsnap.agent.addresses import address
from coldsnap.contracts.base import ContractError, decode_document
from coldsnap.contracts.placement import PLACEMENT_ABI, PLACEMENT_ABIS, PlacementRecord, PlacementRefused, check_placement_abi

__all__ = ["HANDOVER", "main", "entry", "apply_placement", "watch_launcher"]

PORT_OPTIONS = ("--port",)
REQUEST_TIMEOUT_S = 30.0


def _listen(control: str) -> socket.socket:
    if not control.startswith("@"):
        raise ValueError(f"--control must be an abstract socket name (@NAME), not {control!r}")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(address(control))
    server.listen(1)
    return server


def apply_placement(command: list[str], placement: PlacementRecord) -> list[str]:
    """The command with the placement's serving port, after its environment is applied to this process."""
    os.environ.update(placement.env)
    if placement.visible_devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = placement.visible_devices
    if placement.serving_port is None:
        return list(command)
    placed, index = list(command), 0
    while index < len(placed):
        arg = placed[index]
        if arg in PORT_OPTIONS and index + 1 < len(placed):
            placed[index + 1] = str(placement.serving_port)
            index += 1
        elif any(arg.startswith(f"{option}=") for option in PORT_OPTIONS):
            placed[index] = f"{arg.split('=', 1)[0]}={placement.serving_port}"
        index += 1
    return placed


def entry(command: list[str]) -> Callable[[], Any]:
    """How to run ``command`` in this process: ``python -m MODULE ARGS`` through runpy, a console script
    through its entry point. ValueError for anything else (an exec would lose the imports)."""
    if len(command) >= 3 and os.path.basename(command[0]).startswith("python") and command[1] == "-m":
        module, args = command[2], command[3:]

        def run_module() -> Any:
            sys.argv = [module, *args]
            return runpy.run_module(module, run_name="__main__", alter_sys=True)

        return run_module
    from importlib.metadata import entry_points

    found = [e for e in entry_points(group="console_scripts") if e.name == os.path.basename(command[0])]
    if not found:
        raise ValueError(f"cannot run {command[0]!r} in the template's process: give `python -m MODULE ...` or an "
                         "installed console script")
    script = found[0]

    def run_script() -> Any:
        sys.argv = [command[0], *command[1:]]
        return script.load()()

    return run_script


def _reply(connection: socket.socket, document: dict[str, Any]) -> None:
    connection.sendall(json.dumps(document).encode() + b"\n")


def _read_line(connection: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n") and len(data) < 1 << 20:
        chunk = connection.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def wait_for_placement(server: socket.socket, preloaded: list[str],
                       abi: int = PLACEMENT_ABI) -> tuple[PlacementRecord, socket.socket]:
    """Answer status requests until a placement this template can take arrives: the placement, and the
    placing launcher's connection, left open (:func:`watch_launcher`)."""
    while True:
        connection, _ = server.accept()
        connection.settimeout(REQUEST_TIMEOUT_S)  # a client that sends nothing must not hold the template
        try:
            line = _read_line(connection)
            if not line:
                raise ConnectionResetError("closed without a request")
            request = json.loads(line)
        except OSError:  # timed out, or the client went away: the template keeps waiting
            connection.close()
            continue
        except ValueError:
            request = {"op": None, "error": "not a JSON line"}
        if not isinstance(request, dict):
            request = {"op": None, "error": "not a JSON object"}
        answer: dict[str, Any]
        if request.get("op") == "status":
            answer = {"state": "boundary", "abi": abi, "pid": os.getpid(), "preloaded": preloaded}
        elif request.get("op") != "place":
            answer = {"ok": False, "error": request.get("error") or f"unknown op {request.get('op')!r}"}
        else:
            try:
                placement = decode_document(PlacementRecord, request.get("placement"), "placement")
                check_placement_abi(abi, placement)
            except (ContractError, PlacementRefused) as exc:
                answer = {"ok": False, "error": str(exc)}
            else:
                try:
                    _reply(connection, {"ok": True})
                except OSError:  # the launcher went away: not placed, keep waiting
                    connection.close()
                    continue
                return placement, connection
        with connection:
            try:
                _reply(connection, answer)
            except OSError:  # the client went away before its answer
                pass


HANDOVER = b"handover\n"
"""What the placing launcher sends once it holds the engine (its agent's lease): the template's watch ends."""


def watch_launcher(connection: socket.socket) -> threading.Thread:
    """Until the launcher that placed this template takes the engine over (sends :data:`HANDOVER`), the
    engine's process group lives only as long as that launcher: its connection closing first (the
    launcher failed, was interrupted or killed) stops the group, so no unowned engine keeps the port and
    the GPU. (The agent's lease takes over from there, as after an n610 restore.)"""
    connection.settimeout(None)

    def watch() -> None:
        try:
            line = _read_line(connection)
        except OSError:
            line = b""
        connection.close()
        if line == HANDOVER:
            return
        sys.stderr.write("coldsnap template: the launcher went away before it took the engine over; stopping\n")
        sys.stderr.flush()
        os.killpg(os.getpgrp(), signal.SIGKILL)

    watcher = threading.Thread(target=watch, name="coldsnap-template-watch", daemon=True)
    watcher.start()
    return watcher


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m coldsnap.agent.template", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--control", required=True, help="abstract unix socket name, @NAME")
    parser.add_argument("--preload", default="", help="comma-separated modules to import before the boundary")
    parser.add_argument("--placement-abi", type=int, choices=PLACEMENT_ABIS, default=PLACEMENT_ABI,
                        help="the placement ABI it speaks (default %(default)s; 1: it may map the NVIDIA userspace "
                        "driver's libraries, see coldsnap.contracts.placement)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARG...: the engine's command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the engine's command after --")
    try:
        run = entry(command)
    except ValueError as exc:
        parser.error(str(exc))
    preloaded = [name for name in args.preload.split(",") if name]
    for name in preloaded:
        importlib.import_module(name)
    server = _listen(args.control)
    placement, launcher = wait_for_placement(server, preloaded, args.placement_abi)
    server.close()
    watch_launcher(launcher)
    run = entry(apply_placement(command, placement))
    result = run()
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())

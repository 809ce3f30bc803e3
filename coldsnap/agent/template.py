"""The n580 template: a launcher stopped at the pre-CUDA boundary, waiting for its placement.

    python -m coldsnap.agent.template --control @NAME [--preload MOD,MOD] -- CMD ARG...

It imports what the engine will need (``--preload``: for the reference workload torch and its model
code; for vLLM, ``vllm`` and its model executor) and nothing that touches a GPU, then listens on the
abstract unix socket ``--control`` and waits. That is the process an n580 capture dumps: Python started
and the imports paid, no CUDA, NVML or distributed socket. On the socket, one JSON line per connection:

- ``{"op": "status"}`` → ``{"state": "boundary", "abi": 2, "pid": ..., "preloaded": [...]}`` (``abi``:
  ``--placement-abi``, 2 by default);
- ``{"op": "place", "placement": {PlacementRecord}}`` → ``{"ok": true}``, then the template applies the
  placement (environment additions, ``CUDA_VISIBLE_DEVICES``, the command's ``--port``) and runs ``CMD``
  in this process, so the engine starts with its modules already imported: ``python -m MODULE ...`` through
  ``runpy``, a console script (``vllm serve ...``) through its entry point. A placement it cannot take
  (another ABI, a malformed record) gets ``{"ok": false, "error": ...}`` and the template keeps waiting.

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
import socket
import sys
from typing import Any, Callable

from coldsnap.agent.protocol import address
from coldsnap.contracts.base import ContractError, decode_document
from coldsnap.contracts.placement import PLACEMENT_ABI, PLACEMENT_ABIS, PlacementRecord, PlacementRefused, check_placement_abi

__all__ = ["main", "entry", "apply_placement"]

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


def wait_for_placement(server: socket.socket, preloaded: list[str], abi: int = PLACEMENT_ABI) -> PlacementRecord:
    """Answer status requests until a placement this template can take arrives."""
    while True:
        connection, _ = server.accept()
        connection.settimeout(REQUEST_TIMEOUT_S)  # a client that sends nothing must not hold the template
        with connection:
            try:
                request = json.loads(_read_line(connection) or b"{}")
            except TimeoutError:
                continue
            except ValueError:
                _reply(connection, {"ok": False, "error": "not a JSON line"})
                continue
            if request.get("op") == "status":
                _reply(connection, {"state": "boundary", "abi": abi, "pid": os.getpid(),
                                    "preloaded": preloaded})
                continue
            if request.get("op") != "place":
                _reply(connection, {"ok": False, "error": f"unknown op {request.get('op')!r}"})
                continue
            try:
                placement = decode_document(PlacementRecord, request.get("placement"), "placement")
                check_placement_abi(abi, placement)
            except (ContractError, PlacementRefused) as exc:
                _reply(connection, {"ok": False, "error": str(exc)})
                continue
            _reply(connection, {"ok": True})
            return placement


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
    placement = wait_for_placement(server, preloaded, args.placement_abi)
    server.close()
    run = entry(apply_placement(command, placement))
    result = run()
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())

"""The request documents the friendly flags stand for: the serving command's engine, port, ranks and
model read from it, and an artifact's own request for restore, warm and wake."""

from __future__ import annotations


import argparse
import json
import re
from pathlib import Path

from coldsnap.cli.flags import parse_port
from coldsnap.contracts.placement import PLACEMENT_ABI_ENV, PRELOAD_ENV
from coldsnap.contracts.profiles import ENGINE_ADAPTERS

from coldsnap.operation import UsageError
from coldsnap.secrets.served_key import ApiKeyFileError, read_api_key
from coldsnap.operation_ids import new_operation_id


# A serving command's engine, from its program or its module (`vllm serve`, `python -m vllm...`,
# `python -m sglang.launch_server`, `python -m coldsnap.workloads.torch_lm`), never from its arguments (a
# model path may say "vllm"); anything else needs --engine.
ENGINE_PROGRAMS = {"vllm": "vllm", "sglang": "sglang"}
ENGINE_MODULES = (("vllm", "vllm"), ("sglang", "sglang"), ("coldsnap.workloads.torch_lm", "torch-lm"))


def _python_module(command: list[str]) -> str | None:
    """The module of ``python [options] -m MODULE ...``, or the script's path as a dotted name."""
    for index, arg in enumerate(command[1:], start=1):
        if arg == "-m":
            return command[index + 1] if index + 1 < len(command) else None
        if arg.startswith("-m") and len(arg) > 2:
            return arg[2:]
        if not arg.startswith("-"):  # python SCRIPT.py: the script names what runs
            return arg.removesuffix(".py").replace("/", ".").removesuffix(".__main__")
    return None


def _infer_engine(command: list[str]) -> str | None:
    """The engine ``command`` runs, when its program or its Python module is one this build knows; else None."""
    if not command:
        return None
    program = Path(command[0]).name
    if program in ENGINE_PROGRAMS:
        return ENGINE_PROGRAMS[program]
    if not re.fullmatch(r"python(\d+(\.\d+)?)?", program):
        return None
    module = _python_module(command)
    if module is None:
        return None
    for prefix, engine in ENGINE_MODULES:
        if module == prefix or module.startswith(prefix + "."):
            return engine
    if ".coldsnap.workloads.torch_lm." in f".{module}.":  # python /path/to/coldsnap/workloads/torch_lm/serve.py
        return "torch-lm"
    return None


def _env_name(text: str) -> str:
    """argparse's type for an environment variable's name."""
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not an environment variable's name (give the name, never "
                                         "the value: NAME, not NAME=VALUE)")
    return text


def port_number(text: str | int, what: str = "the serving port") -> int:
    """``text`` as a TCP port (1–65535), or a :class:`UsageError` saying what was wrong."""
    try:
        return parse_port(text, what)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _served_model(command: list[str]) -> str | None:
    """The model after ``serve`` (``vllm serve M``, ``python -m vllm.entrypoints.cli.main serve M``)."""
    if "serve" in command[:6]:
        index = command.index("serve") + 1
        if index < len(command) and not command[index].startswith("-"):
            return command[index]
    return None


def _option_value(command: list[str], name: str) -> str | None:
    for index, arg in enumerate(command):
        if arg == name and index + 1 < len(command):
            return command[index + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


# How serving commands spell their tensor- and pipeline-parallel sizes (torch_lm and SGLang --tp, vLLM -tp,
# ...): the activation's ranks are their product, split evenly over its units.
TP_OPTIONS = ("--tp", "--tensor-parallel-size", "-tp", "--tp-size")
PP_OPTIONS = ("--pipeline-parallel-size", "-pp", "--pp-size", "--pp")
# How they spell their multi-node placement (vLLM, SGLang and torch_lm alike): checked against --units/--unit.
NODES_OPTION, NODE_RANK_OPTION = "--nnodes", "--node-rank"


def _first_option_value(command: list[str], names: tuple[str, ...]) -> str | None:
    return next((v for v in (_option_value(command, o) for o in names) if v is not None), None)


def _command_ranks(command: list[str]) -> int:
    """The activation's ranks as the command states them: tensor- times pipeline-parallel size (1 each
    when not given)."""
    ranks = 1
    for names in (TP_OPTIONS, PP_OPTIONS):
        given = _first_option_value(command, names) or "1"
        try:
            ranks *= int(given)
        except ValueError:
            raise UsageError(f"cannot tell the number of ranks from {given!r}: pass --ranks N") from None
    return ranks


def _check_command_nodes(command: list[str], selection: dict | None) -> None:
    """A multi-node command (``--nnodes N --node-rank K``) is one unit of N: its own flags and coldsnap's
    must name the same unit, or the capsule would be recorded as a unit its engine is not."""
    nodes, node_rank = _option_value(command, NODES_OPTION), _option_value(command, NODE_RANK_OPTION)
    if nodes is None:
        return  # a launcher that places its nodes its own way (environment, a config file): coldsnap's flags rule
    units, index = (selection["unit"]["units"], selection["index"]) if selection else (1, 0)
    try:
        stated = (int(nodes), int(node_rank) if node_rank is not None else 0)
    except ValueError:
        return  # torchrun's elastic `--nnodes 1:2`, or a bad flag the engine refuses with its own words
    if stated[0] > 1 and selection is None:
        raise UsageError(f"the command runs on {stated[0]} nodes (--nnodes {stated[0]}): capture it as one unit "
                         f"of several, on each node: --units {stated[0]} --unit K (K: its --node-rank) "
                         "--rendezvous-token-file F and --rendezvous HOST:PORT or --serve-rendezvous HOST:PORT")
    if selection is not None and stated != (units, index):
        raise UsageError(f"--units {units} --unit {index} but the command says --nnodes {stated[0]} --node-rank "
                         f"{stated[1]}: give each node's command the --node-rank of its --unit")


def _capture_request(args: argparse.Namespace) -> dict:
    """The request format 4 document the friendly flags stand for."""
    if not args.out:
        raise UsageError("--out DIR is required (or give --request-json)")
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise UsageError("give the serving command after --, e.g. coldsnap capture --out DIR -- vllm serve MODEL ...")
    selection = unit_selection(args)
    index = selection["index"] if selection else 0
    given_port = args.port if args.port is not None else _option_value(command, "--port")
    port: int | None = None  # one unit of several: only unit 0 serves (the canary asks it), whatever CMD binds
    if given_port is not None and index == 0:
        port = port_number(given_port, "--port" if args.port is not None else "the command's --port")
    elif index == 0:
        raise UsageError("cannot tell the serving port: pass --port P (or give the command a --port option)")
    _check_command_nodes(command, selection)
    ranks = args.ranks
    if ranks is None:
        ranks = _command_ranks(command)
        if selection:  # the command's ranks span every unit (`--tp 2 --nnodes 2`: one rank here)
            if ranks % selection["unit"]["units"]:
                raise UsageError(f"the command's {ranks} ranks (tensor- times pipeline-parallel size) do not split "
                                 f"over {selection['unit']['units']} units: pass --ranks N (this unit's ranks)")
            ranks //= selection["unit"]["units"]
    if ranks < 1:
        raise UsageError("--ranks must be at least 1")
    engine = args.engine or _infer_engine(command)
    if engine is None:  # the request names its engine, and a wrong one would mislabel every progress line
        raise UsageError(f"cannot tell the engine of `{' '.join(command[:4])}`: pass --engine, one of the engines "
                         f"this build knows: {', '.join(sorted(ENGINE_ADAPTERS))}")
    model = args.model or _option_value(command, "--model") or _option_value(command, "--model-path") or _served_model(command)
    if model is None and engine == "torch-lm":
        model = f"coldsnap-torch-lm-{_option_value(command, '--size') or 'tiny'}"
    request = {
        "format": 4,
        "operation": "capture",
        "operation_id": args.operation_id or new_operation_id("capture"),
        "engine": engine,
        "snapshot_driver": args.driver,
        "model": {"name": model or command[0], "revision": None},
        # unit K of N: its ranks are K*R .. K*R+R-1 of the activation's (every unit runs --ranks R)
        "units": [{"unit_id": f"unit-{index}", "command": command, "serving_port": port,
                   "env": {**({PRELOAD_ENV: args.preload} if args.preload is not None else {}),
                           **({PLACEMENT_ABI_ENV: str(args.placement_abi)} if args.placement_abi is not None else {})},
                   **({"pass_env": sorted(set(args.env))} if getattr(args, "env", None) else {}),
                   "workers": [{"worker_id": f"worker-{index * ranks + r}", "rank": index * ranks + r, "device_slot": r}
                               for r in range(ranks)]}],
        "artifact": str(Path(args.out).resolve()),
    }
    if selection:
        request["unit"] = selection["unit"] | {"unit_id": f"unit-{index}"}
    if args.graphs:
        request["policy"] = {"graphs": {"mode": args.graphs}}
    return request


def unit_selection(args: argparse.Namespace) -> dict | None:
    """``--units N --unit K --rendezvous ...`` as the request's ``unit`` selection (its ``unit_id`` left for
    the caller) and K, or None without ``--units``; a :class:`UsageError` for an incomplete set."""
    given = [name for name in ("unit", "rendezvous", "rendezvous_token_file", "serve_rendezvous", "address",
                               "rendezvous_timeout")
             if getattr(args, name, None) is not None]
    if getattr(args, "units", None) is None:
        if given:
            raise UsageError(f"--{given[0].replace('_', '-')} is for one unit of several: give --units N and --unit K too")
        return None
    if args.units < 2:
        raise UsageError("--units N is for an activation of 2 or more launch units (one unit needs none of these flags)")
    if args.unit is None or not 0 <= args.unit < args.units:
        raise UsageError(f"--units {args.units} needs --unit K with K in 0..{args.units - 1}")
    if args.rendezvous_token_file is None:
        raise UsageError("--units needs --rendezvous-token-file F: the activation's token, the same on every unit's host")
    rendezvous = args.rendezvous
    if rendezvous is None:
        if args.serve_rendezvous is None:
            raise UsageError("--units needs --rendezvous HOST:PORT (or --serve-rendezvous HOST:PORT on the unit that "
                             "serves the coordinator)")
        host, _, listen_port = args.serve_rendezvous.rpartition(":")
        if host in ("0.0.0.0", "*", "", "[::]") and args.address is None:
            raise UsageError(f"--serve-rendezvous {args.serve_rendezvous} listens on every address: give --address "
                             "(this unit's address the others reach it at) or --rendezvous HOST:PORT")
        rendezvous = f"{args.address or host}:{listen_port}"
    return {"index": args.unit, "unit": {
        "index": args.unit, "units": args.units, "rendezvous": rendezvous,
        "rendezvous_token_file": str(Path(args.rendezvous_token_file).resolve()),
        **({"serve_rendezvous": args.serve_rendezvous} if args.serve_rendezvous else {}),
        **({"address": args.address} if args.address else {}),
        **({"join_timeout_s": args.rendezvous_timeout} if args.rendezvous_timeout else {})}}


def _captured_request(directory: Path) -> dict:
    """The artifact's ``request.json`` (what its capture ran), or a :class:`UsageError` saying in plain
    words why ``directory`` is not an artifact. Admission checks the rest (``admission.artifact``)."""
    if not directory.exists():
        raise UsageError(f"{directory} does not exist")
    if not directory.is_dir():
        raise UsageError(f"{directory} is not a directory: give the artifact directory `coldsnap capture --out` wrote")
    try:
        return json.loads((directory / "request.json").read_text())
    except OSError as exc:
        if not (directory / "artifact.json").exists():
            raise UsageError(f"{directory} is not a coldsnap artifact (no artifact.json): capture one with "
                             f"`coldsnap capture --out {directory} -- CMD ...`") from None
        raise UsageError(f"{directory} is a damaged artifact: its request.json cannot be read "
                         f"({exc.strerror or exc}); capture it again") from None
    except ValueError:
        raise UsageError(f"{directory} is a damaged artifact: its request.json is not JSON; capture it again") from None


def _artifact_request(args: argparse.Namespace, operation: str) -> dict:
    """The request of ``operation`` (restore, warm, wake) on an artifact: its capture's, re-aimed by the flags
    as the restore's fast entry re-aims it (:func:`coldsnap.activation.restore_inputs.aimed_request`)."""
    from coldsnap.activation.restore_inputs import RequestProblem, aimed_request

    directory = Path(args.artifact).resolve()
    captured = _captured_request(directory)
    if getattr(args, "api_key_file", None):
        try:
            read_api_key(Path(args.api_key_file).resolve())  # said now, before anything of the host is touched
        except ApiKeyFileError as exc:
            raise UsageError(f"--api-key-file: {exc}") from None
    try:
        return aimed_request(captured, operation, directory, args.operation_id or new_operation_id(operation), args,
                             unit_selection(args))
    except RequestProblem as exc:
        raise UsageError(str(exc)) from None

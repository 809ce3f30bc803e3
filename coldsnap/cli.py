"""The ``coldsnap`` command line.

Machine-facing output (capabilities, receipts, ``--json``) goes to stdout; everything for people goes
to stderr. Bad input exits with status 2 and one line per problem, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Callable, NoReturn, get_args

from coldsnap import __version__
from coldsnap.contracts.base import ContractError, decode_document, parse_strict_json
from coldsnap.contracts.canonical import canonical_json
from coldsnap.contracts.common import EngineName, SnapshotDriverName
from coldsnap.contracts.placement import PLACEMENT_ABI_ENV, PLACEMENT_ABIS, PRELOAD_ENV
from coldsnap.contracts.profiles import ENGINE_ADAPTERS, resolve_request
from coldsnap.contracts.request import OperationRequest

# Contracts a command needs only for itself (capabilities, artifact and receipt validation, timing
# events) are imported inside it: building pydantic models is most of this CLI's start-up, and a restore
# is timed from its exec.
from coldsnap.operation import EXIT_FAILED, EXIT_OK, EXIT_USAGE, UsageError

__all__ = ["main", "build_parser"]

DESCRIPTION = """\
coldsnap captures an initialized LLM serving process (vLLM, SGLang at TP1) once and restores
it in seconds: CRIU + the CUDA checkpoint driver API for the process, a content-addressed native pack
for the weights.

Managers (Sparkrun, a Kubernetes operator) start with `coldsnap capabilities`; people start with
`coldsnap doctor` to see what this host can do.
"""


def _read_input(path: str) -> bytes:
    if path == "-":
        return sys.stdin.buffer.read()
    with open(path, "rb") as handle:
        return handle.read()


def _cmd_capabilities(args: argparse.Namespace) -> int:
    from coldsnap.contracts.capabilities import build_capabilities

    document = build_capabilities(__version__).to_json_value()
    if args.canonical:
        sys.stdout.buffer.write(canonical_json(document) + b"\n")
    else:
        sys.stdout.write(json.dumps(document, indent=2, sort_keys=True) + "\n")
    return EXIT_OK


def _cmd_version(args: argparse.Namespace) -> int:
    from coldsnap.native import NativeUnavailable, native

    try:
        info = native().build_info()
        extension = f"coldsnap._C built {info.get('built', '?')} with {info.get('compiler', '?')}, CUDA via {info.get('cuda_loading', '?')}"
    except NativeUnavailable as exc:
        extension = str(exc)
    print(f"coldsnap {__version__}")
    print(f"python {sys.version.split()[0]}")
    print(extension)
    return EXIT_OK


def _cmd_doctor(args: argparse.Namespace) -> int:
    from coldsnap.doctor import collect_report, render_table

    report = collect_report()
    if args.json:
        sys.stdout.write(json.dumps(report, indent=2, sort_keys=True) + "\n")
    else:
        sys.stdout.write(render_table(report) + "\n")
    return EXIT_OK


def _validate_request(data: bytes, source: str) -> str:
    request = resolve_request(decode_document(OperationRequest, data, source))
    return f"request format 4, {request.operation} {request.operation_id}, sha256 {request.canonical_sha256()}"


def _validate_model(module: str, name: str, label: str) -> Callable[[bytes, str], str]:
    def validate(data: bytes, source: str) -> str:
        import importlib

        document = decode_document(getattr(importlib.import_module(f"coldsnap.contracts.{module}"), name), data, source)
        return f"{label} format {document.format}, sha256 {document.canonical_sha256()}"

    return validate


def _validate_timing_events(data: bytes, source: str) -> str:
    from coldsnap.contracts.timing_events import MAX_EVENT_BYTES, MAX_EVENTS, TIMING_EVENT_ADAPTER

    problems = []
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    else:
        problems.append("stream does not end with a newline (truncated?)")
    if len(lines) > MAX_EVENTS:
        problems.append(f"{len(lines)} events exceed the cap of {MAX_EVENTS}")
    for number, line in enumerate(lines, 1):
        if len(line) + 1 > MAX_EVENT_BYTES:
            problems.append(f"line {number}: {len(line) + 1} bytes exceed {MAX_EVENT_BYTES}")
            continue
        try:
            event = TIMING_EVENT_ADAPTER.validate_python(parse_strict_json(line), strict=True)
        except ValueError as exc:  # ValidationError is a ValueError
            from pydantic import ValidationError

            from coldsnap.contracts.base import describe_validation_error

            reasons = describe_validation_error(exc) if isinstance(exc, ValidationError) else [str(exc)]
            problems.extend(f"line {number}: {reason}" for reason in reasons)
            continue
        if event.sequence != number - 1:
            problems.append(f"line {number}: sequence {event.sequence}, expected {number - 1}")
        if number == 1 and event.event != "stream_start":
            problems.append("line 1: the stream must begin with stream_start")
    if problems:
        raise ContractError(source, problems)
    return f"timing events format 1, {len(lines)} events"


VALIDATORS: dict[str, Callable[[bytes, str], str]] = {
    "request": _validate_request,
    "artifact": _validate_model("artifact", "ArtifactDescriptor", "artifact"),
    "receipt": _validate_model("receipt", "OperationReceipt", "receipt"),
    "timing-events": _validate_timing_events,
}


def _cmd_validate(args: argparse.Namespace) -> int:
    source = "<stdin>" if args.file == "-" else args.file
    try:
        data = _read_input(args.file)
    except OSError as exc:
        print(f"{source}: cannot read: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        summary = VALIDATORS[args.kind](data, source)
    except ContractError as exc:
        for problem in exc.problems:
            print(f"{source}: {problem}", file=sys.stderr)
        return EXIT_USAGE
    print(f"{source}: valid {summary}")
    return EXIT_OK


def _cmd_payload_verify(args: argparse.Namespace) -> int:
    from coldsnap.payload.errors import PackDigestMismatch, PackError
    from coldsnap.payload.validation import verify_file

    try:
        result = verify_file(args.file, args.expected)
    except PackDigestMismatch as exc:
        if args.json:
            rejected = {"file": args.file, "expected_sha256": exc.expected, "sha256": exc.actual, "verdict": "rejected"}
            sys.stdout.write(json.dumps(rejected, sort_keys=True) + "\n")
        print(exc, file=sys.stderr)
        return EXIT_FAILED
    except PackError as exc:
        print(exc, file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        document = {
            "file": args.file,
            "sha256": result.sha256,
            "size_bytes": result.size_bytes,
            "method": result.method,
            "seconds": round(result.seconds, 6),
            "verdict": "valid",
        }
        sys.stdout.write(json.dumps(document, sort_keys=True) + "\n")
    else:
        print(f"{args.file}: valid, sha256 {result.sha256}, {result.size_bytes} bytes ({result.method}, {result.seconds:.3f} s)")
    return EXIT_OK


PAYLOAD_VERIFY_DESCRIPTION = """\
Verify that FILE holds the bytes its name promises: a native pack `<sha256>.pack` or residual
`<sha256>.residual` (or any file, with --expected). It is the verifier the library itself uses
(coldsnap.payload.validation.verify_file).

Trust rule: after a full hash matches, the verdict is recorded in `.coldsnap-validation.json` next to
FILE, bound to the file's (st_dev, st_ino, size, mtime_ns, ctime_ns). A later verify trusts that record
only while all five are unchanged (and the file had not changed within 50 ms before that hash);
otherwise it hashes FILE in full again and refreshes or removes the record. The method printed says
which happened: `record` or `full-hash`.

Exit status: 0 valid; 1 verified and rejected (digest mismatch); 2 usage error (missing or unreadable
file, a name that is not <sha256>.pack/.residual without --expected, a malformed --expected).
"""


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


def _port_argument(text: str) -> int:
    """argparse's type for a port option: 1–65535, else argparse's one-line error."""
    try:
        return port_number(text, "a port")
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"want a whole number, not {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"want at least 1, not {value}")
    return value


def port_number(text: str | int, what: str = "the serving port") -> int:
    """``text`` as a TCP port (1–65535), or a :class:`UsageError` saying what was wrong."""
    try:
        port = int(text)
    except ValueError:
        raise UsageError(f"{what} must be a number from 1 to 65535, not {text!r}") from None
    if not 1 <= port <= 65535:
        raise UsageError(f"{what} must be from 1 to 65535, not {port}")
    return port


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


# How serving commands spell their tensor-parallel size (torch_lm and SGLang --tp, vLLM -tp, ...).
TP_OPTIONS = ("--tp", "--tensor-parallel-size", "-tp", "--tp-size")


def _capture_request(args: argparse.Namespace) -> dict:
    """The request format 4 document the friendly flags stand for."""
    if not args.out:
        raise UsageError("--out DIR is required (or give --request-json)")
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise UsageError("give the serving command after --, e.g. coldsnap capture --out DIR -- vllm serve MODEL ...")
    given_port = args.port if args.port is not None else _option_value(command, "--port")
    if given_port is None:
        raise UsageError("cannot tell the serving port: pass --port P (or give the command a --port option)")
    port = port_number(given_port, "--port" if args.port is not None else "the command's --port")
    ranks = args.ranks
    if ranks is None:
        given = next((v for v in (_option_value(command, o) for o in TP_OPTIONS) if v is not None), "1")
        try:
            ranks = int(given)
        except ValueError:
            raise UsageError(f"cannot tell the number of ranks from {given!r}: pass --ranks N") from None
    if ranks < 1:
        raise UsageError("--ranks must be at least 1")
    engine = args.engine or _infer_engine(command)
    if engine is None:  # the request names its engine, and a wrong one would mislabel every progress line
        raise UsageError(f"cannot tell the engine of `{' '.join(command[:4])}`: pass --engine, one of the engines "
                         f"this build knows: {', '.join(sorted(ENGINE_ADAPTERS))}")
    model = args.model or _option_value(command, "--model") or _option_value(command, "--model-path") or _served_model(command)
    if model is None and engine == "torch-lm":
        model = f"coldsnap-torch-lm-{_option_value(command, '--size') or 'tiny'}"
    return {
        "format": 4,
        "operation": "capture",
        "operation_id": args.operation_id or new_operation_id("capture"),
        "engine": engine,
        "snapshot_driver": args.driver,
        "model": {"name": model or command[0], "revision": None},
        "units": [{"unit_id": "unit-0", "command": command, "serving_port": port,
                   "env": {**({PRELOAD_ENV: args.preload} if args.preload is not None else {}),
                           **({PLACEMENT_ABI_ENV: str(args.placement_abi)} if args.placement_abi is not None else {})},
                   "workers": [{"worker_id": f"worker-{r}", "rank": r, "device_slot": r} for r in range(ranks)]}],
        "artifact": str(Path(args.out).resolve()),
    }


def new_operation_id(operation: str) -> str:
    """``OPERATION-<local time>-<pid>``: two operations started in the same second (a race, a retry loop)
    still have ids of their own."""
    return f"{time.strftime(f'{operation}-%Y%m%dT%H%M%S')}-{os.getpid()}"


def capture_request(arguments: list[str]) -> dict:
    """The request document ``coldsnap capture ARGUMENTS`` would run (flags, ``--`` and the command), for a
    caller that adds to it what no flag says (a policy) before sending it with ``--request-json``."""
    return _capture_request(build_parser().parse_args(["capture", *arguments]))


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
    """The request of ``operation`` (restore, warm, wake) on an artifact: its capture's, re-aimed."""
    directory = Path(args.artifact).resolve()
    captured = _captured_request(directory)
    captured.update(operation=operation, operation_id=args.operation_id or new_operation_id(operation),
                    artifact=str(directory))
    captured.pop("owner", None)  # the capture's caller's: this operation's owner is its own caller's
    if operation == "restore":
        captured["prepare_only"] = args.prepare_only
        unit = (captured.get("units") or [{}])[0]
        if args.port is not None:
            unit["serving_port"] = args.port
        if args.gpu is not None:
            unit.setdefault("env", {})["CUDA_VISIBLE_DEVICES"] = args.gpu
    if operation == "warm" and args.ttl is not None:
        captured["standby_ttl_s"] = args.ttl
    if args.weights:
        policy = captured.setdefault("policy", {})
        policy.setdefault("weights", {})["mode"] = args.weights
    return captured


def _run_lifecycle(args: argparse.Namespace, build: Callable[[argparse.Namespace], dict], operation: str) -> int:
    from coldsnap.operation import OperationFailed, run_operation, terminate_as_interrupt

    perform: Callable[[Any], Any]
    if operation == "capture":
        from coldsnap.activation.lifecycle import capture as perform
    elif operation == "restore":
        from coldsnap.activation.lifecycle import restore as perform
    elif operation == "warm":
        from coldsnap.activation.lifecycle import warm as perform
    else:
        from coldsnap.activation.lifecycle import wake as perform

    terminate_as_interrupt()
    try:
        if args.request_json:
            source = "<stdin>" if args.request_json == "-" else args.request_json
            data = _read_input(args.request_json)
        else:
            source, data = "flags", json.dumps(build(args)).encode()
    except UsageError as exc:
        print(f"coldsnap {operation}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:
        print(f"coldsnap {operation}: {args.request_json}: cannot read: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_USAGE

    def body(context):
        if context.request.operation != operation:
            raise OperationFailed("request.operation", f"`coldsnap {operation}` got a {context.request.operation} request")
        return perform(context)

    return run_operation(data, source, body, args.receipt_json, args.timing_events, owner=args.owner)


def _parse_owner_flag(args: argparse.Namespace, command: str) -> bool:
    """``--owner UID:GID`` parsed in place (:func:`coldsnap.ownership.parse_owner`); False, with the one line
    saying why, when it is malformed."""
    from coldsnap.ownership import OwnerError, parse_owner

    try:
        args.owner = parse_owner(args.owner) if args.owner is not None else None
    except OwnerError as exc:
        print(f"coldsnap {command}: {exc}", file=sys.stderr)
        return False
    return True


def _cmd_capture(args: argparse.Namespace) -> int:
    if not _parse_owner_flag(args, "capture"):
        return EXIT_USAGE
    if args.no_verify:
        from coldsnap.activation.capture_steps import VERIFY_ENV

        os.environ[VERIFY_ENV] = "0"
    return _run_lifecycle(args, _capture_request, "capture")


def _use_state_dir(args: argparse.Namespace) -> None:
    if args.state_dir:
        from coldsnap.activation.artifact_dir import STATE_DIR_ENV

        os.environ[STATE_DIR_ENV] = os.path.abspath(args.state_dir)


def _cmd_artifact_operation(args: argparse.Namespace) -> int:
    """restore, warm and wake: an artifact directory (wake: or a standby id), or a strict request."""
    if not _parse_owner_flag(args, args.operation):
        return EXIT_USAGE
    if not args.request_json and not args.artifact:
        print("coldsnap: give the artifact directory (or --request-json)", file=sys.stderr)
        return EXIT_USAGE
    _use_state_dir(args)
    if getattr(args, "host_thp", False):
        from coldsnap.snapshot.thp import HOST_THP_ENV

        os.environ[HOST_THP_ENV] = "always"
    if args.artifact and args.artifact.startswith("oci://") and not args.request_json:
        if args.operation == "wake":
            print("coldsnap wake: wake takes the artifact directory or standby id a warm used, not oci://", file=sys.stderr)
            return EXIT_USAGE
        from coldsnap.activation.artifact_dir import state_root
        from coldsnap.registry.commands import OciPullFailed, pull_into_cache

        try:  # before anything of the host is touched: a failed pull changes nothing but the cache
            args.artifact = str(pull_into_cache(args.artifact, state_root() / "oci", args.operation, args.owner))
        except OciPullFailed as exc:
            print(f"coldsnap {args.operation}: {exc}", file=sys.stderr)
            return EXIT_USAGE if exc.usage else EXIT_FAILED
    if args.operation == "wake" and args.artifact and not args.request_json:
        from coldsnap.activation.standby import standby_artifact

        try:
            args.artifact = str(standby_artifact(args.artifact))
        except ValueError as exc:
            print(f"coldsnap wake: {exc}", file=sys.stderr)
            return EXIT_USAGE
    return _run_lifecycle(args, lambda a: _artifact_request(a, args.operation), args.operation)


def _cmd_publish(args: argparse.Namespace) -> int:
    from coldsnap.registry.commands import run_publish

    return run_publish(args.artifact, args.reference, args.json)


def _cmd_pull(args: argparse.Namespace) -> int:
    from coldsnap.registry.commands import run_pull

    return run_pull(args.reference, args.directory, args.json, args.owner)


def _cmd_status(args: argparse.Namespace) -> int:
    _use_state_dir(args)
    from coldsnap.activation.artifact_dir import state_root
    from coldsnap.activation.standby import list_standbys

    standbys = list_standbys()
    now = time.time_ns()
    rows = [{"standby_id": r.standby_id, "state": state, "pid": r.pid, "serving_port": r.serving_port,
             "artifact": r.artifact, "warmed_by": r.operation_id, "age_s": round((now - r.warmed_unix_ns) / 1e9, 1),
             "ttl_s": r.ttl_s} for r, state in standbys]
    if args.json:
        sys.stdout.write(json.dumps({"state_root": str(state_root()), "standbys": rows}, indent=2) + "\n")
        return EXIT_OK
    if not rows:
        print(f"no warm standbys (state directory {state_root()})")
        return EXIT_OK
    print(f"{'STANDBY':<17} {'STATE':<10} {'PID':>7} {'PORT':>5} {'AGE s':>8} {'TTL s':>6}  ARTIFACT")
    for row in rows:
        print(f"{row['standby_id']:<17} {row['state']:<10} {row['pid']:>7} {row['serving_port'] or '-':>5} "
              f"{row['age_s']:>8.1f} {row['ttl_s'] or '-':>6}  {row['artifact']}")
    return EXIT_OK


def _cmd_demo(args: argparse.Namespace) -> int:
    import os

    from coldsnap.demo import render_demo, run_demo

    if os.geteuid() != 0:
        print("coldsnap demo: CRIU needs root; run it as root (or in a privileged container)", file=sys.stderr)
        return EXIT_USAGE
    import importlib.util

    if args.engine == "torch-lm" and importlib.util.find_spec("torch") is None:  # the reference workload needs it
        print("coldsnap demo: the reference workload needs torch (pip install torch)", file=sys.stderr)
        return EXIT_USAGE
    if args.tp < 1 or (args.tp > 1 and args.engine != "torch-lm"):
        print("coldsnap demo: --tp N (N >= 1) runs the reference workload (--engine torch-lm)", file=sys.stderr)
        return EXIT_USAGE
    if args.engine == "vllm" and args.device != "cpu":
        print("coldsnap demo: --engine vllm runs vLLM's CPU build (--device cpu)", file=sys.stderr)
        return EXIT_USAGE
    if args.engine == "sglang" and (args.device != "cuda" or importlib.util.find_spec("sglang") is None):
        print("coldsnap demo: --engine sglang runs SGLang on a GPU (--device cuda; pip install coldsnap[sglang])",
              file=sys.stderr)
        return EXIT_USAGE
    try:
        result = run_demo(args.size, args.device, Path(args.dir) if args.dir else None, quiet=not args.verbose,
                          engine=args.engine, eager=not args.compile, tp=args.tp)
    except RuntimeError as exc:
        print(f"coldsnap demo: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if args.json:
        sys.stdout.write(json.dumps(result, indent=2, sort_keys=True) + "\n")
    else:
        print(render_demo(result))
    return EXIT_OK if result["same_tokens_as_cold_start"] else EXIT_FAILED


def _cmd_coordinator(args: argparse.Namespace) -> int:
    import logging

    try:
        token = Path(args.token_file).read_bytes().strip()
    except OSError as exc:
        print(f"coldsnap coordinator: --token-file {args.token_file}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        from coldsnap.coord import Coordinator
    except ImportError:
        print("coldsnap coordinator: needs pyzmq (pip install pyzmq)", file=sys.stderr)
        return EXIT_USAGE
    logging.basicConfig(level=logging.INFO, format="coldsnap coordinator: %(message)s", stream=sys.stderr)
    try:
        coordinator = Coordinator(args.listen, token, args.ranks, args.ttl,
                                  Path(args.endpoint_file) if args.endpoint_file else None)
    except (ValueError, OSError) as exc:
        print(f"coldsnap coordinator: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(f"coldsnap coordinator: listening on {coordinator.endpoint} for {args.ranks} ranks", file=sys.stderr)
    reason = coordinator.serve()
    print(f"coldsnap coordinator: done ({reason}); {coordinator.rejected} frames rejected", file=sys.stderr)
    return EXIT_OK if reason == "complete" else EXIT_FAILED


def _add_operation_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--request-json", metavar="PATH|-", help="strict request (format 4) instead of the friendly flags; - for stdin")
    p.add_argument("--receipt-json", metavar="PATH|-", help="write the one receipt (format 2) here; - for stdout (progress stays on stderr)")
    p.add_argument("--timing-events", metavar="PATH|-", help="live NDJSON timing events (needs --receipt-json); a new absolute path or -")
    p.add_argument("--operation-id", help="operation identity echoed in the receipt (default: "
                   "OPERATION-<local time>-<pid>, e.g. restore-20261202T090450-3850)")
    _add_owner_flag(p)


def _add_owner_flag(p: argparse.ArgumentParser) -> None:
    """``--owner UID:GID`` (a command that writes artifacts or state as root: the lifecycle operations,
    publish, pull); :func:`coldsnap.ownership.resolve_owner` takes its value."""
    p.add_argument("--owner", metavar="UID:GID", help="who gets every file and directory this writes under the "
                   "artifact directory and the state directory, modes kept, failures included (default: the "
                   "request's owner, else SUDO_UID:SUDO_GID under sudo, else they stay root's)")


def _add_weights_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--weights", choices=["auto", "native", "recovery"], metavar="MODE",
                   help="where the weights come from: auto (the native pack, else — missing or failing verification — "
                   "the safetensors the capture pinned, with a warning), native (the pack or nothing), recovery (the "
                   "pinned safetensors, replayed into the captured layout); default: the capture's policy (auto)")


def _add_host_thp_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host-thp", action="store_true",
                   help="switch this HOST's transparent huge pages to `always` while CRIU fills the restored memory "
                   "(faster fill: CRIU 4.2 fills 4 KiB pages otherwise), then back to the mode it found (the last "
                   "of concurrent restores puts it back). Every process on the host allocating meanwhile gets huge "
                   "pages too: the host owner's call. Needs root. Same as COLDSNAP_HOST_THP=always")


def _add_state_dir_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--state-dir", metavar="STATE",
                   help="where restores write (STATE/<artifact id>/port-<P>/logs/<unit>.log is the log of the "
                   "server restored on port P, STATE/<artifact id>/standby.json a warm standby's record); default "
                   "$COLDSNAP_STATE_DIR, else $XDG_RUNTIME_DIR/coldsnap, else /run/coldsnap (root) or /tmp/coldsnap-<uid>")


class CommandParser(argparse.ArgumentParser):
    """argparse with a bad argument reported in one line and a pointer to ``--help``, not the whole usage
    block before it; exit status 2 as argparse's own. Subcommands' parsers are of this class too
    (``add_subparsers`` makes them of the parent's class)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\nsee {self.prog} --help\n")


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="coldsnap", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"coldsnap {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = commands.add_parser(
        "capabilities",
        help="print the static capabilities JSON (formats, engines, snapshot drivers, features)",
        description="Print what this build accepts and drives, as JSON on stdout: request/artifact/receipt/"
        "timing-event formats, the engine adapters it drives and their native materialization modes, the "
        "snapshot drivers it implements with their minimum NVIDIA driver, the operations it runs with their "
        "replay semantics, and features. Only what is built is listed; a request naming anything else is "
        "refused (code request.unsupported). It is a static contract: `coldsnap doctor` says what this host "
        "can actually do.",
    )
    p.add_argument("--canonical", action="store_true", help="canonical JSON (sorted keys, no whitespace) instead of indented")
    p.set_defaults(func=_cmd_capabilities)

    p = commands.add_parser("version", help="print the coldsnap, Python and native extension versions",
                            description="Print the coldsnap version, the Python it runs on, and how the native "
                            "extension coldsnap._C was built (or why it does not load).")
    p.set_defaults(func=_cmd_version)

    p = commands.add_parser(
        "doctor",
        help="check this host: CRIU, NVIDIA driver, CUDA checkpoint API, GPUs",
        description="Report what this host can do: the CRIU coldsnap would use (COLDSNAP_CRIU or PATH), its "
        "version and `criu check` verdict (needs root), the NVIDIA driver, the CUDA driver API with the "
        "checkpoint and VMM entry points, the GPUs, and which of the snapshot drivers this build implements "
        "are usable. Always exits 0 when it could look; read the verdicts.",
    )
    p.add_argument("--json", action="store_true", help="machine-readable JSON on stdout instead of a table")
    p.set_defaults(func=_cmd_doctor)

    p = commands.add_parser(
        "validate",
        help="strictly validate a request, artifact descriptor, receipt or timing-event stream",
        description="Strictly decode FILE ('-' for stdin) as the given contract. Exit 0 and one summary line "
        "when valid; exit 2 with one line per problem on stderr otherwise (unknown field, wrong format "
        "number, missing field, wrong type, duplicate key, not JSON).",
    )
    p.add_argument("kind", choices=sorted(VALIDATORS), help="which contract FILE holds")
    p.add_argument("file", metavar="FILE", help="path of the document, or - for stdin")
    p.set_defaults(func=_cmd_validate)

    p = commands.add_parser(
        "payload",
        help="native payload packs: verify a pack or residual against its content digest",
        description="Native payload packs: content-addressed files (<sha256>.pack, <sha256>.residual) of preserved "
        "GPU bytes. `payload verify` checks one against its SHA-256, trusting the directory's "
        ".coldsnap-validation.json only while the file's (st_dev, st_ino, size, mtime_ns, ctime_ns) is unchanged "
        "since its last full hash (see `payload verify --help`).",
    )
    payload = p.add_subparsers(dest="payload_command", metavar="SUBCOMMAND", required=True)
    p = payload.add_parser(
        "verify",
        help="check a pack's bytes against its SHA-256 (trusting an unchanged validation record)",
        description=PAYLOAD_VERIFY_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("file", metavar="FILE", help="the pack or residual file")
    p.add_argument("--expected", metavar="SHA256", help="expected SHA-256 (default: the one in FILE's name)")
    p.add_argument("--json", action="store_true",
                   help="one JSON object on stdout: file, sha256, size_bytes, method, seconds, verdict")
    p.set_defaults(func=_cmd_payload_verify)
    p = commands.add_parser(
        "capture",
        help="start a serving command, validate it, and capture it into an artifact directory",
        description="Start CMD (without io_uring, in its own session, output to DIR/logs), wait for coldsnap's "
        "in-process agent and the HTTP port, record the canary (greedy, through POST /v1/completions), let the "
        "agent write the native packs and release model memory, CRIU-dump the process tree, restore it once "
        "(as `coldsnap restore DIR` would) and check the canary again, then commit DIR/artifact.json atomically: a "
        "capsule that cannot restore is never committed. A tensor-parallel command (--ranks N, or its own --tp / "
        "--tensor-parallel-size) is captured with one agent per rank; their NCCL communicators are torn "
        "down through a coordinator before the dump and rebuilt at restore. With --driver n580 the image is instead "
        "CMD's launcher stopped before the engine starts (a pre-CUDA template); the capture then restores and places it "
        "once to record the canary and write the native pack. Nothing of CMD is left running; a failure commits nothing. "
        "Exit 0 on success, 1 on a failed capture, 2 for bad input.",
    )
    p.add_argument("--out", help="artifact directory (must not hold a committed artifact)")
    p.add_argument("--port", type=_port_argument, help="serving port (default: the command's --port)")
    # The contract's names stay choices, so that one this build lacks is refused by name (request.unsupported).
    p.add_argument("--engine", choices=get_args(EngineName), help="engine adapter (default: from the command when it "
                   "runs vllm, sglang or coldsnap.workloads.torch_lm; needed otherwise; implemented in this build: "
                   f"{', '.join(sorted(ENGINE_ADAPTERS))})")
    p.add_argument("--driver", choices=get_args(SnapshotDriverName), default="n610",
                   help="snapshot driver: n610 (default) captures the initialized serving process, CUDA state "
                   "included (NVIDIA driver 610+); n580 captures a template launcher stopped before the engine "
                   "touches CUDA (driver 580+, portable across drivers and GPUs; the engine starts again, with "
                   "the native pack hydrated at load time, on every restore)")
    p.add_argument("--preload", metavar="MOD,MOD", help="--driver n580: the modules the template imports before "
                   "its pre-CUDA boundary (default per engine, e.g. torch-lm: "
                   f"{','.join(ENGINE_ADAPTERS['torch-lm'].template_preload)}; vLLM: "
                   f"{','.join(ENGINE_ADAPTERS['vllm'].template_preload)}); none may open an NVIDIA device, and at "
                   "placement ABI 2 none may load the NVIDIA driver (a CUDA torch does: '' or --placement-abi 1)")
    p.add_argument("--placement-abi", type=int, choices=PLACEMENT_ABIS, help="--driver n580: 2 (default) — the "
                   "template holds no NVIDIA userspace driver and restores under any driver 580+; 1 — it may map the "
                   "driver's libraries (a preloaded CUDA torch does) and restores under this driver version only")
    p.add_argument("--model", help="model name recorded in the artifact (default: from the command)")
    p.add_argument("--ranks", type=int, metavar="N",
                   help="tensor-parallel ranks, one worker each (default: the command's --tp / "
                   "--tensor-parallel-size / --tp-size, else 1)")
    p.add_argument("--no-verify", action="store_true",
                   help="commit without the capture's own restore of the capsule (COLDSNAP_CAPTURE_VERIFY=0); saves "
                   "one restore's time, and a capsule that cannot restore is then found out by its first restore")
    _add_operation_flags(p)
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD ...", help="the serving command")
    p.set_defaults(func=_cmd_capture)

    p = commands.add_parser(
        "restore",
        help="restore a captured artifact: admission, CRIU restore, hydration, canary",
        description="Admit the artifact (descriptor, platform, CRIU check, capsule, the host files the tree maps, "
        "native packs, the serving port and its lock — a concurrent restore, warm, wake or capture of the port "
        "is refused naming it —, room on every GPU it goes to) and, unless --prepare-only, restore the process tree while the payload is prefetched, let the agent map and "
        "hydrate the weights and zero the KV cache, and require the canary to give the captured tokens exactly. "
        "On failure everything restored is killed. A restore writes nothing inside DIR (it may be read-only, "
        "moved or a copy): the restored server's log, CRIU's files and validation records go to the state "
        "directory. Every restore is a replica of its own: it serves on --port (its tree's socket ports moved by "
        "one shift in a per-restore copy of the socket image, every bind probed first), in pid namespaces of its "
        "own, so one capsule restores several times at once, each on its own port and GPU. An n580 artifact (a "
        "pre-CUDA template) is restored, handed its placement (--port, --gpu, the native pack to load) and the "
        "engine's own startup runs in it before the canary. Exit 0 when serving, 1 on a failed restore, 2 for bad "
        "input.",
    )
    p.add_argument("artifact", nargs="?", metavar="DIR", help="artifact directory written by coldsnap capture, or "
                   "oci://REF: pulled (verified) into STATE/oci/ first, before anything else")
    p.add_argument("--prepare-only", action="store_true", help="admission only: check everything, start nothing")
    p.add_argument("--port", type=_port_argument, metavar="P", help="serve on port P (default: the captured port); the "
                   "tree's other bound ports move by the same shift")
    p.add_argument("--gpu", metavar="N[,M...]", help="the GPU(s) to place the ranks on, in rank order "
                   "(CUDA_VISIBLE_DEVICES of this host: ordinals or UUIDs; default: the capture's)")
    _add_weights_flag(p)
    _add_host_thp_flag(p)
    _add_state_dir_flag(p)
    _add_operation_flags(p)
    p.set_defaults(func=_cmd_artifact_operation, operation="restore")

    p = commands.add_parser(
        "warm",
        help="restore an artifact ahead of demand into a warm standby that does not serve yet",
        description="Run restore's admission and its steps up to the CUDA restore (the tree restored, CUDA state "
        "back on this host's GPUs, NCCL rebuilt), then park it: no weights and no KV cache on the GPU, the serving "
        "port bound but answering nothing until `coldsnap wake`, the native pack read into the page cache. The "
        "standby is recorded under the state directory (`coldsnap status` lists it) and stops itself, leaving "
        "nothing behind, when no wake came within --ttl. One standby per artifact: warming a warm artifact "
        "succeeds without a second one. Exit 0 when parked, 1 on failure (nothing is left running), 2 for bad input.",
    )
    p.add_argument("artifact", nargs="?", metavar="DIR", help="artifact directory written by coldsnap capture, or "
                   "oci://REF: pulled (verified) into STATE/oci/ first")
    p.add_argument("--ttl", type=_positive_int, metavar="SECONDS",
                   help="how long the standby waits for a wake before it stops itself (default 3600)")
    _add_weights_flag(p)
    _add_host_thp_flag(p)
    _add_state_dir_flag(p)
    _add_operation_flags(p)
    p.set_defaults(func=_cmd_artifact_operation, operation="warm")

    p = commands.add_parser(
        "wake",
        help="make a warm standby serve: hydrate its weights, zero its KV cache, check the canary",
        description="Take the warm standby of DIR (or of the standby ID `coldsnap status` shows): every rank maps "
        "and hydrates its weights from the native pack (or the pinned safetensors, by --weights), zeroes its KV "
        "cache and recaptures dropped CUDA graphs; the canary must give the captured tokens exactly. Then the "
        "standby is the serving process. A failed wake stops the standby. On a GPU the weights come from the "
        "pack the standby pinned at warm, and a plain `coldsnap wake DIR|ID` asks the standby to start filling "
        "them before anything else (they are released again if no resume takes them). Exit 0 when serving, 1 "
        "on a failed wake (or no standby: code wake.standby), 2 for bad input.",
    )
    p.add_argument("artifact", nargs="?", metavar="DIR|ID", help="artifact directory, or a standby id from coldsnap status")
    _add_weights_flag(p)
    _add_state_dir_flag(p)
    _add_operation_flags(p)
    p.set_defaults(func=_cmd_artifact_operation, operation="wake")

    p = commands.add_parser(
        "status",
        help="list the warm standbys on this host",
        description="List the live warm standbys under the state directory: id, what their agents say "
        "(standby), root pid, serving port, age, deadline and artifact. Records of standbys that are gone "
        "(killed, expired) are removed on the way. Exit 0.",
    )
    p.add_argument("--json", action="store_true", help="machine-readable JSON on stdout")
    _add_state_dir_flag(p)
    p.set_defaults(func=_cmd_status)

    p = commands.add_parser(
        "demo",
        help="cold start vs restore of a serving process on this machine, phase by phase",
        description="Start a server plainly and time process start → first token; capture it; restore it and "
        "time restore start → first validated token; check that a further prompt gets the cold start's tokens; "
        "print the phases of both. --engine torch-lm (default): the reference workload "
        "(coldsnap.workloads.torch_lm; needs torch). --engine vllm: `vllm serve` of a tiny Llama built on the "
        "spot, on vLLM's CPU build (installed into .venv-vllm the first time, a few minutes), cold start with "
        "vLLM's own loader against the restore of `--load-format coldsnap`. --engine sglang --device cuda: "
        "`python -m sglang.launch_server` of a tiny Llama (SGLang installed in this Python; a GPU), SGLang's "
        "own loader against the restore of `--load-format coldsnap`. Needs root (CRIU).",
    )
    p.add_argument("--engine", choices=["torch-lm", "vllm", "sglang"], default="torch-lm",
                   help="what to serve (default torch-lm)")
    p.add_argument("--compile", action="store_true", help="vllm: keep torch.compile on (default --enforce-eager)")
    p.add_argument("--size", choices=["tiny", "1b", "8b"], default="tiny", help="workload size (default tiny)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--tp", type=_positive_int, default=1, metavar="N",
                   help="torch-lm: tensor-parallel ranks (one GPU each with --device cuda; default 1)")
    p.add_argument("--dir", help="where to keep the model, artifact and receipts (default: a temporary directory, "
                   "removed at the end)")
    p.add_argument("--json", action="store_true", help="the figures as JSON on stdout")
    p.add_argument("--verbose", action="store_true", help="show capture and restore progress")
    p.set_defaults(func=_cmd_demo)

    p = commands.add_parser(
        "publish",
        help="push an artifact to an OCI registry: capsules, packs and descriptor, each by digest",
        description="Push the artifact in DIR to REF (REGISTRY/REPOSITORY[:TAG]) as OCI artifacts: each worker's "
        "native pack as its own artifact (blob digest = the pack's SHA-256, so one pack serves every capture that "
        "uses it), each unit's capsule (config capsule.json, the CRIU images as layers, digests bound to the "
        "capsule), the descriptor (artifact.json, request.json, logs), and one image index over them, tagged TAG. "
        "Every file is checked against its bound digest first; blobs and manifests the registry has are not sent "
        "again (a second publish sends only the index); blobs go up in parallel. Prints the pinned reference "
        "REGISTRY/REPOSITORY[:TAG]@sha256:DIGEST (what `pull` and `restore oci://` take). Credentials: "
        "$REGISTRY_AUTH_FILE, $XDG_RUNTIME_DIR/containers/auth.json, ~/.config/containers/auth.json, "
        "~/.docker/config.json (credHelpers, credsStore); TLS CAs: /etc/containers/certs.d/REGISTRY/*.crt or "
        "$SSL_CERT_FILE; plain HTTP only for registries in $COLDSNAP_PLAIN_HTTP_REGISTRIES. Exit 0 published, "
        "1 failed (registry, credentials, a damaged artifact), 2 bad input.",
    )
    p.add_argument("artifact", metavar="DIR", help="artifact directory written by coldsnap capture")
    p.add_argument("reference", metavar="REF", help="REGISTRY/REPOSITORY[:TAG] (oci:// optional)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout: reference, digest, what was sent")
    p.set_defaults(func=_cmd_publish)

    p = commands.add_parser(
        "pull",
        help="fetch a published artifact into a directory, every blob verified, atomically, resumable",
        description="Fetch the artifact REF names (REGISTRY/REPOSITORY:TAG or @sha256:DIGEST, oci:// optional) into "
        "DIR: the index, then every manifest and blob by digest, each blob's SHA-256 checked while it streams, "
        "large blobs in parallel byte ranges. Files land in .DIR.coldsnap-pull beside DIR and are renamed to DIR "
        "only when all match and the descriptor binds exactly them; an interrupted pull run again fetches only "
        "what is missing. Validation records are written as files arrive, so the first restore does not hash the "
        "pack again. A DIR that already holds the same artifact is left as it is. `coldsnap restore oci://REF` "
        "and `warm oci://REF` pull into STATE/oci/ the same way first. Credentials and TLS as for publish. Exit 0 "
        "pulled, 1 failed, 2 bad input (a bad reference, DIR holding something else).",
    )
    p.add_argument("reference", metavar="REF", help="REGISTRY/REPOSITORY[:TAG][@sha256:DIGEST] (oci:// optional)")
    p.add_argument("directory", metavar="DIR", help="where the artifact goes (must not exist, or hold the same one)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout: directory, digest, what was fetched")
    _add_owner_flag(p)
    p.set_defaults(func=_cmd_pull)

    p = commands.add_parser(
        "coordinator",
        help="run the CSKV coordinator of one activation (authenticated barriers and small key/value)",
        description="Serve barriers and small key/value (<= 64 KiB) to the N ranks of one activation over ZeroMQ. "
        "Every frame is authenticated with HMAC-SHA256 keyed by the token and sequenced per connection; "
        "anything else is dropped and logged. Ends when every rank said BYE (exit 0) or the TTL runs out (exit 1).",
    )
    p.add_argument("--listen", required=True, metavar="HOST:PORT", help="where to listen; port 0 picks a free one")
    p.add_argument("--token-file", required=True, metavar="F", help="file holding the activation token (>= 16 bytes)")
    p.add_argument("--ranks", required=True, type=_positive_int, metavar="N", help="number of ranks of the activation")
    p.add_argument("--ttl", type=float, default=600.0, metavar="SECONDS", help="lifetime limit (default 600)")
    p.add_argument("--endpoint-file", metavar="PATH", help="write the chosen endpoint here, atomically (JSON)")
    p.set_defaults(func=_cmd_coordinator)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
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
    status = main()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except OSError:  # a reader that went away (`| head`): nothing left to tell it
            pass
    os._exit(status)


if __name__ == "__main__":
    run()

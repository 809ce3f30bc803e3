"""What each ``coldsnap`` command does once its arguments are parsed (:mod:`coldsnap.cli.parser` maps
the commands to these)."""

from __future__ import annotations


import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

from coldsnap import __version__
from coldsnap.contracts.base import ContractError, decode_document, parse_strict_json
from coldsnap.contracts.canonical import canonical_json
from coldsnap.contracts.profiles import resolve_request
from coldsnap.contracts.request import OperationRequest

# Contracts a command needs only for itself (capabilities, artifact and receipt validation, timing
# events) are imported inside it: building pydantic models is most of this CLI's start-up, and a restore
# is timed from its exec.
from coldsnap.cli.requests import _artifact_request, _capture_request
from coldsnap.operation import EXIT_FAILED, EXIT_OK, EXIT_USAGE, UsageError
from coldsnap.settings import SETTINGS



def _read_input(path: str) -> bytes:
    if path == "-":
        return sys.stdin.buffer.read()
    with open(path, "rb") as handle:
        return handle.read()


def _cmd_capabilities(args: argparse.Namespace) -> int:
    from coldsnap.contracts.capabilities import build_capabilities
    from coldsnap.provider.client import provider_status

    document = build_capabilities(__version__, provider_status()).to_json_value()
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
    if args.kind == "secrets":
        return _validate_secrets(args)
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


def _validate_secrets(args: argparse.Namespace) -> int:
    from coldsnap.secrets.gate import secrets_of_artifact
    from coldsnap.secrets.scan import ScannerMissing

    root = Path(args.file)
    if not (root / "artifact.json").is_file():
        print(f"coldsnap validate secrets: {args.file} is not an artifact directory (no artifact.json)", file=sys.stderr)
        return EXIT_USAGE
    try:
        found = secrets_of_artifact(root, include_packs=args.include_packs)
    except ContractError as exc:
        for problem in exc.problems:
            print(f"coldsnap validate secrets: {problem}", file=sys.stderr)
        return EXIT_USAGE
    except ScannerMissing as exc:
        print(f"coldsnap validate secrets: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except OSError as exc:
        print(f"coldsnap validate secrets: {exc.filename or args.file}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_FAILED
    if args.json:
        document = {**found.report.as_json(), "held": found.held, "unrecorded_units": found.unrecorded,
                    "clean": found.clean}
        sys.stdout.write(json.dumps(document, indent=2) + "\n")
    for line in found.lines():
        print(f"{args.file}: {line}", file=sys.stderr)
    print(f"{args.file}: {found.summary()}" + ("" if found.clean else ": NOT clean"), file=sys.stderr)
    return EXIT_OK if found.clean else EXIT_FAILED


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


def _run_lifecycle(args: argparse.Namespace, build: Callable[[argparse.Namespace], dict], operation: str) -> int:
    from coldsnap.operation import OperationFailed, run_operation, terminate_as_interrupt

    perform: Callable[[Any], Any]
    early = None  # restore: the tree this process's entry started, if any (its operation id and clock are this one's)
    if operation == "capture":
        from coldsnap.activation.lifecycle import capture as perform
    elif operation == "restore":
        from coldsnap.activation.early_restore import NOT_RUN
        from coldsnap.activation.lifecycle import restore

        entry = args.entry or NOT_RUN  # (what the program's entry did: handed to the restore it is for)
        early = entry.tree
        perform = functools.partial(restore, entry=entry)
    elif operation == "warm":
        from coldsnap.activation.lifecycle import warm as perform
    else:
        from coldsnap.activation.lifecycle import wake as perform

    terminate_as_interrupt()
    if early is not None and args.operation_id is None:
        args.operation_id = early.operation_id
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

    return run_operation(data, source, body, args.receipt_json, args.timing_events, owner=args.owner,
                         origin=early.origin if early is not None else None)


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

        SETTINGS.give(VERIFY_ENV, "0")
    from coldsnap.activation.canary_probes import PROBES_ENV, probe_plan

    if args.canary_probes is not None:
        SETTINGS.give(PROBES_ENV, args.canary_probes)
    try:
        probe_plan()  # malformed (from the flag or the environment): said now, before the engine starts
    except ValueError as exc:
        where = "--canary-probes" if args.canary_probes is not None else PROBES_ENV
        print(f"coldsnap capture: {where}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    from coldsnap.activation.reference_check import REFERENCE_ENV, REFERENCE_PROBES_ENV, reference_mode, reference_plan

    if args.reference is not None:
        SETTINGS.give(REFERENCE_ENV, args.reference)
    if args.reference_probes is not None:
        SETTINGS.give(REFERENCE_PROBES_ENV, args.reference_probes)
    try:
        reference_mode("vllm")  # an unknown mode in the environment: said now too
    except ValueError as exc:
        print(f"coldsnap capture: {REFERENCE_ENV}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        reference_plan(())
    except ValueError as exc:
        where = "--reference-probes" if args.reference_probes is not None else REFERENCE_PROBES_ENV
        print(f"coldsnap capture: {where}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return _run_lifecycle(args, _capture_request, "capture")


def _use_state_dir(args: argparse.Namespace) -> None:
    if args.state_dir:
        from coldsnap.host import STATE_DIR_ENV

        SETTINGS.give(STATE_DIR_ENV, os.path.abspath(args.state_dir))


def _cmd_artifact_operation(args: argparse.Namespace) -> int:
    """restore, warm and wake: an artifact directory (wake: or a standby id), or a strict request."""
    if not _parse_owner_flag(args, args.operation):
        return EXIT_USAGE
    if not args.request_json and not args.artifact:
        print("coldsnap: give the artifact directory (or --request-json)", file=sys.stderr)
        return EXIT_USAGE
    if getattr(args, "unit_hosts", None):  # every unit on its own host, through the manager's host provider
        from coldsnap.cli.provider_command import drive_unit_hosts

        return drive_unit_hosts(args)
    _use_state_dir(args)
    if getattr(args, "host_thp", False):
        from coldsnap.snapshot.thp import HOST_THP_ENV

        SETTINGS.give(HOST_THP_ENV, "always")
    if args.artifact and args.artifact.startswith("oci://") and not args.request_json:
        if args.operation == "wake":
            print("coldsnap wake: wake takes the artifact directory or standby id a warm used, not oci://", file=sys.stderr)
            return EXIT_USAGE
        from coldsnap.host import state_root
        from coldsnap.registry.commands import OciPullFailed, pull_into_cache

        # A restore on a host with no copy starts once everything but the packs is in: the weights are hydrated
        # as their chunks arrive. A warm (its agents read the packs at wake) and --prepare-only pull whole.
        stream = args.operation == "restore" and not getattr(args, "prepare_only", False)
        try:  # before anything of the host is touched: a failed pull changes nothing but the cache
            cached = pull_into_cache(args.artifact, state_root() / "oci", args.operation, args.owner, stream=stream)
        except OciPullFailed as exc:
            print(f"coldsnap {args.operation}: {exc}", file=sys.stderr)
            return EXIT_USAGE if exc.usage else EXIT_FAILED
        args.artifact = str(cached.directory)
        code = EXIT_FAILED
        try:
            code = _run_lifecycle(args, lambda a: _artifact_request(a, args.operation), args.operation)
        finally:
            cached.finish(cancel=code != EXIT_OK)
        return code
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

    return run_publish(args.artifact, args.reference, args.json, args.chunk_size, args.allow_secrets)


def _cmd_pull(args: argparse.Namespace) -> int:
    from coldsnap.registry.commands import run_pull

    return run_pull(args.reference, args.directory, args.json, args.owner)


def _cmd_status(args: argparse.Namespace) -> int:
    _use_state_dir(args)
    from coldsnap.host import state_root
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
                                  Path(args.endpoint_file) if args.endpoint_file else None, units=args.units)
    except (ValueError, OSError) as exc:
        print(f"coldsnap coordinator: {exc}", file=sys.stderr)
        return EXIT_USAGE
    units = f" and {args.units} launch units" if args.units else ""
    print(f"coldsnap coordinator: listening on {coordinator.endpoint} for {args.ranks} ranks{units}", file=sys.stderr)
    reason = coordinator.serve()
    print(f"coldsnap coordinator: done ({reason}); {coordinator.rejected} frames rejected", file=sys.stderr)
    return EXIT_OK if reason == "complete" else EXIT_FAILED

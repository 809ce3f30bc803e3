"""The ``coldsnap`` command line.

Machine-facing output (capabilities, receipts, ``--json``) goes to stdout; everything for people goes
to stderr. Bad input exits with status 2 and one line per problem, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable

from coldsnap import __version__
from coldsnap.contracts.artifact import ArtifactDescriptor
from coldsnap.contracts.base import Contract, ContractError, decode_document, parse_strict_json
from coldsnap.contracts.capabilities import build_capabilities
from coldsnap.contracts.canonical import canonical_json
from coldsnap.contracts.profiles import resolve_request
from coldsnap.contracts.receipt import OperationReceipt
from coldsnap.contracts.request import OperationRequest
from coldsnap.contracts.timing_events import MAX_EVENT_BYTES, MAX_EVENTS, TIMING_EVENT_ADAPTER
from coldsnap.operation import EXIT_FAILED, EXIT_OK, EXIT_USAGE

__all__ = ["main", "build_parser"]

DESCRIPTION = """\
coldsnap captures an initialized LLM serving process (vLLM, SGLang) once and restores it in seconds:
CRIU + the CUDA checkpoint driver API for the process, a content-addressed native pack for the weights.

Managers (Sparkrun, a Kubernetes operator) start with `coldsnap capabilities`; people start with
`coldsnap doctor` to see what this host can do.
"""


def _read_input(path: str) -> bytes:
    if path == "-":
        return sys.stdin.buffer.read()
    with open(path, "rb") as handle:
        return handle.read()


def _cmd_capabilities(args: argparse.Namespace) -> int:
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


def _validate_model(model: type[Contract], label: str) -> Callable[[bytes, str], str]:
    def validate(data: bytes, source: str) -> str:
        document = decode_document(model, data, source)
        return f"{label} format {document.format}, sha256 {document.canonical_sha256()}"  # type: ignore[attr-defined]

    return validate


def _validate_timing_events(data: bytes, source: str) -> str:
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
    "artifact": _validate_model(ArtifactDescriptor, "artifact"),
    "receipt": _validate_model(OperationReceipt, "receipt"),
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="coldsnap", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"coldsnap {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = commands.add_parser(
        "capabilities",
        help="print the static capabilities JSON (formats, engines, snapshot drivers, features)",
        description="Print what this build accepts and drives, as JSON on stdout: request/artifact/receipt/"
        "timing-event formats, engine adapters and their native materialization modes, snapshot drivers "
        "n580/n610 with their minimum NVIDIA driver, per-operation replay semantics and features. It is a "
        "static contract: `coldsnap doctor` says what this host can actually do.",
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
        "checkpoint and VMM entry points, the GPUs, and which snapshot drivers (n580, n610) are usable. "
        "Always exits 0 when it could look; read the verdicts.",
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


if __name__ == "__main__":
    sys.exit(main())

"""The operation envelope every lifecycle command runs in.

It owns the operator contract's rules, so that no operation can get them slightly wrong on its own:

- the request is read strictly and resolved against the driver profile, then hashed; a well-formed
  request naming what this build does not implement (an operation, engine, snapshot driver or policy
  value ``coldsnap capabilities`` does not list) is not run: it gets a ``failed`` receipt with code
  ``request.unsupported``, bound to the request as sent;
- the receipt destination is claimed *before* any work: a receipt path that already holds a receipt
  of a different request is refused;
- ``--receipt-json -`` writes exactly one receipt to stdout and all progress to stderr; a path is
  published atomically; a successful receipt is never replaced by a later failure;
- ``--timing-events`` (a new absolute path, or ``-`` when the receipt is not on stdout) mirrors the
  spans live; its failures are warnings only;
- the exit status is 0 exactly when the receipt says ``succeeded``; 2 for input the caller must fix
  (a malformed request, a refused receipt path, an owner that cannot be given), which gets no receipt;
- what the operation wrote under an artifact directory or a state root goes to its owner when it ends,
  however it ends (:mod:`coldsnap.ownership`: ``--owner``, the request's ``owner``, sudo's caller).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, Iterator, Literal, TypeVar

from coldsnap.atomic import write_atomic
from coldsnap.contracts.base import ContractError, decode_document
from coldsnap.contracts.canonical import canonical_json
from coldsnap.contracts.errors import ERROR_CODES
from coldsnap.contracts.profiles import OPERATIONS, UnsupportedRequest, resolve_request
from coldsnap.contracts.receipt import ErrorRecord, OperationReceipt
from coldsnap.contracts.request import OperationRequest
from coldsnap.ownership import HandOver, Owner, OwnerError, resolve_owner
from coldsnap.timing import OperationTimer, TimingEventStream

__all__ = [
    "EXIT_OK",
    "EXIT_FAILED",
    "EXIT_USAGE",
    "OperationFailed",
    "UsageError",
    "OperationContext",
    "OperationOutcome",
    "ReceiptDestination",
    "run_operation",
    "step",
    "terminate_as_interrupt",
]

T = TypeVar("T")

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2


class UsageError(Exception):
    """Input the caller must fix (bad request, refused receipt path); exit status 2, no receipt."""


class OperationFailed(Exception):
    """The operation ran and failed; becomes a ``failed`` receipt with this code."""

    def __init__(self, code: str, message: str):
        if code not in ERROR_CODES:  # a bug: every code a receipt carries is listed and documented
            raise ValueError(f"unregistered error code {code!r} (add it to coldsnap.contracts.errors)")
        self.code = code
        self.message = message
        super().__init__(f"{code}: {message}")


@dataclass
class OperationOutcome:
    """What an operation body returns on success."""

    artifact: str | None = None
    warnings: list[str] = field(default_factory=list)


class ReceiptDestination:
    """Where the receipt goes: stdout (``-``), a file path, or nowhere (``None``)."""

    def __init__(self, spec: str | None, stdout: IO[bytes]):
        self.spec = spec
        self._stdout = stdout
        self.path = None if spec in (None, "-") else Path(spec)

    @property
    def to_stdout(self) -> bool:
        return self.spec == "-"

    def _existing(self) -> OperationReceipt | None:
        assert self.path is not None
        if not self.path.exists():
            return None
        try:
            return decode_document(OperationReceipt, self.path.read_bytes(), str(self.path))
        except (ContractError, OSError) as exc:
            raise UsageError(f"--receipt-json {self.path}: holds something that is not a receipt ({exc})") from None

    def claim(self, request_sha256: str) -> None:
        """Refuse, before any work, a path bound to a different request or one we cannot write."""
        if self.path is None:
            return
        if not self.path.parent.is_dir():
            raise UsageError(f"--receipt-json {self.path}: directory {self.path.parent} does not exist")
        if not os.access(self.path.parent, os.W_OK):
            raise UsageError(f"--receipt-json {self.path}: directory {self.path.parent} is not writable")
        existing = self._existing()
        if existing is not None and existing.request_sha256 != request_sha256:
            raise UsageError(
                f"--receipt-json {self.path}: already bound to request {existing.request_sha256[:12]}… "
                f"(operation {existing.operation_id}); this request is {request_sha256[:12]}…"
            )

    def publish(self, receipt: OperationReceipt) -> str | None:
        """Publish; returns a warning when an earlier success is kept instead of a new failure."""
        data = canonical_json(receipt.to_json_value()) + b"\n"
        if self.to_stdout:
            self._stdout.write(data)
            self._stdout.flush()
            return None
        if self.path is None:
            return None
        existing = self._existing()
        if existing is not None and existing.state == "succeeded" and receipt.state == "failed":
            return f"kept the successful receipt at {self.path}; this run failed and is reported on stderr only"
        write_atomic(self.path, data)
        return None


@dataclass
class OperationContext:
    """What an operation body gets: the resolved request, its digest, the timer, progress output."""

    request: OperationRequest
    request_sha256: str
    timer: OperationTimer
    _stderr: IO[str]
    warnings: list[str] = field(default_factory=list)
    """Warnings raised while the body runs; they go into the receipt whether it succeeds or fails."""
    held: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    """What the body holds until the operation ends (its serving port's lock): released after the body
    returns or fails, before the receipt is published."""

    hand_over: HandOver = field(default_factory=lambda: HandOver(None))
    """What the body writes under an artifact directory or a state root, claimed as it goes and handed to
    the operation's owner when the operation ends (after :attr:`held`, before the receipt)."""

    units: Any = None
    """One unit of several: this launcher's seat at the activation's coordinator
    (:class:`coldsnap.activation.units.UnitRendezvous`, set while the operation runs); ``None`` for one unit."""

    def hold(self, resource: contextlib.AbstractContextManager[T]) -> T:
        """Enter ``resource`` now and exit it when the operation ends (:attr:`held`)."""
        return self.held.enter_context(resource)

    def warn(self, message: str) -> None:
        """A warning for the receipt, shown on stderr at the end with the others."""
        self.warnings.append(message)

    def nested(self, request: OperationRequest) -> "OperationContext":
        """The context of an operation this one runs inside itself (a capture's check restore): its own
        timer and warnings, this one's progress stream."""
        return OperationContext(request, request.canonical_sha256(), OperationTimer(None), self._stderr,
                                hand_over=self.hand_over, units=self.units)

    def progress(self, message: str) -> None:
        """One progress line on stderr, always naming the operation and the snapshot driver."""
        r = self.request
        self._stderr.write(f"coldsnap {r.operation} [{r.engine}/{r.snapshot_driver}]: {message}\n")
        self._stderr.flush()


@contextlib.contextmanager
def step(timer: OperationTimer, span: str, code: str, failures: tuple[type[BaseException], ...],
         describe: Callable[[BaseException], str] = str,
         started_ns: int | None = None) -> Iterator[dict[str, str | int | bool]]:
    """One step of an operation: its timing span (``started_ns``: :meth:`OperationTimer.span`'s), and any of
    ``failures`` raised inside reported as ``OperationFailed(code, describe(exc))``; an
    :class:`OperationFailed` raised inside keeps its own code."""
    with timer.span(span, started_ns) as attributes:
        try:
            yield attributes
        except OperationFailed:
            raise
        except failures as exc:
            raise OperationFailed(code, describe(exc)) from None


def terminate_as_interrupt() -> None:
    """Make SIGTERM behave like Ctrl-C in this process, so a stopped operation unwinds: what it
    started is killed by the body's cleanup and a ``failed`` receipt is still published."""
    import signal

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


def _open_events(spec: str | None, receipt: ReceiptDestination, stdout: IO[bytes]) -> IO[bytes] | None:
    if spec is None:
        return None
    if receipt.spec is None:
        raise UsageError("--timing-events requires --receipt-json")
    if spec == "-":
        if receipt.to_stdout:
            raise UsageError("--timing-events - and --receipt-json - cannot both use stdout")
        return stdout
    path = Path(spec)
    if not path.is_absolute():
        raise UsageError(f"--timing-events {spec}: must be an absolute path or -")
    try:
        return open(path, "xb")  # previously absent, by contract
    except FileExistsError:
        raise UsageError(f"--timing-events {spec}: already exists") from None
    except OSError as exc:
        raise UsageError(f"--timing-events {spec}: cannot create ({exc.strerror})") from None


def _hand_over(context: OperationContext) -> None:
    """Give what the operation wrote to its owner; a shortfall is a warning (the operation's own result
    stands: a serving restore is not undone for a file that kept root as its owner)."""
    report = context.hand_over.apply()
    if report is None:
        return
    context.warnings.extend(report.warnings())
    context.progress(f"handed {report.changed} path(s) it wrote to {report.owner} ({report.owner.source})")


def run_operation(
    request_bytes: bytes,
    request_source: str,
    body: Callable[[OperationContext], OperationOutcome],
    receipt_spec: str | None,
    events_spec: str | None = None,
    stdout: IO[bytes] | None = None,
    stderr: IO[str] | None = None,
    owner: Owner | str | None = None,
    origin: tuple[int, int] | None = None,
) -> int:
    """Run ``body`` inside the operation envelope; returns the process exit status. ``owner``: ``--owner``
    (else the request's, else sudo's caller: :func:`coldsnap.ownership.resolve_owner`). ``origin``: the
    operation clock's (:class:`~coldsnap.timing.OperationTimer`), default now."""
    stdout = stdout if stdout is not None else sys.stdout.buffer
    stderr = stderr if stderr is not None else sys.stderr
    events_handle = None
    refusal: UnsupportedRequest | None = None
    try:
        request = decode_document(OperationRequest, request_bytes, request_source)
        try:
            request = resolve_request(request)
        except UnsupportedRequest as exc:
            refusal = exc  # well-formed: it gets a receipt (bound to the request as sent), not a usage error
        request_sha256 = request.canonical_sha256()
        given = request.owner
        resolved_owner = resolve_owner(owner, (given.uid, given.gid) if given is not None else None)
        receipt_dest = ReceiptDestination(receipt_spec, stdout)
        receipt_dest.claim(request_sha256)
        events_handle = _open_events(events_spec, receipt_dest, stdout)
    except ContractError as exc:
        for line in str(exc).splitlines():
            stderr.write(f"coldsnap: {line}\n")
        return EXIT_USAGE
    except (UsageError, OwnerError) as exc:
        stderr.write(f"coldsnap: {exc}\n")
        return EXIT_USAGE

    events = TimingEventStream(events_handle, request.operation_id, request_sha256) if events_handle else None
    timer = OperationTimer(events, origin=origin)
    context = OperationContext(request, request_sha256, timer, stderr, hand_over=HandOver(resolved_owner))
    started = timer.unix_origin_ns
    outcome = OperationOutcome()
    error: ErrorRecord | None = None
    if refusal is None:
        context.progress(f"operation {request.operation_id} started")
    try:
        with timer.span(f"controller.{request.operation}"):
            if refusal is not None:
                raise OperationFailed(refusal.code, refusal.message)
            outcome = body(context)
    except OperationFailed as exc:
        error = ErrorRecord(code=exc.code, message=exc.message)
    except KeyboardInterrupt:  # SIGINT, or SIGTERM (see terminate_as_interrupt): the body has cleaned up
        error = ErrorRecord(code="interrupted", message="the operation was interrupted (SIGINT/SIGTERM)")
    except Exception as exc:  # a bug, not a user mistake: still a failed receipt, never a lost one
        error = ErrorRecord(code="internal", message=f"{type(exc).__name__}: {exc}")
    finally:
        context.held.close()
        _hand_over(context)
    state: Literal["succeeded", "failed"] = "failed" if error else "succeeded"
    envelope = timer.envelope()
    timer.complete(state, envelope)
    warnings = [*context.warnings, *outcome.warnings, *timer.warnings, *(events.warnings if events else [])]
    receipt = OperationReceipt(
        format=2,
        operation=request.operation,
        operation_id=request.operation_id,
        request_sha256=request_sha256,
        engine=request.engine,
        snapshot_driver=request.snapshot_driver,
        prepare_only=request.prepare_only,
        state=state,
        replay_semantics="safe-to-repeat" if refusal else OPERATIONS[request.operation],
        started_unix_ns=started,
        finished_unix_ns=max(time.time_ns(), started),
        artifact=outcome.artifact,
        error=error,
        warnings=warnings,
        timing=envelope,
    )
    for warning in warnings:
        context.progress(f"warning: {warning}")
    if events_handle is not None and events_handle is not stdout:
        events_handle.close()
    try:
        kept = receipt_dest.publish(receipt)
    except OSError as exc:
        context.progress(f"error: could not publish the receipt to {receipt_dest.spec}: {exc}")
        return EXIT_FAILED
    if kept:
        context.progress(f"warning: {kept}")
    if error:
        context.progress(f"failed: {error.code}: {error.message}")
        return EXIT_FAILED
    context.progress(f"operation {request.operation_id} succeeded")
    return EXIT_OK

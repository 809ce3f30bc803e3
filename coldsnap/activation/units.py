"""An activation of several launch units: this unit's seat at the activation's coordinator.

Each unit of an N-unit artifact is captured and restored by its own ``coldsnap capture|restore`` on its
own host (``--units N --unit K --rendezvous HOST:PORT``, or the request's ``unit`` selection). The
launchers meet at the unit-level barriers of the activation's CSKV coordinator
(:mod:`coldsnap.coord`, participants of role ``unit``), which unit 0 may serve itself
(``--serve-rendezvous``); their engine ranks meet at the same coordinator as ranks (NCCL teardown and
rebuild). The unit launchers heartbeat all the time (``keepalive``): a launcher killed, or one whose
step failed (it ABORTs with its error code and message), fails every other unit within ~2 s, named.

Small values travel through the coordinator's key/value: the units' capsule records for the one
descriptor every unit commits, unit 0's canary, the port generation every unit must accept, each
unit's address (at capture and now: the TCP connections between units' trees are dumped established
and rewritten for the new addresses in every unit's per-restore socket images).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from coldsnap.agent.protocol import CoordinatorRef
from coldsnap.coord.frames import MAX_VALUE_BYTES
from coldsnap.contracts.request import OperationRequest, UnitSelection
from coldsnap.operation import OperationFailed

__all__ = ["UnitRendezvous", "artifact_request", "join_capture_request", "join_units", "moved_addresses",
           "packed_addresses", "selected_unit", "unit_activation",
           "STEP_TIMEOUT_S"]

STEP_TIMEOUT_S = 1800.0
"""A unit-level barrier's limit: the slowest unit's step (a capture's engine start, a cold hydration)."""
COORDINATOR_TTL_S = 7200.0


def selected_unit(request: OperationRequest) -> int | None:
    """The index of the unit this launcher runs (``None``: the request is not one unit's of several)."""
    return None if request.unit is None else request.unit.index


def local_address_towards(endpoint: str) -> str:
    """The address this host uses to reach ``endpoint`` (``tcp://HOST:PORT``): its address on the
    activation's network, where the other units reach this one (no packet is sent)."""
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host.strip("[]"), int(port)))
        return str(probe.getsockname()[0])


@dataclass
class UnitRendezvous:
    """This unit's launcher at the activation's coordinator (served here too when this unit serves it). Its
    ``client`` serializes the calls of this launcher's threads (a rank's abort, the steps' barriers)."""

    index: int
    units: int
    world: int
    endpoint: str
    token: bytes
    address: str
    client: Any
    served: Any = None
    _thread: threading.Thread | None = None
    _context: Any = None
    aborted: bool = False
    placed: dict[str, str] = field(default_factory=dict)
    """Every unit's address at capture → its address now (a restore's, from :meth:`place`): the restored
    connections between units are rewritten with it on both ends."""

    @contextlib.contextmanager
    def _failing_as_rendezvous(self) -> Iterator[None]:
        """A coordinator call of this unit: its failure is ``unit.rendezvous``, naming this unit and why (the
        unit that failed first, the barrier's missing units, a coordinator gone)."""
        from coldsnap.coord import CoordinatorError

        try:
            yield
        except CoordinatorError as exc:
            raise OperationFailed("unit.rendezvous", f"unit {self.index} of {self.units}: {exc}") from None

    def barrier(self, name: str, timeout: float = STEP_TIMEOUT_S) -> None:
        """Every unit reached ``name``."""
        with self._failing_as_rendezvous():
            self.client.barrier(name, timeout)

    def put(self, key: str, value: Any) -> None:
        with self._failing_as_rendezvous():
            self.client.put(key, json.dumps(value, sort_keys=True))

    def get(self, key: str, timeout: float = STEP_TIMEOUT_S) -> Any:
        with self._failing_as_rendezvous():
            return json.loads(self.client.get(key, timeout))

    def every_unit(self, key: str, value: Any) -> list[Any]:
        """Publish this unit's ``value`` under ``key`` and return every unit's, in unit order."""
        self.put(f"{key}/{self.index}", value)
        return [value if k == self.index else self.get(f"{key}/{k}") for k in range(self.units)]

    def from_unit_0(self, key: str, value: Any = None) -> Any:
        """Unit 0 publishes ``value`` under ``key``; every unit gets it."""
        if self.index == 0:
            self.put(key, value)
            return value
        return self.get(key)

    def place(self, captured: str | None) -> dict[str, str]:
        """Publish this unit's captured address and its address now; every unit's, captured → now (the same
        map on every unit: a connection between two units is rewritten alike at both ends)."""
        pairs = self.every_unit("restore/placement", [captured, self.address])
        self.placed = {before: now for before, now in pairs if before is not None}
        return self.placed

    def ref(self) -> CoordinatorRef:
        """What this unit's ranks join: the shared coordinator, the activation's whole world, this unit's address."""
        return CoordinatorRef(endpoint=self.endpoint, token=self.token.hex(), world=self.world, address=self.address)

    def abort(self, reason: str) -> None:
        """Fail the activation for every other unit and rank at once (best effort: the coordinator may be
        what failed)."""
        from coldsnap.coord import CoordinatorError

        if self.aborted:
            return
        self.aborted = True
        try:
            self.client.abort(f"unit {self.index}: {reason}")
        except (CoordinatorError, OSError):
            pass

    def close(self, completed: bool) -> None:
        from coldsnap.coord import CoordinatorError

        try:
            self.client.close(completed=completed and not self.aborted)
        except CoordinatorError:
            pass
        if self.served is not None:
            # The coordinator this unit serves stays until every unit said BYE (or the others were told)
            # (after a failure only long enough to hand out the abort: nobody says BYE to a failed activation)
            if self._thread is not None:
                self._thread.join(timeout=10 if completed and not self.aborted else 0.3)
            self.served.stop()
            if self._thread is not None:
                self._thread.join(timeout=5)
            self._context.term()


def packed_addresses(addresses: set[str]) -> set[bytes]:
    """``addresses`` (IP addresses; host names are left out) packed as a socket image holds them, an IPv4
    one also in its IPv4-mapped IPv6 form (a dual-stack listener's accepted connections)."""
    packed: set[bytes] = set()
    for address in addresses:
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            continue
        packed.add(ip.packed)
        if ip.version == 4:
            packed.add(ipaddress.IPv6Address(f"::ffff:{ip}").packed)
    return packed


def moved_addresses(placed: dict[str, str]) -> dict[bytes, bytes]:
    """Every unit's captured IP address, packed, onto its address now (IPv4 ones in both forms, see
    :func:`packed_addresses`); ``restore.placement`` when a unit moves to an address of another family."""
    moved: dict[bytes, bytes] = {}
    for captured, now in placed.items():
        if captured == now:
            continue
        try:
            old, new = ipaddress.ip_address(captured), ipaddress.ip_address(now)
        except ValueError:
            continue  # (a host name: nothing in the images to map)
        if old.version != new.version:
            raise OperationFailed("restore.placement", f"a unit was captured at {captured}, placed at {now}: "
                                  "an address of the same family is needed")
        moved[old.packed] = new.packed
        if old.version == 4:
            moved[ipaddress.IPv6Address(f"::ffff:{old}").packed] = ipaddress.IPv6Address(f"::ffff:{new}").packed
    return moved


def read_token(path: str) -> bytes:
    try:
        token = Path(path).read_bytes().strip()
    except OSError as exc:
        raise OperationFailed("unit.rendezvous", f"rendezvous token file {path}: {exc.strerror or exc}") from None
    if len(token) < 16:
        raise OperationFailed("unit.rendezvous", f"rendezvous token file {path}: the token must be at least 16 bytes")
    return token


def join_units(request: OperationRequest, progress: Any) -> UnitRendezvous | None:
    """This launcher's seat at the activation's coordinator for a request that selects one unit of several
    (``None`` otherwise): the coordinator served here first when the selection says so, then joined."""
    selection: UnitSelection | None = request.unit
    if selection is None:
        return None
    index = selection.index
    try:
        import zmq

        from coldsnap.coord import Coordinator, CoordinatorClient, CoordinatorError
    except ImportError:
        raise OperationFailed("request.unsupported", "an activation of several units needs pyzmq "
                              "(pip install pyzmq)") from None
    token = read_token(selection.rendezvous_token_file)
    # a unit's own capture request lists only it: every unit runs as many ranks (coldsnap capture --ranks)
    world = selection.units * len(request.units[0].workers) if request.partial else sum(len(u.workers) for u in request.units)
    count = selection.units
    context = zmq.Context()
    served = thread = None
    endpoint = f"tcp://{selection.rendezvous}"
    if selection.serve_rendezvous is not None:
        try:
            served = Coordinator(selection.serve_rendezvous, token, world, COORDINATOR_TTL_S, context=context,
                                 units=count)
        except (zmq.ZMQError, ValueError) as exc:
            context.term()
            raise OperationFailed("unit.rendezvous", f"cannot serve the coordinator on {selection.serve_rendezvous}: "
                                  f"{exc}") from None
        thread = threading.Thread(target=served.serve, name="coldsnap-unit-coordinator", daemon=True)
        thread.start()
        progress(f"serving the activation's coordinator on {served.endpoint} for {count} units, "
                 f"{world} ranks")
    address = selection.address or local_address_towards(endpoint)
    try:
        client = CoordinatorClient(endpoint, token, index, connect_timeout=selection.join_timeout_s, context=context, role="unit",
                                   keepalive=True)
    except CoordinatorError as exc:
        if served is not None:
            served.stop()
            assert thread is not None
            thread.join(timeout=5)
        context.term()
        raise OperationFailed("unit.rendezvous", f"unit {index} of {count}: joining the coordinator at "
                              f"{endpoint}: {exc}") from None
    progress(f"unit {index} of {count} ({selection.unit_id}, address {address}) joined the coordinator at {endpoint}")
    return UnitRendezvous(index=index, units=count, world=world, endpoint=endpoint, token=token,
                          address=address, client=client, served=served, _thread=thread, _context=context)


@contextlib.contextmanager
def unit_activation(context: Any) -> Iterator[UnitRendezvous | None]:
    """While an operation of one unit of several runs: its seat at the coordinator (``context.units``),
    joined first (a nested operation, the capture's check restore, keeps its parent's). Any failure of
    this unit aborts the activation for every other unit, with this unit's error code and message; the
    seat is given up either way."""
    if context.units is not None:
        yield context.units
        return
    units = join_units(context.request, context.progress)
    if units is None:
        yield None
        return
    context.units = units
    completed = False
    try:
        yield units
        completed = True
        share_timing(context.timer, units)
    except OperationFailed as exc:
        if exc.code != "unit.rendezvous":  # (that one came from the others, or from the coordinator)
            units.abort(f"{exc.code}: {exc.message}")
        raise
    except BaseException as exc:
        units.abort(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
        raise
    finally:
        units.close(completed)
        context.units = None


TIMING_WAIT_S = 2.0
"""How long unit 0 waits for another unit's spans after the last barrier (they are diagnostics: a unit
slow to send them costs a timing warning, never the operation)."""
TIMING_CHUNK_BYTES = MAX_VALUE_BYTES - 1024


def share_timing(timer: Any, units: UnitRendezvous) -> None:
    """After the operation's last barrier: every other unit hands unit 0 its timing envelope, which unit 0's
    receipt carries on one clock per unit (``unit-K``, its own Unix origin; docs/contracts.md's timing envelope). An
    envelope travels in chunks under the coordinator's value limit."""
    from coldsnap.contracts import ContractError
    from coldsnap.contracts.receipt import TimingEnvelope

    if units.index != 0:
        text = json.dumps(timer.envelope_so_far().to_json_value(), sort_keys=True)
        chunks = [text[i:i + TIMING_CHUNK_BYTES] for i in range(0, len(text), TIMING_CHUNK_BYTES)] or [""]
        try:
            for number, chunk in enumerate(chunks):
                units.client.put(f"timing/{units.index}/{number}", chunk)
            units.client.put(f"timing/{units.index}", str(len(chunks)))
        except Exception as exc:  # (diagnostics: the operation succeeded)
            timer.warnings.append(f"timing: unit {units.index}'s spans were not handed to unit 0: {exc}")
        return
    for k in range(1, units.units):
        try:
            count = int(units.client.get(f"timing/{k}", TIMING_WAIT_S))
            text = "".join(units.client.get(f"timing/{k}/{n}", TIMING_WAIT_S) for n in range(count))
            envelope = TimingEnvelope.model_validate_json(text)
        except (ContractError, ValueError) as exc:
            timer.warnings.append(f"timing: unit {k}'s spans are not a timing envelope: {str(exc)[:200]}")
            continue
        except Exception as exc:
            timer.warnings.append(f"timing: unit {k}'s spans did not arrive within {TIMING_WAIT_S:g} s: {exc}")
            continue
        timer.import_envelope(envelope, f"unit-{k}", f"unit {k}'s launcher (its own host and clock)")


def artifact_request(request: OperationRequest) -> OperationRequest:
    """What an artifact records of its capture's request: the whole activation, no unit's selection."""
    return request if request.unit is None else request.model_copy(update={"unit": None})


def join_capture_request(context: Any, units: UnitRendezvous) -> OperationRequest:
    """The activation's capture request from every unit's own (``coldsnap capture --units N --unit K``
    lists only unit K): unit 0's operation, every unit's launch spec in unit order, this unit's artifact
    directory and selection. Each unit's engine, driver, model and policy must be unit 0's."""
    from coldsnap.contracts.base import ContractError, decode_document
    from coldsnap.contracts.canonical import canonical_json

    request = context.request
    own = request.to_json_value()
    shared = ("format", "operation", "engine", "snapshot_driver", "model", "policy")
    envelope = units.from_unit_0("capture/envelope", {k: own[k] for k in (*shared, "operation_id")})
    differing = [k for k in shared if envelope[k] != own[k]]
    if differing:
        raise OperationFailed("capture.topology", f"unit {units.index}'s capture differs from unit 0's in "
                              f"{', '.join(differing)}: every unit captures the same engine, model and policy")
    if not request.partial:  # the manager gave the whole topology to every unit: it must be the same
        specs = units.every_unit("capture/units", own["units"])
        if any(s != own["units"] for s in specs):
            raise OperationFailed("capture.topology", "the units' requests list different launch units")
        return request
    specs = units.every_unit("capture/unit", own["units"][0])
    document = {**own, "operation_id": envelope["operation_id"], "units": specs}
    try:
        joined = decode_document(OperationRequest, canonical_json(document), "the units' joined capture request")
    except ContractError as exc:
        raise OperationFailed("capture.topology", "; ".join(exc.problems)) from None
    assert request.unit is not None  # (a partial request has its selection)
    if joined.units[units.index].unit_id != request.unit.unit_id:
        raise OperationFailed("capture.topology", f"unit {units.index} is listed as {joined.units[units.index].unit_id}")
    return joined

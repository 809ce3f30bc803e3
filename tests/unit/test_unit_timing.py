"""One clock per unit: the other units hand unit 0 their timing envelopes at the activation's real
coordinator, and unit 0's receipt envelope carries each on clocks of its own (receipt format 2's timing envelope)."""

import json
import threading
import time

import pytest

pytest.importorskip("zmq")

from coldsnap.activation.units import TIMING_CHUNK_BYTES, UnitRendezvous, share_timing  # noqa: E402
from coldsnap.contracts.receipt import TimingEnvelope  # noqa: E402
from coldsnap.coord import Coordinator, CoordinatorClient  # noqa: E402
from coldsnap.timing import OperationTimer  # noqa: E402

TOKEN = b"activation-token-0123456789abcdef"


def _unit_timer(spans: int = 3, attribute: str = "") -> OperationTimer:
    """A unit's timer as it stands after the last barrier: its operation span still open."""
    timer = OperationTimer(description="coldsnap controller")
    timer._open = timer.span("controller.restore")  # (left open, as the operation's span is when it shares)
    timer._open.__enter__()
    for k in range(spans):
        with timer.span(f"restore.step{k}", note=attribute):
            with timer.span(f"restore.step{k}.inner"):
                pass
    return timer


def test_a_unit_envelope_is_imported_on_its_own_clocks_under_the_current_span():
    unit_1 = _unit_timer()
    time.sleep(0.01)
    unit_0 = OperationTimer()
    with unit_0.span("controller.restore"):
        with unit_0.span("restore.check_canary"):
            pass
        unit_0.import_envelope(unit_1.envelope_so_far(), "unit-1", "unit 1's launcher")
    envelope = TimingEnvelope.model_validate_json(json.dumps(unit_0.envelope().to_json_value()))  # strict, whole
    clocks = {c.clock_id: c for c in envelope.clocks}
    assert set(clocks) == {"controller", "unit-1"} and clocks["unit-1"].owner == "unit"
    assert clocks["unit-1"].unix_origin_ns == unit_1.unix_origin_ns != unit_0.unix_origin_ns
    imported = [s for s in envelope.spans if s.clock_id == "unit-1"]
    assert len(imported) == 6 and all(s.span_id.startswith("unit-1.") for s in imported)
    (operation,) = [s for s in envelope.spans if s.name == "controller.restore" and s.clock_id == "controller"]
    roots = [s for s in imported if s.parent_id == operation.span_id]  # the steps, whose own parent was open
    assert sorted(s.name for s in roots) == ["restore.step0", "restore.step1", "restore.step2"]
    by_id = {s.span_id: s for s in imported}
    assert all(by_id[s.parent_id].name == s.name.rsplit(".", 1)[0] for s in imported if s not in roots)


def _rendezvous(endpoint: str, index: int) -> UnitRendezvous:
    client = CoordinatorClient(endpoint, TOKEN, index, role="unit", keepalive=True)
    return UnitRendezvous(index=index, units=3, world=3, endpoint=endpoint, token=TOKEN, address="127.0.0.1",
                          client=client)


def test_three_units_hand_unit_0_their_envelopes_through_the_coordinator_in_chunks():
    """Unit 2's envelope is larger than one coordinator value: it travels in chunks; unit 0 gets both."""
    server = Coordinator("127.0.0.1:0", TOKEN, 3, 60, units=3)
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    try:
        timers = {1: _unit_timer(), 2: _unit_timer(spans=120, attribute="x" * 600)}
        assert len(json.dumps(timers[2].envelope_so_far().to_json_value())) > TIMING_CHUNK_BYTES
        seats = {k: _rendezvous(server.endpoint, k) for k in range(3)}
        senders = [threading.Thread(target=share_timing, args=(timers[k], seats[k])) for k in (1, 2)]
        for sender in senders:
            sender.start()
        unit_0 = OperationTimer()
        with unit_0.span("controller.restore"):
            share_timing(unit_0, seats[0])
        for sender in senders:
            sender.join(timeout=10)
        envelope = unit_0.envelope()
        assert {c.clock_id for c in envelope.clocks} == {"controller", "unit-1", "unit-2"}
        assert sum(s.clock_id == "unit-2" for s in envelope.spans) == 240 and not unit_0.warnings
        for seat in seats.values():
            seat.client.close(completed=True)
    finally:
        server.stop()
        thread.join(timeout=5)


def test_a_unit_that_sends_nothing_costs_unit_0_a_timing_warning_only():
    server = Coordinator("127.0.0.1:0", TOKEN, 2, 60, units=2)
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    try:
        seat = _rendezvous(server.endpoint, 0)
        seat.units = 2
        unit_0 = OperationTimer()
        started = time.monotonic()
        share_timing(unit_0, seat)
        assert time.monotonic() - started < 4
        assert [c.clock_id for c in unit_0.envelope().clocks] == ["controller"]
        assert len(unit_0.warnings) == 1 and "unit 1's spans did not arrive" in unit_0.warnings[0]
        seat.client.close(completed=False)
    finally:
        server.stop()
        thread.join(timeout=5)

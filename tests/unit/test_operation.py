"""The operation envelope: receipt publication rules and the timing-event stream."""

import io
import json

import pytest

from coldsnap.cli import VALIDATORS
from coldsnap.contracts import OperationReceipt, OperationRequest, canonical_sha256, decode_document
from coldsnap.contracts.timing_events import MAX_EVENTS
from coldsnap.operation import EXIT_FAILED, EXIT_OK, EXIT_USAGE, OperationFailed, OperationOutcome, run_operation
from coldsnap.timing import OperationTimer, TimingEventStream
from tests.conftest import make_request


def _run(document, body, receipt, events=None):
    stdout, stderr = io.BytesIO(), io.StringIO()
    status = run_operation(json.dumps(document).encode(), "req", body, receipt, events, stdout=stdout, stderr=stderr)
    return status, stdout.getvalue(), stderr.getvalue()


def _succeed(context):
    with context.timer.span("adapter.work", bytes=3):
        context.progress("working")
    return OperationOutcome(artifact="/tmp/artifact")


def _fail(context):
    raise OperationFailed("admission.driver_floor", "NVIDIA driver 580 < 610")


def test_stdout_receipt_is_exactly_one_document_and_progress_goes_to_stderr():
    status, out, err = _run(make_request(), _succeed, "-")
    assert status == EXIT_OK
    assert out.count(b"\n") == 1
    receipt = decode_document(OperationReceipt, out)
    assert receipt.state == "succeeded" and receipt.artifact == "/tmp/artifact"
    assert [s.name for s in receipt.timing.spans] == ["adapter.work", "controller.restore"]
    assert receipt.timing.spans[0].parent_id == receipt.timing.spans[1].span_id
    assert receipt.timing.spans[0].attributes == {"bytes": 3}
    assert "coldsnap restore [vllm/n610]: working" in err  # progress names the driver


def test_failed_operation_has_failed_receipt_and_nonzero_status():
    status, out, err = _run(make_request(), _fail, "-")
    assert status == EXIT_FAILED
    receipt = decode_document(OperationReceipt, out)
    assert receipt.state == "failed" and receipt.error.code == "admission.driver_floor"
    assert "failed: admission.driver_floor" in err


def test_a_bug_in_the_body_still_yields_a_failed_receipt():
    status, out, _ = _run(make_request(), lambda c: 1 / 0, "-")
    assert status == EXIT_FAILED
    assert decode_document(OperationReceipt, out).error.code == "internal"


def test_file_receipt_is_atomic_and_never_downgraded(tmp_path):
    path = tmp_path / "receipt.json"
    assert _run(make_request(), _succeed, str(path))[0] == EXIT_OK
    first = path.read_bytes()
    status, out, err = _run(make_request(), _fail, str(path))
    assert status == EXIT_FAILED and out == b""
    assert path.read_bytes() == first  # success kept
    assert "kept the successful receipt" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["receipt.json"]  # no temp files left


def test_failed_receipt_is_replaced_by_a_later_success(tmp_path):
    path = tmp_path / "receipt.json"
    _run(make_request(), _fail, str(path))
    assert decode_document(OperationReceipt, path.read_bytes()).state == "failed"
    _run(make_request(), _succeed, str(path))
    assert decode_document(OperationReceipt, path.read_bytes()).state == "succeeded"


def test_path_bound_to_another_request_is_refused_before_work(tmp_path):
    path = tmp_path / "receipt.json"
    _run(make_request(), _succeed, str(path))
    ran = []
    status, _, err = _run(make_request(operation_id="op-2"), lambda c: ran.append(1), str(path))
    assert status == EXIT_USAGE and not ran
    assert "already bound to request" in err


def test_path_holding_garbage_is_refused(tmp_path):
    path = tmp_path / "receipt.json"
    path.write_text("{}")
    status, _, err = _run(make_request(), _succeed, str(path))
    assert status == EXIT_USAGE and "not a receipt" in err and path.read_text() == "{}"


def test_bad_request_exits_2_without_receipt():
    status, out, err = _run(make_request(format=5), _succeed, "-")
    assert status == EXIT_USAGE and out == b""
    assert err.strip() == "coldsnap: req: format: unsupported format 5 (supported: 4)"


@pytest.mark.parametrize("overrides, problem", [
    ({"operation": "warm", "snapshot_driver": "n580"}, "operation: warm is not implemented in snapshot driver n580 (implemented: capture, restore)"),
    ({"operation": "sleep"}, "operation: sleep is not implemented in this build (implemented: capture, restore, warm, wake)"),
    ({"policy": {"weights": {"native_materialization": "required"}}},
     "policy.weights.native_materialization: required is not implemented in this build for vllm (implemented: off)"),
])
def test_unsupported_request_gets_a_failed_receipt_and_runs_nothing(overrides, problem):
    ran = []
    document = make_request(**overrides)
    status, out, err = _run(document, lambda c: ran.append(1), "-")
    assert status == EXIT_FAILED and not ran
    receipt = decode_document(OperationReceipt, out)
    assert receipt.state == "failed" and receipt.error.code == "request.unsupported"
    assert receipt.error.message == problem
    assert receipt.operation == document["operation"] and receipt.snapshot_driver == document["snapshot_driver"]
    assert receipt.replay_semantics == "safe-to-repeat"  # nothing was done; this build refuses it again
    assert receipt.request_sha256 == canonical_sha256(decode_document(OperationRequest, json.dumps(document)).to_json_value())
    assert err.splitlines() == [f"coldsnap {document['operation']} [{document['engine']}/{document['snapshot_driver']}]: "
                                f"failed: request.unsupported: {problem}"]


def test_unsupported_request_receipt_path_is_bound_like_any_other(tmp_path):
    path = tmp_path / "receipt.json"
    refused = make_request(operation="warm", snapshot_driver="n580")
    assert _run(refused, _succeed, str(path))[0] == EXIT_FAILED
    assert _run(refused, _succeed, str(path))[0] == EXIT_FAILED  # the same request again: the same path is fine
    status, _, err = _run(make_request(operation_id="op-2"), _succeed, str(path))
    assert status == EXIT_USAGE and "already bound to request" in err


def test_timing_events_stream_binds_the_receipt(tmp_path):
    events_path = tmp_path / "events.ndjson"
    status, out, _ = _run(make_request(), _succeed, "-", str(events_path))
    assert status == EXIT_OK
    receipt = decode_document(OperationReceipt, out)
    lines = [json.loads(line) for line in events_path.read_text().splitlines()]
    assert [e["event"] for e in lines] == ["stream_start", "clock", "span_start", "span_start", "span_complete", "span_complete", "stream_complete"]
    assert [e["sequence"] for e in lines] == list(range(len(lines)))
    assert lines[-1]["timing_envelope_sha256"] == canonical_sha256(receipt.timing.to_json_value())
    assert all(e["request_sha256"] == receipt.request_sha256 for e in lines)
    assert VALIDATORS["timing-events"](events_path.read_bytes(), "events") == "timing events format 1, 7 events"


@pytest.mark.parametrize(
    "receipt, events, message",
    [
        ("-", "-", "cannot both use stdout"),
        (None, "-", "requires --receipt-json"),
        ("-", "relative.ndjson", "must be an absolute path"),
    ],
)
def test_timing_events_usage_rules(receipt, events, message):
    status, out, err = _run(make_request(), _succeed, receipt, events)
    assert status == EXIT_USAGE and message in err and out == b""


def test_timing_events_path_must_be_new(tmp_path):
    existing = tmp_path / "events.ndjson"
    existing.write_text("")
    status, _, err = _run(make_request(), _succeed, str(tmp_path / "r.json"), str(existing))
    assert status == EXIT_USAGE and "already exists" in err


def test_event_stream_cap_keeps_stream_complete():
    sink = io.BytesIO()
    stream = TimingEventStream(sink, "op", "ab" * 32)
    timer = OperationTimer(stream)
    for index in range(MAX_EVENTS):
        with timer.span(f"s{index}"):
            pass
    timer.complete("succeeded", timer.envelope())
    lines = sink.getvalue().splitlines()
    assert len(lines) == MAX_EVENTS
    assert json.loads(lines[-1])["event"] == "stream_complete"
    assert stream.warnings and "cap" in stream.warnings[0]


class _BrokenSink(io.BytesIO):
    def write(self, data):
        raise OSError(28, "No space left on device")


def test_event_output_failure_is_a_warning_only():
    stream = TimingEventStream(_BrokenSink(), "op", "ab" * 32)
    timer = OperationTimer(stream)
    with timer.span("work"):
        pass
    assert len(timer.envelope().spans) == 1
    assert "stream abandoned" in stream.warnings[0]


def test_interrupted_operation_still_publishes_a_failed_receipt(tmp_path):
    cleaned = []

    def interrupted(context):
        try:
            raise KeyboardInterrupt
        finally:
            cleaned.append(True)  # what the body started is stopped by its own cleanup

    status, out, err = _run(make_request(), interrupted, "-")
    assert status == EXIT_FAILED and cleaned == [True]
    assert decode_document(OperationReceipt, out).error.code == "interrupted"


@pytest.mark.parametrize("allowed", [False, True])
def test_driver_floor_refuses_or_warns_only_with_the_host_owners_override(monkeypatch, allowed):
    from coldsnap.activation.qualification import ALLOW_UNQUALIFIED_DRIVER_ENV, check_driver_floor

    if allowed:
        monkeypatch.setenv(ALLOW_UNQUALIFIED_DRIVER_ENV, "1")
    else:
        monkeypatch.delenv(ALLOW_UNQUALIFIED_DRIVER_ENV, raising=False)

    def body(context):
        check_driver_floor(context, "n610", "610.1", "admission.driver_floor")  # at the floor: silent
        check_driver_floor(context, "n610", "580.159.04", "admission.driver_floor")
        return OperationOutcome()

    status, out, err = _run(make_request(), body, "-")
    receipt = decode_document(OperationReceipt, out, "receipt")
    if allowed:
        assert status == EXIT_OK and receipt.warnings == [
            f"unqualified: snapshot driver n610 needs NVIDIA driver 610+, this host has 580.159.04 ({ALLOW_UNQUALIFIED_DRIVER_ENV}=1)"]
        assert "warning: unqualified" in err
    else:
        assert status == EXIT_FAILED and receipt.error.code == "admission.driver_floor"
        assert ALLOW_UNQUALIFIED_DRIVER_ENV in receipt.error.message and not receipt.warnings


def test_driver_checks_refuse_a_snapshot_driver_this_build_does_not_implement():
    from coldsnap.activation.qualification import check_driver_floor, require_implemented_driver

    for check in (lambda: require_implemented_driver("n999"),
                  lambda: check_driver_floor(None, "n999", "999.1", "admission.driver_floor")):
        with pytest.raises(OperationFailed) as caught:
            check()
        assert (caught.value.code, caught.value.message) == (
            "request.unsupported", "snapshot_driver: n999 is not implemented in this build (implemented: n580, n610)")

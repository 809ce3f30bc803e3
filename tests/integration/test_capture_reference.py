"""The capture's reference check with real CRIU: a plain start of the command first, the captured engine's
answers equal to its, once more on a mismatch, and nothing committed when they differ.

The engine is coldsnap's reference workload behind tests/integration/deviant_starts_workload.py, which gives
chosen starts other weights: a stand-in for an engine whose starts disagree (what a deviant vLLM capture on a
fresh GPU host did), which cannot be made to happen here on purpose."""

import json
import sys
from pathlib import Path

import pytest

from tests.helpers import coldsnap_receipt, free_port

pytestmark = pytest.mark.criu

WORKLOAD = Path(__file__).with_name("deviant_starts_workload.py")


def _capture(tmp_path: Path, kind: str, *flags: str) -> tuple[object, dict, Path, int]:
    port = free_port()
    artifact = tmp_path / "artifact"
    done, receipt = coldsnap_receipt(
        "capture", "--engine", "torch-lm", "--out", str(artifact), *flags, "--",
        sys.executable, str(WORKLOAD), kind, str(tmp_path / "starts"), "--", "--size", "tiny", "--device", "cpu",
        "--port", str(port), timeout=300)
    return done, receipt, artifact, port


def _spans(receipt: dict) -> dict[str, dict]:
    return {s["name"]: s["attributes"] for s in receipt["timing"]["spans"]}


def _starts(tmp_path: Path) -> list[str]:
    return (tmp_path / "starts").read_text().split()


def test_a_capture_is_proved_equal_to_a_plain_start_that_ran_first(tmp_path):
    done, receipt, artifact, port = _capture(tmp_path, "fine", "--reference", "plain")
    assert done.returncode == 0, done.stderr
    assert _starts(tmp_path) == ["plain", "capture"]  # the captured engine is never the first start
    reference = json.loads((artifact / "artifact.json").read_text())["reference"]
    assert reference["mode"] == "plain" and reference["note"] is None
    assert (reference["plain_starts"], reference["capture_starts"]) == (1, 1)
    canary = json.loads((artifact / "artifact.json").read_text())["canary"]
    assert reference["canary_token_ids"] == canary["token_ids"] and len(reference["canary_token_ids"]) > 0
    spans = _spans(receipt)
    assert spans["capture.reference"]["matched_first"] is True
    assert spans["capture.reference"]["answers_sha256"] == reference["answers_sha256"]
    assert spans["capture.reference_start"]["plain_start_1_ready_ns"] > 0
    assert "reference check: a plain start of the command (no coldsnap agent) first" in done.stderr
    assert "reference check passed" in done.stderr
    assert (artifact / "logs" / "unit-0-reference.log").stat().st_size > 0
    from coldsnap.activation.restore_place import port_free

    assert port_free(port)


def test_reference_none_skips_the_check_and_the_artifact_says_so(tmp_path):
    done, receipt, artifact, _ = _capture(tmp_path, "fine", "--reference", "none")
    assert done.returncode == 0, done.stderr
    assert _starts(tmp_path) == ["capture"]
    reference = json.loads((artifact / "artifact.json").read_text())["reference"]
    assert reference == {"mode": "none", "note": "skipped: --reference none", "plain_starts": 0, "capture_starts": 0,
                         "canary_token_ids": [], "probes": [], "answers_sha256": None}
    assert "capture.reference" not in _spans(receipt)
    assert "reference check skipped: --reference none" in done.stderr


def test_a_deviant_first_capture_start_is_started_again_and_the_second_captured(tmp_path):
    done, receipt, artifact, _ = _capture(tmp_path, "capture-first", "--reference", "plain")
    assert done.returncode == 0, done.stderr
    assert _starts(tmp_path) == ["plain", "capture", "plain", "capture"]
    assert "trying once more (one more plain start, then the engine again)" in done.stderr
    reference = json.loads((artifact / "artifact.json").read_text())["reference"]
    assert (reference["plain_starts"], reference["capture_starts"]) == (2, 2)
    assert reference["note"].startswith("retried: the first start of the captured engine answered unlike the other starts")
    spans = _spans(receipt)
    assert spans["capture.reference"]["matched_first"] is False
    assert spans["capture.reference"]["first_difference"].startswith("the canary prompt's")


def test_a_deviant_first_plain_start_is_outvoted_by_the_second(tmp_path):
    done, _, artifact, _ = _capture(tmp_path, "plain-first", "--reference", "plain")
    assert done.returncode == 0, done.stderr
    reference = json.loads((artifact / "artifact.json").read_text())["reference"]
    assert reference["note"].startswith("retried: the first plain start answered unlike the other starts")


def test_an_engine_deviant_under_every_capture_is_never_committed(tmp_path):
    done, receipt, artifact, port = _capture(tmp_path, "capture-always", "--reference", "plain")
    assert done.returncode == 1, done.stderr
    assert receipt["error"]["code"] == "capture.reference"
    message = receipt["error"]["message"]
    assert message.startswith("the captured engine answers differently from a plain start of the same command, twice: "
                              "the canary prompt's"), message
    assert "the captured engine generated" in message or "the captured engine predicted" in message
    assert _starts(tmp_path) == ["plain", "capture", "plain", "capture"]
    assert not artifact.exists()  # nothing committed, nothing left
    from coldsnap.activation.restore_place import port_free

    assert port_free(port)


def test_plain_starts_that_disagree_fail_the_check_saying_so(tmp_path):
    done, receipt, artifact, _ = _capture(tmp_path, "every-start", "--reference", "plain")
    assert done.returncode == 1, done.stderr
    assert receipt["error"]["code"] == "capture.reference"
    assert receipt["error"]["message"].startswith("plain starts of the command disagree on this host")
    assert "--reference none" in receipt["error"]["message"]
    assert _starts(tmp_path) == ["plain", "capture", "plain"]  # no third engine start: nothing could prove it
    assert not artifact.exists()


def test_an_unknown_reference_mode_in_the_environment_is_refused_before_anything_starts(tmp_path):
    import os

    done, _ = coldsnap_receipt("capture", "--engine", "torch-lm", "--out", str(tmp_path / "artifact"), "--",
                               sys.executable, str(WORKLOAD), "fine", str(tmp_path / "starts"), "--", "--port", "1",
                               env={**os.environ, "COLDSNAP_CAPTURE_REFERENCE": "sometimes"}, timeout=60)
    assert done.returncode == 2
    assert "COLDSNAP_CAPTURE_REFERENCE: 'sometimes' is not a reference mode (one of: plain, none)" in done.stderr
    assert not (tmp_path / "starts").exists()


def test_malformed_reference_probes_are_refused_before_anything_starts(tmp_path):
    done, _ = coldsnap_receipt("capture", "--engine", "torch-lm", "--reference-probes", "8:4,40", "--out",
                               str(tmp_path / "artifact"), "--", sys.executable, str(WORKLOAD), "fine",
                               str(tmp_path / "starts"), "--", "--port", "1", timeout=60)
    assert done.returncode == 2
    assert "--reference-probes: '40' is not LEN:TOKENS" in done.stderr
    assert not (tmp_path / "starts").exists()

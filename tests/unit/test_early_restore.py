"""A restore's first step without CRIU: which command lines it takes, when a validation record vouches
for a file (the same rule as the verifier's), and that it imports neither pydantic nor a contract model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from coldsnap.activation import early_restore
from coldsnap.payload.records import vouched_by_records
from coldsnap.payload.validation import hash_and_record, verify_file


@pytest.mark.parametrize("argv, taken", [
    (["art"], {"artifact": "art"}),
    (["art", "--port", "8100", "--gpu=1"], {"artifact": "art", "port": 8100, "gpu": "1"}),
    (["--receipt-json", "-", "art", "--timing-events", "/t/e.ndjson", "--state-dir", "/s"],
     {"artifact": "art", "receipt_json": "-", "timing_events": "/t/e.ndjson", "state_dir": "/s"}),
    (["art", "--operation-id", "op-1", "--weights", "native"],
     {"artifact": "art", "operation_id": "op-1", "weights": "native"}),
    (["art", "--port", "1", "--port", "2"], {"artifact": "art", "port": 2}),  # (as the CLI: the last one)
])
def test_the_first_step_takes_a_plain_restore(argv, taken):
    """Parsed by the CLI's own definition of ``coldsnap restore`` (coldsnap.cli.flags.restore_arguments)."""
    args = vars(early_restore._parsed(argv))
    assert {name: value for name, value in args.items() if value not in (None, False)} == taken


@pytest.mark.parametrize("argv, reason", [
    ([], "no artifact directory"),                                   # the CLI says so
    (["art", "--prepare-only"], "--prepare-only is not an option"),  # admission only: nothing may start
    (["--request-json", "-"], "--request-json is not an option"),    # a strict request: decoded first
    (["art", "--owner", "1000:1000"], "--owner is not an option"),   # what it writes is handed over: claimed first
    (["art", "--host-thp"], "--host-thp is not an option"),
    (["art", "--units", "2", "--unit", "0"], "--units is not an option"),  # one unit of several meets the others
    (["oci://registry/repo@sha256:" + "0" * 64], "an oci:// reference"),    # pulled first
    (["art", "other"], "the arguments: unrecognized arguments: other"),
    (["art", "--port"], "the arguments: argument --port: expected one argument"),
    (["art", "--port", "70000"], "the arguments: argument --port: a port must be from 1 to 65535"),
    (["art", "-h"], "the arguments: unrecognized arguments: -h"),
])
def test_anything_else_is_left_to_the_full_path(argv, reason):
    """Left with a reason, which the receipt's ``restore.admission.early`` says."""
    with pytest.raises(early_restore._Declined) as declined:
        early_restore._parsed(argv)
    assert str(declined.value).startswith(reason)


def test_switched_off_or_not_root_it_starts_nothing(monkeypatch):
    monkeypatch.setattr(early_restore, "_start", lambda *a: pytest.fail("the first step ran"))
    monkeypatch.setenv(early_restore.EARLY_RESTORE_ENV, "0")
    entry = early_restore.start_tree(["/nonexistent"])
    assert (entry.tree, entry.declined) == (None, "COLDSNAP_EARLY_RESTORE is off")  # (the receipt's reason)
    monkeypatch.delenv(early_restore.EARLY_RESTORE_ENV)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setenv("SUDO_UID", "1000")  # sudo's caller would own what it writes: claimed by the full path
    entry = early_restore.start_tree(["/nonexistent"])
    assert entry.tree is None and entry.declined.startswith("under sudo")


def test_a_failure_inside_leaves_nothing_started(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.delenv("SUDO_UID", raising=False)
    monkeypatch.delenv("SUDO_GID", raising=False)
    entry = early_restore.start_tree(["/nonexistent/artifact"])  # no artifact.json: the full path reports it
    assert entry.tree is None and entry.declined.startswith("FileNotFoundError")
    entry.abandon()  # (nothing to abandon: a no-op)


def test_a_record_vouches_as_the_verifier_trusts_it(tmp_path):
    data = tmp_path / "images" / "pages-1.img"
    data.parent.mkdir()
    data.write_bytes(b"x" * 4096)
    digest = hash_and_record(data)
    assert vouched_by_records([(data, digest)], {})
    assert verify_file(data, digest).method == "record"
    assert not vouched_by_records([(data, "0" * 64)], {})  # another digest
    assert not vouched_by_records([(tmp_path / "images" / "missing.img", digest)], {})
    data.write_bytes(b"y" * 4096)  # changed: its identity no longer the recorded one
    assert not vouched_by_records([(data, digest)], {})


def test_a_restore_record_elsewhere_vouches_too(tmp_path):
    """A moved artifact's files are vouched for by the records a restore keeps under its state root."""
    artifact, records = tmp_path / "artifact", tmp_path / "state" / "records" / "units"
    artifact.mkdir()
    records.mkdir(parents=True)
    data = artifact / "capsule.json"
    data.write_bytes(b"{}")
    digest = hash_and_record(data, records)
    assert not vouched_by_records([(data, digest)], {})
    assert vouched_by_records([(data, digest)], {artifact: records})


def test_a_malformed_record_vouches_for_nothing(tmp_path):
    data = tmp_path / "f"
    data.write_bytes(b"z")
    digest = hash_and_record(data)
    record = tmp_path / ".coldsnap-validation.json"
    document = json.loads(record.read_text())
    document["files"]["f"]["st_ino"] = str(document["files"]["f"]["st_ino"])
    record.write_text(json.dumps(document))
    assert not vouched_by_records([(data, digest)], {})
    record.write_text('{"format": 1, "files": {}, "format": 1}')  # a duplicate key: not strict JSON
    assert not vouched_by_records([(data, digest)], {})


def _imported_by_the_first_step(selected: str) -> str:
    """What ``selected`` (an expression over ``sys.modules``) prints after importing the first step alone."""
    code = f"import sys; import coldsnap.activation.early_restore; print({selected})"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          cwd=Path(__file__).resolve().parents[2]).stdout.strip()


def test_the_first_step_imports_no_pydantic_and_no_contract_model():
    assert _imported_by_the_first_step("sorted(m for m in sys.modules if m.startswith(('pydantic', 'coldsnap.contracts.')) "
                                       "and m != 'coldsnap.contracts.canonical')") == "[]"


def test_the_first_step_imports_nothing_only_a_dump_or_a_removal_needs():
    """What the first step imported before CRIU and did not use: the dump's page census (criu_pages),
    tempfile and its random (atomic writes), uuid and platform (a replica token, the host's facts)."""
    assert _imported_by_the_first_step("sorted(m for m in ('coldsnap.snapshot.criu_pages', 'tempfile', 'random', "
                                       "'uuid', 'platform') if m in sys.modules)") == "[]"


class _StagerStandIn:
    """Stands in for a WeightStager (which needs a GPU): records what the hand-off does to it."""

    def __init__(self):
        self.calls: list[str] = []

    def cancel(self):
        self.calls.append("cancel")

    def join(self):
        self.calls.append("join")
        return False

    def release(self):
        self.calls.append("release")


def test_a_rank_staged_by_the_entry_is_taken_only_where_admission_placed_it_alike():
    ranks = {0: _StagerStandIn(), 1: _StagerStandIn()}
    staging = early_restore.EarlyStaging(lambda: (dict(ranks), {0: 0, 1: 1}, {"GPU-x": 1 << 30}))
    assert staging.take(0, {0: 0, 1: 1}) is ranks[0]
    assert staging.take(0, {0: 0, 1: 1}) is None  # taken once
    assert staging.take(1, {0: 1, 1: 0}) is None  # placed otherwise: the restore stages it itself
    staging.drop()
    assert ranks[1].calls == ["cancel", "join", "release"] and ranks[0].calls == []


def test_a_staging_decision_that_fails_stages_nothing_and_says_why():
    def decide():
        raise RuntimeError("no NVML")

    staging = early_restore.EarlyStaging(decide).decided()
    assert staging.stagers == {} and staging.held == {} and "no NVML" in staging.skipped
    assert staging.take(0, {}) is None


@pytest.mark.parametrize("record, ok", [
    ({"backend": "cuda", "device": 0, "high_water": 1 << 30, "chunk_bytes": 2 << 20}, True),
    ({"backend": "cuda", "device": 0, "high_water": "1", "chunk_bytes": 2 << 20}, False),
    ({"backend": "cuda", "device": True, "high_water": 1, "chunk_bytes": 2}, False),
    ({"backend": "cuda", "device": 0, "high_water": -5, "chunk_bytes": 2}, False),
])
def test_region_facts_from_the_capsule_json_are_plain_integers(record, ok):
    if ok:
        region = early_restore._Region.of(record)
        assert (region.backend, region.high_water) == ("cuda", 1 << 30)
    else:
        with pytest.raises(ValueError):
            early_restore._Region.of(record)


def test_staging_imports_no_pydantic_until_it_hydrates():
    code = ("import sys; import coldsnap.activation.staging, coldsnap.activation.gpu_room, "
            "coldsnap.activation.restore_place; print(sorted(m for m in sys.modules if m.startswith('pydantic')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2]).stdout
    assert out.strip() == "[]"

"""Canonical JSON against the golden cross-language corpus."""

import hashlib

import pytest

from coldsnap.contracts import MemoryLayout, OperationRequest, SemanticManifest, resolve_request
from coldsnap.contracts.canonical import CanonicalJsonError, canonical_json, canonical_sha256


def test_corpus_cases_match_bytes_and_digests(corpus):
    cases = corpus["canonical_json"]["cases"]
    assert len(cases) >= 8
    for case in cases:
        encoded = canonical_json(case["value"])
        assert encoded.decode("utf-8") == case["canonical"], case["name"]
        assert hashlib.sha256(encoded).hexdigest() == case["sha256"], case["name"]
        assert canonical_sha256(case["value"]) == case["sha256"]


def test_corpus_rejects(corpus):
    for case in corpus["canonical_json"]["rejects"]:
        with pytest.raises(CanonicalJsonError):
            canonical_json(case["value"])


def test_keys_sort_by_utf16_code_units_not_code_points():
    # U+FF61 sorts after U+1F600 in UTF-16 (0xFF61 > 0xD83D) but before it by code point.
    assert canonical_json({"\uff61": 1, "\U0001F600": 2}) == '{"😀":2,"｡":1}'.encode()


def test_refuses_what_has_no_canonical_form():
    for bad in ({1: "int key"}, float("nan"), {"a": {1, 2}}, "\ud800"):
        with pytest.raises(CanonicalJsonError):
            canonical_json(bad)


def test_resolved_request_digest_is_stable(corpus):
    golden = corpus["request"]
    request = resolve_request(OperationRequest.model_validate(golden["input"]))
    assert request.canonical_json().decode() == golden["resolved_canonical"]
    assert request.canonical_sha256() == golden["sha256"]


def test_semantic_manifest_digest(corpus):
    request = resolve_request(OperationRequest.model_validate(corpus["request"]["input"]))
    manifest = SemanticManifest.from_request(request)
    assert manifest.to_json_value() == corpus["semantic_manifest"]["manifest"]
    assert manifest.canonical_sha256() == corpus["semantic_manifest"]["sha256"]


def test_semantic_manifest_ignores_placement(corpus):
    document = corpus["request"]["input"]
    moved = {**document, "units": [{**document["units"][0], "serving_port": 9000, "env": {"X": "1"}}]}
    moved["units"][0]["workers"] = [{"worker_id": "w0", "rank": 0, "device_slot": 3}]
    a = SemanticManifest.from_request(resolve_request(OperationRequest.model_validate(document)))
    b = SemanticManifest.from_request(resolve_request(OperationRequest.model_validate(moved)))
    assert a.canonical_sha256() == b.canonical_sha256()


def test_memory_layout_digest(corpus):
    layout = MemoryLayout.model_validate(corpus["memory_layout"]["layout"])
    assert layout.digest() == corpus["memory_layout"]["digest"]

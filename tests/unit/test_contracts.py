"""Strict decoding of every contract, and the invariants the models enforce."""

import json

import pytest
from pydantic import BaseModel

from coldsnap.contracts import (
    ArtifactDescriptor,
    ContractError,
    OperationReceipt,
    OperationRequest,
    UnsupportedRequest,
    build_capabilities,
    decode_document,
    resolve_request,
)
from coldsnap.contracts import artifact, capabilities, layout, receipt, request, timing_events
from tests.conftest import make_request

SHA = "ab" * 32


def _decode_request(document) -> OperationRequest:
    return decode_document(OperationRequest, json.dumps(document), "req.json")


def _problems(document) -> list[str]:
    with pytest.raises(ContractError) as caught:
        data = document if isinstance(document, (str, bytes)) else json.dumps(document)
        resolve_request(decode_document(OperationRequest, data, "req.json"))
    return caught.value.problems


def test_valid_request_decodes_and_resolves(request_document):
    resolved = resolve_request(_decode_request(request_document))
    assert resolved.policy.graphs.mode == "retain"  # n610 default
    assert resolved.policy.weights.mode == "auto"
    assert resolved.policy.weights.native_materialization == "off"  # the only mode this build runs
    assert resolved.policy.validation.expected_response == "coldsnap-cuda-snapshot-ok"


# What the contract can name but this build does not implement: refused by name, not as a parse error.
UNSUPPORTED = [
    ({"operation": "warm", "snapshot_driver": "n580"}, "operation: warm is not implemented in snapshot driver n580 (implemented: capture, restore)"),
    ({"operation": "sleep"}, "operation: sleep is not implemented in this build (implemented: capture, restore, warm, wake)"),
    ({"operation": "status"}, "operation: status is not implemented in this build (implemented: capture, restore, warm, wake)"),
    ({"policy": {"weights": {"native_materialization": "async"}}},
     "policy.weights.native_materialization: async is not implemented in this build for vllm (implemented: off)"),
    ({"policy": {"weights": {"mode": "cache-only-auto"}}},
     "policy.weights.mode: cache-only-auto is not implemented in this build (implemented: auto, native, recovery)"),
    ({"policy": {"weights": {"native_materialization": "required"}}},
     "policy.weights.native_materialization: required is not implemented in this build for vllm (implemented: off)"),
    ({"engine": "torch-lm", "policy": {"weights": {"native_materialization": "async"}}},
     "policy.weights.native_materialization: async is not implemented in this build for torch-lm (implemented: off)"),
]


@pytest.mark.parametrize("overrides, problem", UNSUPPORTED, ids=[p.split(" is ")[0] for _, p in UNSUPPORTED])
def test_what_this_build_does_not_implement_is_refused_with_request_unsupported(overrides, problem):
    decoded = _decode_request(make_request(**overrides))  # the contract parses it
    with pytest.raises(UnsupportedRequest) as caught:
        resolve_request(decoded)
    assert caught.value.code == "request.unsupported"
    assert caught.value.problems == [problem] and caught.value.message == problem


def test_every_unsupported_field_is_named():
    document = make_request(operation="status", engine="sglang", snapshot_driver="n580",
                            policy={"weights": {"native_materialization": "async"}})
    with pytest.raises(UnsupportedRequest) as caught:
        resolve_request(_decode_request(document))
    assert [p.split(":")[0] for p in caught.value.problems] == ["operation", "policy.weights.native_materialization"]


def test_explicit_off_materialization_is_accepted_for_every_engine():
    for engine in ("vllm", "torch-lm"):
        document = make_request(engine=engine, policy={"weights": {"native_materialization": "off"}})
        assert resolve_request(_decode_request(document)).policy.weights.native_materialization == "off"


def test_spelled_out_defaults_hash_like_omitted_ones(request_document):
    omitted = resolve_request(_decode_request(request_document))
    explicit = resolve_request(_decode_request(make_request(policy=omitted.policy.to_json_value())))
    assert omitted.canonical_sha256() == explicit.canonical_sha256()
    other = resolve_request(_decode_request(make_request(policy={"graphs": {"mode": "recreate"}})))
    assert other.canonical_sha256() != omitted.canonical_sha256()


@pytest.mark.parametrize(
    "document, expected",
    [
        (make_request(surprise=1), ["surprise: unknown field"]),
        (make_request(format=3), ["format: unsupported format 3 (supported: 4)"]),
        (make_request(format="4"), ['format: unsupported format "4" (supported: 4)']),
        ({k: v for k, v in make_request().items() if k != "format"}, ["format: missing required field (supported: 4)"]),
        ({k: v for k, v in make_request().items() if k != "engine"}, ["engine: missing required field"]),
        (make_request(prepare_only="yes"), ['prepare_only: input should be a valid boolean, got "yes"']),
        (make_request(engine="tgi"), ["engine: Input should be 'vllm', 'sglang' or 'torch-lm', got \"tgi\""]),
        (make_request(operation_id="../etc"), None),
        ("{not json", ["not JSON: Expecting property name enclosed in double quotes at line 1 column 2"]),
        ("[1, 2]", ["expected a JSON object, got list"]),
        ('{"format": 4, "format": 4}', ["duplicate key 'format'"]),
        ('{"format": NaN}', ["NaN is not allowed"]),
        (b"\xff\xfe", ["not UTF-8 (byte 0)"]),
    ],
)
def test_bad_requests_get_one_line_each(document, expected):
    problems = _problems(document)
    assert all("\n" not in p for p in problems)
    if expected is None:
        assert len(problems) == 1 and problems[0].startswith("operation_id:")
    else:
        assert problems == expected


def test_several_problems_are_all_listed():
    document = make_request(surprise=1, engine="tgi")
    del document["model"]
    problems = _problems(document)
    assert sorted(p.split(":")[0] for p in problems) == ["engine", "model", "surprise"]


def test_nested_unknown_field_has_its_path():
    document = make_request()
    document["units"][0]["workers"][0]["gpu"] = 1
    assert _problems(document) == ["units[0].workers[0].gpu: unknown field"]


def test_topology_rules():
    two = make_request()
    two["units"].append(dict(two["units"][0]))
    assert any("duplicate unit_id" in p for p in _problems(two))
    gap = make_request()
    gap["units"][0]["workers"][0]["rank"] = 1
    assert any("ranks must be 0..0" in p for p in _problems(gap))
    assert any("prepare_only applies to restore only" in p for p in _problems(make_request(operation="capture", prepare_only=True)))


def test_strict_types_are_not_coerced():
    document = make_request()
    document["units"][0]["serving_port"] = "8000"
    assert _problems(document) == ['units[0].serving_port: input should be a valid integer, got "8000"']


def _all_models():
    for module in (request, artifact, receipt, timing_events, capabilities, layout):
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, BaseModel) and value.__module__ == module.__name__:
                yield value


def test_every_field_of_every_contract_is_documented():
    models = list(_all_models())
    assert len(models) > 20
    for model in models:
        docs = model.field_docs()
        for name in model.model_fields:
            assert docs.get(name), f"{model.__name__}.{name} has no docstring"
        described = model.model_json_schema()["properties"]
        assert all(described[name].get("description") for name in model.model_fields), model.__name__
        assert model.model_config.get("extra") == "forbid", model.__name__


def test_capabilities_name_formats_and_features():
    caps = build_capabilities("0.1.0").to_json_value()
    assert caps["protocol"]["request_formats"] == [4]
    assert caps["protocol"]["artifact_formats"] == [9]
    assert caps["protocol"]["receipt_format"] == 2
    assert caps["protocol"]["timing_event_format"] == 1
    assert {"operation-timing-spans", "operation-timing-events-ndjson-v1"} <= set(caps["features"])


def test_capabilities_list_exactly_what_this_build_implements():
    caps = build_capabilities("0.1.0").to_json_value()
    assert [(d["name"], d["minimum_nvidia_driver"], d["default_graph_policy"]) for d in caps["snapshot_drivers"]] == [
        ("n580", 580, "recreate"), ("n610", 610, "retain")]
    assert {e["name"]: (e["python_package"], e["native_materialization"], e["default_native_materialization"])
            for e in caps["engines"]} == {"vllm": ("coldsnap_vllm", ["off"], "off"),
                                          "sglang": ("coldsnap_sglang", ["off"], "off"),
                                          "torch-lm": ("coldsnap.workloads.torch_lm", ["off"], "off")}
    assert caps["operations"] == {"capture": "conflicts-with-existing-output", "restore": "replacement-oriented",
                                  "warm": "convergent", "wake": "replacement-oriented"}


def test_everything_capabilities_lists_is_accepted():
    caps = build_capabilities("0.1.0").to_json_value()
    for driver in caps["snapshot_drivers"]:
        assert set(driver["operations"]) <= set(caps["operations"])
        for operation in driver["operations"]:
            for engine in caps["engines"]:
                for mode in engine["native_materialization"]:
                    document = make_request(operation=operation, engine=engine["name"], snapshot_driver=driver["name"],
                                            policy={"weights": {"native_materialization": mode}})
                    resolve_request(_decode_request(document))


def _file(path: str) -> dict:
    return {"path": path, "sha256": SHA, "size_bytes": 10}


def make_artifact(**overrides) -> dict:
    document = {
        "format": 9,
        "artifact_id": "cap-1",
        "created_unix_ns": 1,
        "engine": "vllm",
        "snapshot_driver": "n610",
        "request_sha256": SHA,
        "semantic_manifest_sha256": SHA,
        "model": {"name": "tiny", "revision": None},
        "graph_policy": "retain",
        "platform": {
            "arch": "x86_64",
            "kernel": "6.18.44",
            "nvidia_driver": "580.159.04",
            "nvidia_driver_floor": 580,
            "gpu_model": "NVIDIA H200",
            "compute_capability": "9.0",
            "criu_version": "4.2.1",
        },
        "canary": {"prompt": "p", "expected_response": "r", "token_ids": [1, 2]},
        "units": [
            {
                "unit_id": "unit-0",
                "capsule": _file("units/unit-0/capsule.tar"),
                "workers": [
                    {"worker_id": "w0", "rank": 0, "layout_digest": SHA, "residual": _file("units/unit-0/w0.residual"), "payload": None}
                ],
            }
        ],
    }
    document.update(overrides)
    return document


def test_artifact_round_trip_and_relative_paths():
    descriptor = decode_document(ArtifactDescriptor, json.dumps(make_artifact()))
    again = decode_document(ArtifactDescriptor, descriptor.canonical_json())
    assert again == descriptor
    for bad in ("/abs/capsule.tar", "../capsule.tar", "units/../../x", "a//b", "."):
        document = make_artifact()
        document["units"][0]["capsule"]["path"] = bad
        with pytest.raises(ContractError) as caught:
            decode_document(ArtifactDescriptor, json.dumps(document))
        assert caught.value.problems[0].startswith("units[0].capsule.path:"), bad


def test_artifact_format_8_is_refused_with_the_supported_list():
    with pytest.raises(ContractError) as caught:
        decode_document(ArtifactDescriptor, json.dumps(make_artifact(format=8)))
    assert caught.value.problems == ["format: unsupported format 8 (supported: 9)"]


def make_receipt(**overrides) -> dict:
    document = {
        "format": 2,
        "operation": "restore",
        "operation_id": "op-1",
        "request_sha256": SHA,
        "engine": "vllm",
        "snapshot_driver": "n610",
        "prepare_only": False,
        "state": "succeeded",
        "replay_semantics": "replacement-oriented",
        "started_unix_ns": 10,
        "finished_unix_ns": 20,
        "timing": {
            "clocks": [{"clock_id": "controller", "owner": "controller", "description": "c", "unix_origin_ns": 10}],
            "spans": [
                {"span_id": "s1", "parent_id": None, "name": "controller.restore", "clock_id": "controller",
                 "placement": "timeline", "start_ns": 0, "duration_ns": 10},
            ],
        },
    }
    document.update(overrides)
    return document


def test_receipt_invariants():
    decode_document(OperationReceipt, json.dumps(make_receipt()))
    cases = {
        "failed without error": make_receipt(state="failed"),
        "error on success": make_receipt(error={"code": "x", "message": "m"}),
        "time runs backwards": make_receipt(finished_unix_ns=5),
    }
    for name, document in cases.items():
        with pytest.raises(ContractError):
            decode_document(OperationReceipt, json.dumps(document))
    bad_clock = make_receipt()
    bad_clock["timing"]["spans"][0]["clock_id"] = "worker-0"
    with pytest.raises(ContractError) as caught:
        decode_document(OperationReceipt, json.dumps(bad_clock))
    assert "unknown clock 'worker-0'" in caught.value.problems[0]
    aggregate = make_receipt()
    aggregate["timing"]["spans"][0].update(placement="aggregate", start_ns=3)
    with pytest.raises(ContractError):
        decode_document(OperationReceipt, json.dumps(aggregate))

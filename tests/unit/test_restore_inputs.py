"""The restore's two ways in decide alike (coldsnap.activation.restore_inputs).

The differential table: for each artifact (one unit, one unit with its GPUs set at capture, a two-unit one, an
n580 template) and each command line (flags, units, ``oci://``, bad input), the program's fast entry
(``early_restore.entry_plan``: argv parsed by the CLI's own flag definitions, the artifact's plain JSON) and the
full path (the CLI's parser, its request builder, strict decoding, admission's ``restore_inputs``) are run on
the same files. Where the entry takes a restore, both must decide the same :class:`RestoreInputs`; where it
declines, it must say why; and it must never take what the full path refuses.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from coldsnap.activation import early_restore
from coldsnap.activation.admission import restore_inputs
from coldsnap.activation.artifact_dir import ArtifactDir
from coldsnap.activation.restore_inputs import RestoreInputs, decide, differences
from coldsnap.cli import _artifact_request, build_parser
from coldsnap.contracts.base import decode_document
from coldsnap.contracts.request import OperationRequest
from coldsnap.operation import UsageError
from tests.conftest import make_request

SHA = "a" * 64
MACHINE = os.uname().machine


def _capsule(unit_id: str, port: int, ranks: int = 1, template: bool = False, gpus: bool = False) -> dict:
    return {"format": 1, "unit_id": unit_id, "files": [{"path": "pages-1.img", "sha256": SHA, "size_bytes": 1}],
            "metadata": {
                "control": "@coldsnap-agent-0123456789abcdef", "serving_port": port, "root_pid": 10,
                "workers": [{"rank": rank, "control": f"@coldsnap-agent-0123456789abcdef.rank{rank}", "pid": 11 + rank,
                             "layout": {}, "layout_digest": SHA, "regions": {}, "graphs_released": []}
                            for rank in range(ranks)],
                "criu_options": [], "criu_tcp": "established", "gpu_pids": [11] if gpus else [],
                "gpu_uuids": ["GPU-a", "GPU-b"] if gpus else [],
                **({"template": {"control": "@coldsnap-template-0123456789abcdef", "placement_abi": 2,
                                 "preload": [], "command": ["vllm"], "nvidia_driver": None}} if template else {})}}


def _artifact(root: Path, *, units: int = 1, driver: str = "n610", visible: str | None = None, port: int = 8000,
              mode: str | None = None) -> Path:
    """An artifact's JSON (descriptor, capture request, capsules) as a capture writes it; no images."""
    unit_ids = [f"unit-{k}" for k in range(units)]
    request_units = [{"unit_id": unit_id, "command": ["vllm", "serve", "m", "--load-format", "coldsnap"],
                      "serving_port": port if k == 0 else None,
                      "workers": [{"worker_id": f"w{k}", "rank": k, "device_slot": 0}],
                      **({"env": {"CUDA_VISIBLE_DEVICES": visible}} if visible else {})}
                     for k, unit_id in enumerate(unit_ids)]
    captured = make_request(operation="capture", snapshot_driver=driver, units=request_units, artifact=str(root),
                            **({"policy": {"weights": {"mode": mode}}} if mode else {}))
    descriptor = {
        "format": 9, "artifact_id": "cap-1", "created_unix_ns": 1, "engine": "vllm", "snapshot_driver": driver,
        "request_sha256": SHA, "semantic_manifest_sha256": SHA, "model": {"name": "m", "revision": None},
        "graph_policy": "retain",
        "platform": {"arch": MACHINE, "kernel": "6.1", "nvidia_driver": None, "nvidia_driver_floor": None,
                     "gpu_model": None, "compute_capability": None, "criu_version": "4.2.1"},
        "canary": {"prompt": "p", "expected_response": "r", "token_ids": [1, 2]},
        "units": [{"unit_id": unit_id, "capsule": {"path": f"units/{unit_id}/capsule.json", "sha256": SHA,
                                                   "size_bytes": 1},
                   "workers": [{"worker_id": f"w{k}", "rank": k, "layout_digest": SHA, "payload": None,
                                "residual": {"path": f"payload/{k}.residual", "sha256": SHA, "size_bytes": 1}}]}
                  for k, unit_id in enumerate(unit_ids)],
    }
    root.mkdir()
    (root / "artifact.json").write_text(json.dumps(descriptor))
    (root / "request.json").write_text(json.dumps(captured))
    for k, unit_id in enumerate(unit_ids):
        (root / "units" / unit_id).mkdir(parents=True)
        capsule = _capsule(unit_id, port, template=driver == "n580", gpus=visible is not None)
        (root / "units" / unit_id / "capsule.json").write_text(json.dumps(capsule))
    return root


def _full_path(root: Path, argv: list[str]) -> RestoreInputs | str:
    """Admission's decision: the CLI's parser and request, strictly decoded, then ``admission.restore_inputs``;
    the usage error's text where the CLI refuses the command line. The same decided from the plain JSON of those
    files (as the entry reads them) must agree: no field is read by a name the contracts do not have."""
    try:
        args = build_parser().parse_args(["restore", *[str(root) if a == "ART" else a for a in argv]])
    except SystemExit:
        return "usage"
    if args.artifact is None:
        return "usage: no artifact"
    try:
        document = _artifact_request(args, "restore")
    except UsageError as exc:
        return f"usage: {exc}"
    request = decode_document(OperationRequest, json.dumps(document))
    artifact = ArtifactDir(root)
    descriptor = artifact.load()
    unit = descriptor.units[request.unit.index if request.unit else 0]
    admitted = restore_inputs(SimpleNamespace(request=request), artifact, descriptor, artifact.read_capsule(unit.unit_id))
    plain = decide(document, json.loads(artifact.request_path.read_text()), json.loads(artifact.descriptor_path.read_text()),
                   json.loads(artifact.capsule_path(unit.unit_id).read_text()), root)
    assert differences(plain, admitted) == [], argv
    return admitted


def _entry(root: Path, argv: list[str]) -> RestoreInputs | str:
    """The fast entry's decision, or ``declined: why``."""
    try:
        return early_restore.entry_plan([str(root) if a == "ART" else a for a in argv]).inputs
    except early_restore._Declined as exc:
        return f"declined: {exc}"


ARTIFACTS = {
    "one unit": {},
    "one unit, GPUs set at capture": {"visible": "0,1"},
    "one unit, weights recovery at capture": {"mode": "recovery"},
    "two units": {"units": 2},
    "n580 template": {"driver": "n580"},
}
COMMAND_LINES = [
    ["ART"],
    ["ART", "--port", "9100"],
    ["ART", "--port=9100", "--gpu", "1"],
    ["ART", "--gpu", "GPU-b,GPU-a"],
    ["ART", "--weights", "native"],
    ["ART", "--weights", "recovery", "--port", "8000"],
    ["ART", "--state-dir", "/tmp/s", "--operation-id", "op-7", "--receipt-json", "-"],
    ["ART", "--port", "1", "--port", "9200"],
    ["ART", "--prepare-only"],
    ["ART", "--owner", "0:0"],
    ["ART", "--units", "2", "--unit", "1", "--rendezvous", "h:29600", "--rendezvous-token-file", "/t"],
    ["ART", "--units", "2", "--unit", "0", "--rendezvous", "h:29600", "--rendezvous-token-file", "/t", "--port", "9300"],
    ["oci://registry.example/m@sha256:" + "0" * 64],
    ["ART", "--port", "0"],
    ["ART", "--weights", "sideways"],
    [],
]


def test_the_fast_entry_and_admission_decide_alike(tmp_path):
    """Over every artifact and command line of the table: 0 disagreements, and every decline has its reason."""
    disagreements, taken, declined = [], 0, 0
    for name, shape in ARTIFACTS.items():
        root = _artifact(tmp_path / name.replace(" ", "-").replace(",", ""), **shape)
        for argv in COMMAND_LINES:
            entry, full = _entry(root, argv), _full_path(root, argv)
            case = f"{name}: {' '.join(argv)}"
            if isinstance(entry, str):
                declined += 1
                if not entry.removeprefix("declined: ").strip():
                    disagreements.append(f"{case}: declined without a reason")
            elif isinstance(full, str):
                disagreements.append(f"{case}: the entry takes it, the full path refuses it ({full})")
            elif differences(entry, full):
                disagreements.append(f"{case}: {'; '.join(differences(entry, full))}")
            else:
                taken += 1
    assert disagreements == []
    assert taken >= 20 and declined >= 30  # (the table exercises both)


def test_the_decision_follows_the_request():
    """The rules themselves: the port asked for, else unit 0's, else the captured one; the weights' mode, else
    auto; the GPUs asked for beside the capture's; the unit a selection names."""
    capsule = _capsule("unit-1", 8000, ranks=2)
    descriptor = {"units": [{"unit_id": "unit-0"}, {"unit_id": "unit-1"}]}
    request = {"units": [{"serving_port": 9000}, {"serving_port": None, "env": {"CUDA_VISIBLE_DEVICES": "1"}}],
               "unit": {"index": 1}, "policy": {"weights": {"mode": "native"}}}
    captured = {"units": [{}, {"env": {"CUDA_VISIBLE_DEVICES": "0"}}]}
    inputs = decide(request, captured, descriptor, capsule, Path("/a"))
    assert (inputs.unit_index, inputs.unit_id, inputs.serving_port, inputs.captured_port) == (1, "unit-1", 9000, 8000)
    assert (inputs.weights_mode, inputs.gpus, inputs.captured_gpus) == ("native", "1", "0")
    assert [rank for rank, _ in inputs.controls] == [0, 1]
    plain = decide({"units": [{}]}, None, {"units": [{"unit_id": "unit-0"}]}, _capsule("unit-0", 8000), Path("/a"))
    assert (plain.serving_port, plain.weights_mode, plain.gpus, plain.captured_gpus) == (8000, "auto", None, None)
    with pytest.raises(ValueError):
        decide({"units": [{}], "policy": {"weights": {"mode": "x"}}}, None, descriptor, capsule, Path("/a"))


def test_admission_abandons_an_entry_that_decided_otherwise():
    """An entry tree for another port is abandoned at admission, and the receipt's span says how it differed."""
    from coldsnap.activation import admission

    decided = decide({"units": [{"serving_port": 9000}]}, None, {"units": [{"unit_id": "unit-0"}]},
                     _capsule("unit-0", 8000), Path("/a"))
    other = copy.replace(decided, serving_port=9001) if hasattr(copy, "replace") else \
        RestoreInputs(**{**decided.__dict__, "serving_port": 9001})
    abandoned = []
    tree = SimpleNamespace(settled=False, inputs=decided, artifact_id="x", abandon=lambda: abandoned.append(True))
    span: dict = {}
    artifact = SimpleNamespace(root=Path("/a"))
    original = admission.artifact_id
    admission.artifact_id = lambda root: "x"
    try:
        assert admission._adopted(SimpleNamespace(tree=tree), other, artifact, span) is None
        assert abandoned == [True]
        assert "serving_port 9000, admission 9001" in span["early_restore_declined"]
        tree.settled, abandoned[:] = False, []
        assert admission._adopted(SimpleNamespace(tree=tree), decided, artifact, {}) is tree and abandoned == []
    finally:
        admission.artifact_id = original

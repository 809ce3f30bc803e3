"""Snapshot driver n580 with real CRIU on the reference workload: `coldsnap capture --driver n580` dumps
the pre-CUDA template (torch and the model code imported), `coldsnap restore --port P` places one image
on two ports in turn, each serving the cold start's greedy tokens with its weights hydrated from the
native pack at load time; the artifact is never written; a template holding an NVIDIA userspace-driver
mapping is refused at capture, and a template of a placement ABI this build cannot give (or an ABI-1
one under another NVIDIA driver) at admission, with nothing started."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import pytest

from coldsnap.activation.canary import ask_canary
from coldsnap.activation.restore_place import port_free
from coldsnap.demo import CHECK_PROMPT, cold_start
from tests.helpers import coldsnap_receipt, file_digests, free_port
from tests.processes import kill_replicas

pytestmark = [
    pytest.mark.criu,
    pytest.mark.skipif(os.geteuid() != 0, reason="CRIU dump/restore needs root"),
]
pytest.importorskip("torch")


def _workload(port: int) -> list[str]:
    return [sys.executable, "-m", "coldsnap.workloads.torch_lm", "--size", "tiny", "--device", "cpu", "--port", str(port)]


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    work = tmp_path_factory.mktemp("n580")
    port = free_port()
    _, tokens = cold_start(_workload(port), port)
    done, receipt = coldsnap_receipt("capture", "--driver", "n580", "--out", str(work / "artifact"), "--", *_workload(port))
    assert done.returncode == 0, done.stderr[-3000:]
    assert receipt["snapshot_driver"] == "n580" and port_free(port)  # nothing of the engine left running
    return work / "artifact", tokens


def test_one_template_is_placed_on_two_ports_and_serves_the_cold_starts_tokens(captured):
    artifact, tokens = captured
    capsule = json.loads((artifact / "units" / "unit-0" / "capsule.json").read_text())["metadata"]
    assert capsule["template"]["placement_abi"] == 2 and capsule["gpu_pids"] == []
    assert capsule["template"]["preload"] == ["torch", "coldsnap.workloads.torch_lm.serve"]
    before = file_digests(artifact)
    for _ in range(2):
        port = free_port()
        done, receipt = coldsnap_receipt("restore", str(artifact), "--port", str(port))
        try:
            assert done.returncode == 0, done.stderr[-3000:]
            assert receipt["state"] == "succeeded" and receipt["snapshot_driver"] == "n580" and receipt["warnings"] == []
            spans = {s["name"]: s for s in receipt["timing"]["spans"]}
            assert spans["restore.place"]["attributes"] == {"serving_port": port}
            assert {"restore.criu_restore", "restore.engine_start", "restore.canary"} <= set(spans)
            assert ask_canary(port, CHECK_PROMPT, 8).token_ids == tokens
            log = (Path(spans["restore.criu_restore"]["attributes"]["state_dir"]) / "logs" / "unit-0.log").read_text()
            assert "bytes of weights hydrated from" in log  # the pack, at load time
        finally:
            kill_replicas(artifact)
    assert file_digests(artifact) == before


def _with_template(artifact: Path, copy: Path, **template) -> Path:
    """A copy of ``artifact`` whose capsule records ``template`` changes, its descriptor re-bound to it."""
    import shutil

    shutil.copytree(artifact, copy)
    capsule_path = copy / "units" / "unit-0" / "capsule.json"
    capsule = json.loads(capsule_path.read_text())
    capsule["metadata"]["template"].update(template)
    capsule_path.write_text(json.dumps(capsule))
    descriptor_path = copy / "artifact.json"
    descriptor = json.loads(descriptor_path.read_text())
    descriptor["units"][0]["capsule"].update(sha256=hashlib.sha256(capsule_path.read_bytes()).hexdigest(),
                                             size_bytes=capsule_path.stat().st_size)
    descriptor_path.write_text(json.dumps(descriptor))
    return copy


@pytest.mark.parametrize("template, problem", [
    ({"placement_abi": 3}, "the template speaks placement ABI 3; this build speaks 1, 2"),
    ({"placement_abi": 1, "nvidia_driver": "580.159.04"},
     "a placement-ABI-1 template (it maps the NVIDIA userspace driver's libraries) captured under driver 580.159.04 "
     "cannot be restored under"),
], ids=["unknown-abi", "abi1-other-driver"])
def test_a_placement_the_template_cannot_take_is_refused_at_admission(captured, tmp_path, template, problem):
    artifact = _with_template(captured[0], tmp_path / "artifact", **template)
    port = free_port()
    done, receipt = coldsnap_receipt("restore", str(artifact), "--port", str(port))
    assert done.returncode == 1 and receipt["error"]["code"] == "admission.placement", done.stderr[-2000:]
    assert problem in receipt["error"]["message"]
    assert not any(s["name"] == "restore.criu_restore" for s in receipt["timing"]["spans"])  # nothing started
    assert port_free(port)


FAKE_DRIVER_MAPPING = """
import mmap, os
_path = os.path.join(os.environ["FAKE_DRIVER_DIR"], "libnvidia-fake.so.580")
with open(_path, "wb") as f:
    f.write(b"\\0" * 4096)
_file = open(_path, "rb")
_map = mmap.mmap(_file.fileno(), 4096, prot=mmap.PROT_READ)
"""


def test_a_template_holding_an_nvidia_driver_mapping_is_refused_at_capture(tmp_path):
    (tmp_path / "maps_a_driver_library.py").write_text(FAKE_DRIVER_MAPPING)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}", "FAKE_DRIVER_DIR": str(tmp_path)}
    port = free_port()
    done, receipt = coldsnap_receipt("capture", "--driver", "n580", "--preload", "maps_a_driver_library",
                              "--out", str(tmp_path / "artifact"), "--", *_workload(port), env=env)
    assert done.returncode == 1 and receipt["error"]["code"] == "capture.template_nvidia", done.stderr[-2000:]
    assert "libnvidia-fake.so.580" in receipt["error"]["message"] and "--placement-abi 1" in receipt["error"]["message"]
    assert not (tmp_path / "artifact" / "artifact.json").exists() and not (tmp_path / "artifact" / "units").exists()
    assert port_free(port)

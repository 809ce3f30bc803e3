"""No secret in a capsule, with real CRIU: the captured command starts without the launcher's secret-bearing
variables (their values are nowhere in the artifact, by the scan and by a raw search of every byte), ``--env NAME``
passes one on and the artifact says so, publish refuses such an artifact before anything is sent, and an
artifact whose descriptor has no environment record (an older build's) still restores."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import coldsnap_receipt, free_port
from tests.processes import kill_replicas

pytestmark = [pytest.mark.criu, pytest.mark.skipif(os.geteuid() != 0, reason="CRIU needs root")]

# values of the formats the scan knows, as an operator's environment holds them
SECRETS = {
    "HF_TOKEN": "hf_" + "QwErTyUiOpAsDfGhJkLzXcVbNmQwErTyUi",
    "MY_API_KEY": "sk-proj-" + "Zx9Kq2Lm7Np4Rs1Tv6Wy3Ab8Cd5Ef0GhIjKl",
    "AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYzzKEYvalue",
    "GITHUB_TOKEN": "ghp_" + "a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8",
}


def _workload(port: int) -> list[str]:
    return [sys.executable, "-m", "coldsnap.workloads.torch_lm", "--size", "tiny", "--device", "cpu", "--port", str(port)]


def _capture(artifact: Path, *flags: str) -> tuple[object, dict, int]:
    port = free_port()
    done, receipt = coldsnap_receipt("capture", "--out", str(artifact), *flags, "--", *_workload(port),
                                     env={**os.environ, **SECRETS})
    assert done.returncode == 0, done.stderr
    return done, receipt, port


def _holding(root: Path, value: str) -> list[str]:
    """Every file under ``root`` whose raw bytes hold ``value`` (grep -rl)."""
    return [str(p.relative_to(root)) for p in sorted(root.rglob("*")) if p.is_file() and value.encode() in p.read_bytes()]


def _span(receipt: dict, name: str) -> dict:
    return next(s["attributes"] for s in receipt["timing"]["spans"] if s["name"] == name)


def test_a_capture_holds_none_of_the_launchers_secrets(tmp_path):
    artifact = tmp_path / "artifact"
    done, receipt, _ = _capture(artifact)
    for name, value in SECRETS.items():
        assert _holding(artifact, value) == [], name
    withheld = ["AWS_SECRET_ACCESS_KEY", "GITHUB_TOKEN", "HF_TOKEN", "MY_API_KEY"]
    record = json.loads((artifact / "artifact.json").read_text())["units"][0]["environment"]
    assert set(withheld) <= set(record["withheld"]) and record["held"] == []
    assert set(withheld) <= set(_span(receipt, "capture.launch")["env_withheld"].split(","))
    assert "the command starts without" in done.stderr and "HF_TOKEN" in done.stderr
    assert not any(value in done.stderr + done.stdout for value in SECRETS.values())  # names, never values
    # and the scan, with the same variables set, finds nothing either
    scan = subprocess.run([sys.executable, "-m", "coldsnap", "validate", "secrets", str(artifact), "--json"],
                          capture_output=True, text=True, env={**os.environ, **SECRETS}, timeout=120)
    report = json.loads(scan.stdout)
    assert scan.returncode == 0 and report["clean"] and report["findings"] == [], scan.stderr
    assert set(SECRETS) <= set(report["values_searched"]) and report["bytes_scanned"] > 100 << 20


def test_env_passes_one_on_and_publish_refuses_the_artifact(tmp_path):
    artifact = tmp_path / "artifact"
    done, receipt, _ = _capture(artifact, "--env", "HF_TOKEN")
    assert any(path.startswith("units/unit-0/images/pages-") for path in _holding(artifact, SECRETS["HF_TOKEN"]))
    assert _holding(artifact, SECRETS["MY_API_KEY"]) == []
    record = json.loads((artifact / "artifact.json").read_text())["units"][0]["environment"]
    assert record["held"] == ["HF_TOKEN"] and "HF_TOKEN" not in record["withheld"]
    assert json.loads((artifact / "request.json").read_text())["units"][0]["pass_env"] == ["HF_TOKEN"]
    assert "the capsule holds HF_TOKEN" in done.stderr
    assert _span(receipt, "capture.launch")["env_held"] == "HF_TOKEN"

    # refused before any registry is asked (this one does not exist): the record and the scan both say why
    publish = subprocess.run([sys.executable, "-m", "coldsnap", "publish", str(artifact), "127.0.0.1:9/team/x:v1"],
                             capture_output=True, text=True, env={**os.environ, **SECRETS}, timeout=120)
    assert publish.returncode == 1, publish.stderr
    assert "the capsule holds HF_TOKEN" in publish.stderr and "refused" in publish.stderr
    assert "huggingface" in publish.stderr and "value of $HF_TOKEN" in publish.stderr
    assert SECRETS["HF_TOKEN"] not in publish.stderr + publish.stdout
    # the scan alone (no HF_TOKEN in its environment) still finds the token by its format
    scan = subprocess.run([sys.executable, "-m", "coldsnap", "validate", "secrets", str(artifact)],
                          capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k not in SECRETS})
    assert scan.returncode == 1 and ": huggingface" in scan.stderr and "pages-" in scan.stderr


def test_a_request_naming_a_secret_value_or_the_served_key_is_refused(tmp_path):
    done, receipt = coldsnap_receipt("capture", "--engine", "vllm", "--reference", "none", "--out",
                                     str(tmp_path / "artifact"), "--port", str(free_port()), "--", "vllm", "serve", "M",
                                     "--api-key", "k3y")
    assert done.returncode == 1 and receipt["error"]["code"] == "capture.secret", done.stderr
    assert "--api-key-file" in receipt["error"]["message"] and "k3y" not in receipt["error"]["message"]
    assert not (tmp_path / "artifact").exists()
    bad = coldsnap_receipt("capture", "--out", str(tmp_path / "a"), "--env", "HF_TOKEN=hf_x", "--", "true")[0]
    assert bad.returncode == 2 and "give the name, never the value" in bad.stderr


def test_an_artifact_without_an_environment_record_restores(tmp_path):
    """What a build before the record wrote: no ``environment`` in its units (and no ``pass_env``)."""
    artifact = tmp_path / "artifact"
    _, _, port = _capture(artifact)
    descriptor = json.loads((artifact / "artifact.json").read_text())
    for unit in descriptor["units"]:
        del unit["environment"]
    (artifact / "artifact.json").write_text(json.dumps(descriptor))
    try:
        done, receipt = coldsnap_receipt("restore", str(artifact), "--port", str(free_port()))
        assert done.returncode == 0 and receipt["state"] == "succeeded", done.stderr
    finally:
        kill_replicas(artifact)

"""The native probe and doctor on a real GPU host (H200). Each check runs in its own process."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu


def _python(code: str) -> dict:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_probe_sees_the_gpus_and_the_checkpoint_api():
    probe = _python("import json; from coldsnap import _C; print(json.dumps(_C.cuda_probe()))")
    assert probe["available"] is True, probe["reason"]
    assert probe["reason"] == "" and probe["library"]
    assert probe["driver_version"] >= 12080  # the checkpoint API needs CUDA driver API 12.8+
    assert probe["checkpoint_api"] is True and probe["vmm_api"] is True
    assert probe["devices"], "no devices enumerated"
    for device in probe["devices"]:
        assert device["uuid"].startswith("GPU-") and len(device["uuid"]) == 40
        assert device["total_memory_bytes"] > 2**30
        major, minor = device["compute_capability"].split(".")
        assert int(major) >= 7 and minor.isdigit()


def test_driver_version_matches_probe():
    both = _python(
        "import json; from coldsnap import _C; print(json.dumps([_C.driver_version(), _C.cuda_probe()['driver_version']]))"
    )
    assert both[0] == both[1] > 0


def test_doctor_reports_driver_gpus_and_the_implemented_snapshot_drivers():
    result = subprocess.run([sys.executable, "-m", "coldsnap", "doctor", "--json"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["nvidia_driver"] and int(report["nvidia_driver"].split(".")[0]) >= 580
    assert report["cuda"]["available"] and report["cuda"]["checkpoint_api"]
    assert report["criu"]["check_ok"], report["criu"]
    # On a driver below 610, the floor is n610's only problem; n580 (driver 580+, no CUDA state moved) is usable.
    assert set(report["snapshot_drivers"]) == {"n580", "n610"}
    assert report["snapshot_drivers"]["n580"] == {"usable": True, "problems": []}
    assert all(p.startswith("NVIDIA driver ") for p in report["snapshot_drivers"]["n610"]["problems"]), report

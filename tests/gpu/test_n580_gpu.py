"""Snapshot driver n580 on a real GPU: the reference workload's pre-CUDA template captured — placement
ABI 2 importing nothing of torch (a CUDA torch maps libcuda when it is imported: cuBLASLt loads it), and
ABI 1 importing torch and the model code — restored on another port (and, with two GPUs, onto the other
GPU), serving the cold start's greedy tokens eagerly first and through the decode graph it captures
after its first answer, with no unqualified-driver warning on a 580 driver; an
ABI-2 template that imports torch, and an ABI-1 one whose preload initializes CUDA, are refused."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from coldsnap.activation.canary import ask_canary
from coldsnap.demo import CHECK_PROMPT, cold_start
from tests.gpu.gpu_checks import _free_port
from tests.processes import kill_replicas

pytestmark = pytest.mark.gpu


def _workload(port: int) -> list[str]:
    return [sys.executable, "-m", "coldsnap.workloads.torch_lm", "--size", "tiny", "--device", "cuda", "--port", str(port)]


def _coldsnap(*args: str, env: dict | None = None) -> tuple[subprocess.CompletedProcess, dict]:
    command, rest = args[0], args[1:]  # the receipt flag before a capture's `-- CMD`
    done = subprocess.run([sys.executable, "-m", "coldsnap", command, "--receipt-json", "-", *rest], capture_output=True,
                          text=True, timeout=600, env=env)
    return done, json.loads(done.stdout) if done.stdout.strip() else {}


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


@pytest.fixture(scope="module", params=[("2", ""), ("1", None)], ids=["abi2-no-preload", "abi1-torch-preloaded"])
def captured(request, tmp_path_factory):
    abi, preload = request.param
    work = tmp_path_factory.mktemp(f"n580-abi{abi}")
    port = _free_port()
    _, tokens = cold_start(_workload(port), port)
    done, receipt = _coldsnap("capture", "--driver", "n580", "--placement-abi", abi,
                              *(["--preload", preload] if preload is not None else []),
                              "--out", str(work / "artifact"), "--", *_workload(port))
    assert done.returncode == 0, done.stderr[-3000:]
    assert receipt["snapshot_driver"] == "n580" and receipt["warnings"] == [], receipt  # qualified on 580+
    return work / "artifact", tokens


@pytest.mark.parametrize("gpu", ["0", "1"])
def test_an_n580_capture_restores_on_another_port_and_gpu_with_the_cold_starts_tokens(captured, gpu):
    artifact, tokens = captured
    if int(gpu) >= _gpu_count():
        pytest.skip(f"GPU {gpu}: this host has {_gpu_count()} GPU(s) (the x2 host runs it)")
    port = _free_port()
    done, receipt = _coldsnap("restore", str(artifact), "--port", str(port), "--gpu", gpu)
    try:
        assert done.returncode == 0, done.stderr[-3000:]
        assert receipt["state"] == "succeeded" and receipt["warnings"] == [], receipt
        place = next(s for s in receipt["timing"]["spans"] if s["name"] == "restore.place")
        assert place["attributes"] == {"serving_port": port, "visible_devices": gpu}
        assert ask_canary(port, CHECK_PROMPT, 8).token_ids == tokens
        # The restored engine runs on the GPU it was placed on (it logs the device's UUID).
        uuid = subprocess.run([sys.executable, "-c", f"import torch; print(torch.cuda.get_device_properties({gpu}).uuid)"],
                              capture_output=True, text=True, timeout=120).stdout.strip()
        restored = next(s for s in receipt["timing"]["spans"] if s["name"] == "restore.criu_restore")
        log = (Path(restored["attributes"]["state_dir"]) / "logs" / "unit-0.log").read_text()
        assert f"(GPU-{uuid})" in log, log[-2000:]
        # Graph policy recreate (n580's default): served eagerly (the canary), the decode graph captured after
        deadline = time.monotonic() + 30
        while "decode graph captured after the first answer" not in log and time.monotonic() < deadline:
            time.sleep(0.2)
            log = (Path(restored["attributes"]["state_dir"]) / "logs" / "unit-0.log").read_text()
        assert "decode graph captured after the first answer" in log, log[-2000:]
        assert ask_canary(port, CHECK_PROMPT, 8).token_ids == tokens  # through the graph now
    finally:
        kill_replicas(artifact)


def test_an_abi2_template_that_imports_a_cuda_torch_is_refused(tmp_path):
    done, receipt = _coldsnap("capture", "--driver", "n580", "--out", str(tmp_path / "artifact"), "--",
                              *_workload(_free_port()))  # the default preload: torch and the model code
    assert done.returncode == 1 and receipt["error"]["code"] == "capture.template_nvidia", done.stderr[-2000:]
    assert "libcuda" in receipt["error"]["message"] and "--placement-abi 1" in receipt["error"]["message"]
    assert not (tmp_path / "artifact" / "artifact.json").exists() and not (tmp_path / "artifact" / "units").exists()


def test_an_abi1_template_that_initializes_cuda_at_import_is_refused(tmp_path):
    (tmp_path / "cuda_at_import.py").write_text("import torch\ntorch.cuda.init()\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}"}
    done, receipt = _coldsnap("capture", "--driver", "n580", "--placement-abi", "1", "--preload", "torch,cuda_at_import",
                              "--out", str(tmp_path / "artifact"), "--", *_workload(_free_port()), env=env)
    assert done.returncode == 1 and receipt["error"]["code"] == "capture.template_nvidia", done.stderr[-2000:]
    assert "/dev/nvidia" in receipt["error"]["message"]
    assert not (tmp_path / "artifact" / "artifact.json").exists() and not (tmp_path / "artifact" / "units").exists()

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

HAS_NVIDIA_DRIVER = Path("/proc/driver/nvidia/version").exists()


def pytest_collection_modifyitems(config, items):
    # GPU tests run on the GPU test host only (scripts/gpu-test.sh); elsewhere they are skipped, not failed.
    if HAS_NVIDIA_DRIVER:
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU: run scripts/gpu-test.sh on the GPU test host")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="session", autouse=True)
def state_root_of_the_session():
    """Every restore of the run keeps its state (replica folders, CRIU logs, per-boot host facts) in one
    folder of its own, removed at the end: the host's /run/coldsnap never collects the state of
    artifacts the tests have long deleted. A test that sets COLDSNAP_STATE_DIR itself still wins."""
    if os.environ.get("COLDSNAP_STATE_DIR"):
        yield
        return
    root = tempfile.mkdtemp(prefix="coldsnap-test-state-")
    os.environ["COLDSNAP_STATE_DIR"] = root
    try:
        yield
    finally:
        del os.environ["COLDSNAP_STATE_DIR"]
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def corpus() -> dict:
    return json.loads((FIXTURES / "cross-language-v1.json").read_text(encoding="utf-8"))


def make_request(**overrides) -> dict:
    """A valid request format 4 document, as a manager would send it."""
    document = {
        "format": 4,
        "operation": "restore",
        "operation_id": "op-1",
        "engine": "vllm",
        "snapshot_driver": "n610",
        "model": {"name": "tiny-llama", "revision": None},
        "units": [
            {
                "unit_id": "unit-0",
                "command": ["vllm", "serve", "tiny-llama", "--load-format", "coldsnap"],
                "serving_port": 8000,
                "workers": [{"worker_id": "w0", "rank": 0, "device_slot": 0}],
            }
        ],
        "artifact": "/tmp/artifact",
    }
    document.update(overrides)
    return document


@pytest.fixture
def request_document() -> dict:
    return make_request()


@pytest.fixture
def fresh_regions():
    """Stable regions are process-wide: each test that reserves them starts and ends with none."""
    from coldsnap.memory import release_all

    release_all()
    yield
    release_all()

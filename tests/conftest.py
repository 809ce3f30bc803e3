import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest

from coldsnap.host import pid_alive

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


# What the run's processes leave behind goes into folders of the run's own, removed at its end: restores'
# state (replica folders, CRIU logs, per-boot host facts: COLDSNAP_STATE_DIR) and the engines' and
# workloads' temporary files (TMPDIR of every process the tests start: vLLM's ZeroMQ socket files, one
# set per server and restored replica, piled up in /tmp by the hundred). pytest itself keeps /tmp
# (tempfile's folder is fixed first), and a COLDSNAP_STATE_DIR or TMPDIR set by the caller wins. The
# folders carry the run's pid: a run killed before its end (SIGTERM, SIGKILL) is swept by the next one.
_RUN_FOLDERS: list[str] = []
_RUN_FOLDER = re.compile(r"coldsnap-test-(?:state|tmp)-(\d+)-.+")


def _sweep_killed_runs() -> None:
    for path in Path(tempfile.gettempdir()).glob("coldsnap-test-*"):
        match = _RUN_FOLDER.fullmatch(path.name)
        if match and not pid_alive(int(match.group(1))):
            shutil.rmtree(path, ignore_errors=True)


def pytest_configure(config):
    tempfile.gettempdir()  # pytest's own temporary folders stay where they were
    _sweep_killed_runs()
    for variable, prefix in (("COLDSNAP_STATE_DIR", "coldsnap-test-state-"), ("TMPDIR", "coldsnap-test-tmp-")):
        if not os.environ.get(variable):
            os.environ[variable] = tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-")
            _RUN_FOLDERS.append(variable)


def pytest_unconfigure(config):
    for variable in _RUN_FOLDERS:
        shutil.rmtree(os.environ.pop(variable), ignore_errors=True)
    _RUN_FOLDERS.clear()


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


@pytest.fixture(autouse=True)
def _flags_given_in_process():
    """A command run in this process (``coldsnap.cli.main``) gives its flags' settings to this process only
    (:meth:`coldsnap.settings.SettingsRegistry.give`): none outlives its test."""
    yield
    from coldsnap.settings import SETTINGS

    SETTINGS._given.clear()

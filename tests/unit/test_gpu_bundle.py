"""The GPU bundle never shadows a package the GPU test host has with an older copy (scripts/gpu-bundle-wheels.py):
its selection against the host's documented package list (scripts/h200-host-packages.txt), and against what
a python really has, as gpu-test.sh asks on the host. No GPU, no download: wheels are named, not built."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
pytest.importorskip("packaging")


def _bundle_wheels():
    spec = importlib.util.spec_from_file_location("gpu_bundle_wheels", SCRIPTS / "gpu-bundle-wheels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_documented_host_package_list_parses():
    from packaging.version import Version

    bundle = _bundle_wheels()
    host = bundle.read_host_packages()
    header = "".join(line for line in bundle.HOST_PACKAGES.read_text().splitlines() if line.startswith("#"))
    assert "KINDS.md" in header and "2026-" in header  # it names its source and when it was read
    assert host["torch"] == Version("2.11.0") and host["numpy"] == Version("2.5.2")
    assert host["huggingface-hub"] == Version("1.33.0")  # names normalized
    assert "typing-extensions" in host and host["typing-extensions"] is None  # there, version not documented
    assert "pydantic" not in host and "pyzmq" not in host  # what the bundle is for
    assert len(host) > 150


@pytest.mark.parametrize("wheel, carried", [
    ("torch-2.10.0-cp312-cp312-manylinux_2_28_x86_64.whl", False),  # older than the host's 2.11.0
    ("torch-2.11.0-cp312-cp312-manylinux_2_28_x86_64.whl", False),  # equal
    ("torch-2.12.0-cp312-cp312-manylinux_2_28_x86_64.whl", True),  # newer: the host's would not do
    ("numpy-2.5.2-cp312-cp312-manylinux_2_28_x86_64.whl", False),
    ("huggingface_hub-1.20.0-py3-none-any.whl", False),  # the wheel spells it with an underscore
    ("pydantic-2.14.4-py3-none-any.whl", True),  # the host lacks it
    ("pyzmq-27.1.0-cp312-abi3-manylinux_2_28_x86_64.whl", True),
    # documented without a version: carried, and gpu-test.sh asks the host's python before installing it
    ("typing_extensions-4.15.0-py3-none-any.whl", True),
])
def test_the_bundle_against_the_documented_host(wheel, carried):
    bundle = _bundle_wheels()
    reason = bundle.would_shadow(Path(wheel), bundle.read_host_packages())
    assert (reason is None) is carried, reason


def test_the_host_drops_what_it_has_at_an_equal_or_newer_version():
    from packaging.version import Version

    bundle = _bundle_wheels()
    wheel = Path("typing_extensions-4.15.0-py3-none-any.whl")  # what shadowed the host's and broke vLLM
    assert "typing-extensions 4.16.0" in bundle.would_shadow(wheel, {"typing-extensions": Version("4.16.0")})
    assert bundle.would_shadow(wheel, {"typing-extensions": Version("4.15.0")}) is not None
    assert bundle.would_shadow(wheel, {"typing-extensions": Version("4.14.1")}) is None  # the bundle's is needed


def test_prune_deletes_the_wheels_the_documented_host_has(tmp_path):
    wheels, bench = tmp_path / "wheels", tmp_path / "bench-wheels"
    for folder, names in ((wheels, ["pydantic-2.14.4-py3-none-any.whl", "numpy-2.0.0-cp312-cp312-linux_x86_64.whl"]),
                          (bench, ["torch-2.11.0-cp312-cp312-linux_x86_64.whl", "rich-14.0.0-py3-none-any.whl"])):
        folder.mkdir()
        for name in names:
            (folder / name).touch()
    done = subprocess.run([sys.executable, str(SCRIPTS / "gpu-bundle-wheels.py"), "prune", str(wheels), str(bench)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in tmp_path.rglob("*.whl")) == ["pydantic-2.14.4-py3-none-any.whl",
                                                               "rich-14.0.0-py3-none-any.whl"]
    assert "the host has numpy 2.5.2" in done.stderr and "the host has torch 2.11.0" in done.stderr


def test_select_asks_the_running_python(tmp_path):
    absent = tmp_path / "coldsnap_no_such_distribution-1.0-py3-none-any.whl"
    older = tmp_path / "pytest-1.0-py3-none-any.whl"  # this python's pytest is newer
    done = subprocess.run([sys.executable, str(SCRIPTS / "gpu-bundle-wheels.py"), "select", str(absent), str(older)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(absent)] and "pytest-1.0-py3-none-any.whl: the host has pytest" in done.stderr


def test_the_gpu_scripts_use_the_selection():
    assert "gpu-bundle-wheels.py prune" in (SCRIPTS / "gpu-prepare.sh").read_text()
    assert "gpu-bundle-wheels.py select" in (SCRIPTS / "gpu-test.sh").read_text()

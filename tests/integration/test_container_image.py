"""The reference image, built here from a debootstrapped base, captures and restores inside podman
(issue 30): CRIU in a privileged container, and a capture of one container restored in a second one.

The image (scripts/build-reference-image.sh) and everything the containers write live in a storage of
this module's own, removed at its end (tests/containers.py). Several minutes on 2 cores: the base,
coldsnap's wheel, the build and each container's copy of the image (vfs).
"""

import pytest

from tests.containers import ContainerStorage, missing_tools, private_storage

pytest.importorskip("torch")  # the image gets the torch this Python has
_missing = missing_tools()
pytestmark = [pytest.mark.criu, pytest.mark.skipif(_missing is not None, reason=_missing or "")]


@pytest.fixture(scope="module")
def storage():
    with private_storage() as storage:
        yield storage


@pytest.fixture(scope="module")
def image(storage: ContainerStorage) -> str:
    return storage.build_reference_image()


@pytest.fixture(scope="module")
def captured(storage: ContainerStorage, image: str) -> dict:
    """One container: the workload's cold start, its capture into a host folder, and a restore."""
    return storage.run_steps(image, storage.folder / "data", "cold", "capture", "restore", hostname="first")


def test_capture_and_restore_in_one_container(captured):
    cold = captured["cold"]["tokens"]
    assert len(cold) == 8
    assert captured["restored-first"]["tokens"] == cold
    assert captured["capture-receipt"]["state"] == "succeeded"
    assert captured["restore-receipt-first"]["state"] == "succeeded"
    # The restore ran CRIU inside the container: its tree has pids of the container's namespaces.
    assert captured["restored-first"]["restored_pid"] is not None


def test_restore_in_a_second_container(storage: ContainerStorage, image: str, captured):
    data = storage.folder / "data"
    results = storage.run_steps(image, data, "restore", hostname="second")
    assert results["restored-second"]["tokens"] == captured["cold"]["tokens"]
    assert results["restore-receipt-second"]["state"] == "succeeded"
    assert (data / "artifact" / "artifact.json").exists()

"""The reference image, built here from a debootstrapped base, captures and restores inside podman
(issue 30): CRIU in a privileged container, a capture of one container restored in a second one, and
that capture published to a registry (Debian's docker-registry on the host, TLS and basic auth) from a
container and restored in another container from the registry alone.

The image (scripts/build-reference-image.sh) and everything the containers write live in a storage of
this module's own, removed at its end (tests/containers.py). Several minutes on 2 cores: the base,
coldsnap's wheel, the build and each container's copy of the image (vfs).
"""

import json
import shutil

import pytest

from tests.containers import ContainerStorage, missing_tools, private_storage
from tests.registry_server import local_registry
from tests.registry_server import missing_tools as registry_tools_missing

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


@pytest.mark.skipif(bool(registry_tools_missing()), reason="needs scripts/install-registry.sh's tools")
def test_a_capture_published_from_one_container_restores_in_another_from_the_registry_alone(
        storage: ContainerStorage, image: str, captured):
    data = storage.folder / "data"
    with local_registry(storage.folder / "registry") as registry:
        credentials = storage.folder / "credentials"  # only the CA and the auth file go into the containers
        credentials.mkdir()
        shutil.copy(registry.ca_file, credentials / "ca.crt")
        shutil.copy(registry.auth_file, credentials / "auth.json")
        env = {"SSL_CERT_FILE": "/registry/ca.crt", "REGISTRY_AUTH_FILE": "/registry/auth.json",
               "COLDSNAP_TEST_REF": f"{registry.address}/team/reference:v1"}
        mounts = {credentials: "/registry:ro"}
        published = storage.run_steps(image, data, "publish", hostname="publisher", network="host", mounts=mounts,
                                      env=env)["published"]
        assert published["blobs_sent"] == published["blobs"] > 0
        # the second container: a folder with only the pinned reference, its own state, the registry
        fresh = storage.folder / "data-oci"
        fresh.mkdir()
        (fresh / "published.json").write_text(json.dumps(published))
        results = storage.run_steps(image, fresh, "restore-oci", hostname="third", network="host", mounts=mounts, env=env)
    assert results["restored-oci-third"]["tokens"] == captured["cold"]["tokens"]
    receipt = results["restore-oci-receipt-third"]
    assert receipt["state"] == "succeeded" and "/oci/" in receipt["artifact"]  # pulled into its state root
    assert not (fresh / "artifact").exists()

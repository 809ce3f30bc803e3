"""deploy/kubernetes/ against the Kubernetes API schema (issue 30), offline: every manifest validates against
the vendored strict JSON schemas of one Kubernetes release (deploy/kubernetes/schemas/, see its README), so
a misspelt field or a wrong type fails here, not on a cluster. Also what the API server or the kubelet would
refuse and a schema cannot see (selectors, volume and port names), that the pre-pull and the serving Pods
name the same artifact and image, and that the embedded shell scripts parse. Nothing here ran on a cluster.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
from functools import cache
from pathlib import Path

import jsonschema
import pytest
import yaml
from referencing import Registry, Resource

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kubernetes"
SCHEMAS = DEPLOY / "schemas"
KUBERNETES_VERSION = "v1.35.0"
MANIFESTS = sorted(DEPLOY.glob("*.yaml"))


def _documents(manifests: list[Path] = MANIFESTS) -> list[tuple[str, dict]]:
    """Every YAML document of ``manifests``, named ``FILE#INDEX:KIND``."""
    found = []
    for path in manifests:
        for index, document in enumerate(yaml.safe_load_all(path.read_text())):
            if document is not None:
                found.append((f"{path.name}#{index}:{document.get('kind')}", document))
    return found


DOCUMENTS = _documents()


def _schema_name(document: dict) -> str:
    """The vendored schema of a document: ``deployment-apps-v1`` for apps/v1 Deployment, ``secret-v1`` for v1."""
    group_version = document["apiVersion"]
    group, _, version = group_version.rpartition("/")
    group = group.split(".")[0]
    return "-".join(part for part in (document["kind"].lower(), group, version) if part)


@cache
def _registry() -> Registry:
    definitions = json.loads((SCHEMAS / KUBERNETES_VERSION / "_definitions.json").read_text())
    return Resource.from_contents(definitions) @ Registry()


def _validator(document: dict) -> jsonschema.Draft202012Validator:
    path = SCHEMAS / KUBERNETES_VERSION / f"{_schema_name(document)}.json"
    assert path.is_file(), (f"no vendored schema {path.relative_to(ROOT)} for {document['apiVersion']} "
                            f"{document['kind']}: add the kind with scripts/vendor-kubernetes-schemas.py")
    return jsonschema.Draft202012Validator(json.loads(path.read_text()), registry=_registry())


def _problems(document: dict) -> list[str]:
    return [f"{'.'.join(map(str, error.absolute_path)) or '(top)'}: {error.message}"
            for error in _validator(document).iter_errors(document)]


def _by_kind(kind: str) -> list[dict]:
    return [document for _, document in DOCUMENTS if document["kind"] == kind]


def _pod_spec(document: dict) -> dict | None:
    return document["spec"]["template"]["spec"] if document["kind"] in ("Deployment", "DaemonSet", "Job") else None


def _containers(pod: dict) -> list[dict]:
    return pod.get("initContainers", []) + pod["containers"]


def _env(container: dict) -> dict[str, str]:
    return {entry["name"]: entry.get("value") for entry in container.get("env", [])}


def test_the_manifests_and_their_schemas_are_there():
    assert {"DaemonSet", "Deployment", "Service", "Job", "Secret"} <= {d["kind"] for _, d in DOCUMENTS}
    assert (SCHEMAS / "README.md").is_file() and KUBERNETES_VERSION in (SCHEMAS / "README.md").read_text()


@pytest.mark.parametrize("name,document", DOCUMENTS, ids=[name for name, _ in DOCUMENTS])
def test_every_manifest_is_valid_for_the_kubernetes_api(name, document):
    problems = _problems(document)
    assert not problems, f"{name} against Kubernetes {KUBERNETES_VERSION}'s schema:\n" + "\n".join(problems)


@pytest.mark.parametrize("mistake", [
    "a misspelt field in a container",
    "a misspelt field at the top of the spec",
    "a misspelt field in a volume",
    "a count that is a word",
])
def test_the_schemas_are_strict(mistake):
    """The check is worth something only if it refuses what the API server would: fields it does not know
    (strict schemas: additionalProperties false, at every depth) and wrong types."""
    deployment = copy.deepcopy(_by_kind("Deployment")[0])
    assert not _problems(deployment)
    pod = deployment["spec"]["template"]["spec"]
    if mistake == "a misspelt field in a container":
        pod["containers"][0]["imagePullPolicyy"] = "IfNotPresent"
    elif mistake == "a misspelt field at the top of the spec":
        deployment["spec"]["replica"] = deployment["spec"].pop("replicas")
    elif mistake == "a misspelt field in a volume":
        pod["volumes"][0]["emptydir"] = pod["volumes"][0].pop("emptyDir")
    else:
        deployment["spec"]["replicas"] = "one"
    assert _problems(deployment), f"{mistake} passed the schema"


@pytest.mark.parametrize("name,document", DOCUMENTS, ids=[name for name, _ in DOCUMENTS])
def test_what_the_schema_cannot_see(name, document):
    """Cross-references the API server (or the kubelet) checks and a JSON schema cannot."""
    pod = _pod_spec(document)
    if pod is None:
        return
    if document["kind"] != "Job":  # a Job makes its own selector
        labels = document["spec"]["template"]["metadata"]["labels"]
        selector = document["spec"]["selector"]["matchLabels"]
        assert selector.items() <= labels.items(), f"{name}: the selector matches none of its own Pods"
    volumes = {volume["name"] for volume in pod.get("volumes", [])}
    for container in _containers(pod):
        mounts = {mount["name"] for mount in container.get("volumeMounts", [])}
        assert mounts <= volumes, f"{name}: {container['name']} mounts undeclared volumes {mounts - volumes}"
        ports = {port.get("name") for port in container.get("ports", [])}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            port = container.get(probe, {}).get("httpGet", {}).get("port")
            assert port is None or isinstance(port, int) or port in ports, f"{name}: {probe} names no port {port!r}"
        resources = container.get("resources", {})
        for resource, amount in resources.get("requests", {}).items():
            if "/" in resource:  # an extended resource (nvidia.com/gpu): requests must equal limits
                assert resources.get("limits", {}).get(resource) == amount, f"{name}: {resource} request != limit"


def test_the_service_reaches_the_serving_pods():
    (service,), (deployment,) = _by_kind("Service"), _by_kind("Deployment")
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    ports = {port["name"] for container in deployment["spec"]["template"]["spec"]["containers"]
             for port in container.get("ports", [])}
    assert all(port["targetPort"] in ports for port in service["spec"]["ports"])
    (server,) = deployment["spec"]["template"]["spec"]["containers"]
    assert [p["containerPort"] for p in server["ports"]] == [int(_env(server)["COLDSNAP_PORT"])], \
        "the restore serves on COLDSNAP_PORT: the container port must be that one"


def test_the_prepull_fetches_what_the_pods_restore():
    """The DaemonSet pre-pulls the very artifact (by digest) and image the serving Pods restore from, into
    the folder they read as STATE/oci/."""
    (daemonset,), (deployment,) = _by_kind("DaemonSet"), _by_kind("Deployment")
    (pull,) = daemonset["spec"]["template"]["spec"]["initContainers"]
    (server,) = deployment["spec"]["template"]["spec"]["containers"]
    assert _env(pull)["COLDSNAP_ARTIFACT"] == _env(server)["COLDSNAP_ARTIFACT"]
    assert "@sha256:" in _env(server)["COLDSNAP_ARTIFACT"], "a tag moves: pin the artifact by digest"
    assert pull["image"] == server["image"] and "@sha256:" in server["image"]

    def cache_path(pod: dict, container: dict) -> str:
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == f"{_env(container)['COLDSNAP_STATE_DIR']}/oci"]
        (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        return volume["hostPath"]["path"]

    assert cache_path(daemonset["spec"]["template"]["spec"], pull) == cache_path(deployment["spec"]["template"]["spec"], server)


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
@pytest.mark.parametrize("name,document", DOCUMENTS, ids=[name for name, _ in DOCUMENTS])
def test_the_entry_scripts_parse(name, document):
    pod = _pod_spec(document)
    for container in _containers(pod) if pod else []:
        if container.get("command") == ["/bin/bash", "-c"]:
            done = subprocess.run(["bash", "-n", "-c", container["args"][0]], capture_output=True, text=True)
            assert done.returncode == 0, f"{name}: {container['name']}'s script: {done.stderr}"

"""deploy/kubernetes/lws/ (a two-unit capture and restore as LeaderWorkerSets) against the LeaderWorkerSet
CRD's schema, offline: every LeaderWorkerSet validates against the vendored openAPIV3Schema of the LWS
release's CRD (deploy/kubernetes/schemas/lws-*/, see its README), which embeds the whole PodTemplateSpec, as
the API server checks it with strict field validation (kubectl's default: a field the schema does not name
is an error); the pod templates also validate against Kubernetes' own strict PodTemplateSpec, the Service
against Kubernetes' Service. Then what a schema cannot see: the coldsnap command line of each unit (units,
unit index, rendezvous, token file, address), the vLLM multi-node flags, and that capture and restore name
the same artifact directory. Nothing here ran on a cluster.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import shlex
import shutil
import subprocess
from functools import cache
from pathlib import Path

import jsonschema
import pytest
from jsonschema.exceptions import ValidationError

from tests.unit.test_kubernetes_manifests import ROOT, SCHEMAS, _containers, _documents, _env, _problems, _registry

LWS_DIR = ROOT / "deploy" / "kubernetes" / "lws"
LWS_VERSION = "lws-v0.10.0"
LWS_SCHEMA = SCHEMAS / LWS_VERSION / "leaderworkerset-v1.json"
MANIFESTS = sorted(LWS_DIR.glob("*.yaml"))
LWS_ENV = {"LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX"}  # what LWS puts into every container
TOKEN_SECRET, TOKEN_KEY = "coldsnap-rendezvous", "token"


DOCUMENTS = _documents(MANIFESTS)


def _lws(file: str) -> dict:
    (document,) = [d for name, d in DOCUMENTS if name.startswith(f"{file}#") and d["kind"] == "LeaderWorkerSet"]
    return document


def _strict(schema: object) -> object:
    """The CRD's schema as the API server applies it with strict field validation: an object that lists its
    properties takes no others (a CRD leaves ``additionalProperties`` unset, the server refuses or prunes
    unknown fields itself), except where the schema preserves unknown fields. Walks schema positions only,
    so a field that happened to be called ``properties`` would not be mistaken for a keyword."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if "properties" in out:
        out["properties"] = {name: _strict(sub) for name, sub in out["properties"].items()}
        if "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    for key in ("items", "additionalProperties", "not"):
        if isinstance(out.get(key), dict):
            out[key] = _strict(out[key])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in out:
            out[key] = [_strict(sub) for sub in out[key]]
    return out


def _list_type(validator, list_type, instance, schema):
    """``x-kubernetes-list-type``: the API server refuses two entries of a ``map`` list with the same keys
    (two containers, env vars or volumes of one name) and a repeated entry of a ``set``."""
    if not validator.is_type(instance, "array"):
        return
    if list_type == "map":
        keys = schema.get("x-kubernetes-list-map-keys", [])
        seen = [tuple(item.get(key) for key in keys) for item in instance if isinstance(item, dict)]
        if len(set(seen)) != len(seen):
            yield ValidationError(f"duplicate {keys} in a list-type map: {sorted({k for k in seen if seen.count(k) > 1})}")
    elif list_type == "set":
        seen = [json.dumps(item, sort_keys=True) for item in instance]
        if len(set(seen)) != len(seen):
            yield ValidationError("a repeated entry in a list-type set")


KubernetesValidator = jsonschema.validators.extend(jsonschema.Draft202012Validator, {"x-kubernetes-list-type": _list_type})


@cache
def _crd_schema() -> dict:
    return json.loads(LWS_SCHEMA.read_text())


def _errors(validator: jsonschema.protocols.Validator, instance: object, prefix: str = "") -> list[str]:
    return [f"{prefix}{'.'.join(map(str, error.absolute_path)) or '(top)'}: {error.message}"
            for error in validator.iter_errors(instance)]


def _core(definition: str) -> jsonschema.Draft202012Validator:
    """A definition of the vendored Kubernetes schemas (strict), e.g. ``io.k8s.api.core.v1.PodTemplateSpec``."""
    schema = {"$id": "https://kubernetes.io/api/lws-test", "$ref": f"/api/_definitions.json#/$defs/{definition}"}
    return jsonschema.Draft202012Validator(schema, registry=_registry())


def _lws_problems(document: dict, strict: bool = True) -> list[str]:
    schema = _strict(_crd_schema()) if strict else _crd_schema()
    problems = _errors(KubernetesValidator(schema), document)
    if document.get("apiVersion") != "leaderworkerset.x-k8s.io/v1" or document.get("kind") != "LeaderWorkerSet":
        problems.append(f"(top): not a leaderworkerset.x-k8s.io/v1 LeaderWorkerSet: {document.get('apiVersion')} "
                        f"{document.get('kind')} (v1 is the CRD's only version)")
    # the CRD leaves metadata to the API server, which checks it as any object's
    problems += _errors(_core("io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"), document.get("metadata"), "metadata.")
    return problems


def _templates(document: dict) -> dict[str, dict]:
    template = document["spec"]["leaderWorkerTemplate"]
    return {"leader": template["leaderTemplate"], "worker": template["workerTemplate"]}


def _main(template: dict) -> dict:
    (container,) = template["spec"]["containers"]
    return container


def _script(container: dict) -> str:
    assert container["command"] == ["/bin/bash", "-c"], f"{container['name']}: not a bash entry script"
    return container["args"][0]


def _coldsnap(script: str, verb: str) -> tuple[str | None, dict[str, str], list[str]]:
    """``coldsnap VERB`` in an entry script: its positional argument, its options (each takes a value) and
    the engine command after ``--``, with the kubelet's ``$(VAR)`` left as written."""
    lines = [line for line in script.replace("\\\n", " ").splitlines() if line.strip().startswith(f"coldsnap {verb} ")]
    assert len(lines) == 1, f"want one `coldsnap {verb}` in the script, found {len(lines)}"
    words = shlex.split(lines[0])
    for stop in ("&", "||", "&&", ";"):
        if stop in words:
            words = words[:words.index(stop)]
    words, engine = (words[:words.index("--")], words[words.index("--") + 1:]) if "--" in words else (words, [])
    words = words[2:]
    positional = words.pop(0) if words and not words[0].startswith("--") else None
    assert len(words) % 2 == 0 and all(w.startswith("--") for w in words[::2]), f"options not in pairs: {words}"
    options = dict(zip(words[::2], words[1::2]))
    assert len(options) == len(words) // 2, f"an option given twice: {words}"
    return positional, options, engine


def _flags(engine: list[str]) -> dict[str, str | bool]:
    """An engine command's ``--flag value`` pairs (``--flag`` alone: True)."""
    found: dict[str, str | bool] = {}
    for index, word in enumerate(engine):
        if word.startswith("--"):
            following = engine[index + 1] if index + 1 < len(engine) else "--"
            found[word] = True if following.startswith("--") else following
    return found


def _expand(value: str, container: dict) -> str:
    """``"$COLDSNAP_ARTIFACT_DIR"`` and the like, as the script's shell would: from the container's env."""
    return re.sub(r"\$\{?(\w+)\}?", lambda m: _env(container).get(m.group(1)) or m.group(0), value)


def test_the_manifests_and_their_schema_are_there():
    assert {p.name for p in MANIFESTS} == {"capture-two-unit.yaml", "restore-two-unit.yaml"}
    assert {"LeaderWorkerSet", "Service"} == {d["kind"] for _, d in DOCUMENTS}
    readme = (SCHEMAS / "README.md").read_text()
    digest = hashlib.sha256(LWS_SCHEMA.read_bytes()).hexdigest()
    assert LWS_VERSION in readme and digest in readme, "schemas/README.md must name the LWS schema and its SHA-256"
    pod = _crd_schema()["properties"]["spec"]["properties"]["leaderWorkerTemplate"]["properties"]["leaderTemplate"]
    assert {"containers", "volumes", "initContainers"} <= set(pod["properties"]["spec"]["properties"]), \
        "the CRD should embed the whole PodTemplateSpec: it is what checks the pod templates"


@pytest.mark.parametrize("name,document", DOCUMENTS, ids=[name for name, _ in DOCUMENTS])
def test_every_manifest_is_valid(name, document):
    if document["kind"] == "LeaderWorkerSet":
        problems = _lws_problems(document)
        for role, template in _templates(document).items():
            problems += _errors(_core("io.k8s.api.core.v1.PodTemplateSpec"), template, f"{role}Template (Kubernetes): ")
    else:
        problems = _problems(document)  # the vendored Kubernetes schema of its kind
    assert not problems, f"{name}:\n" + "\n".join(problems)


@pytest.mark.parametrize("mistake,refusal", [
    ("a group size that is a word", "spec.leaderWorkerTemplate.size: 'two' is not of type 'integer'"),
    ("a misspelt field in the leader's container", "('imagePullPolicyy' was unexpected)"),
    ("a misspelt field at the top of the spec", "('startupPolicyy' was unexpected)"),
    ("a misspelt field in the worker's volume", "('emptydir' was unexpected)"),
    ("a restart policy LWS does not know", "'Always' is not one of"),
    ("no worker template", "'workerTemplate' is a required property"),
    ("two env vars of one name", "duplicate ['name'] in a list-type map"),
])
def test_the_schema_is_enforced(mistake, refusal):
    """Worth something only if it refuses what the API server would: wrong types, values outside an enum,
    a required field missing, unknown fields (the strict reading of the CRD) and duplicate list-map keys."""
    lws = copy.deepcopy(_lws("restore-two-unit.yaml"))
    assert not _lws_problems(lws)
    template = lws["spec"]["leaderWorkerTemplate"]
    if mistake == "a group size that is a word":
        template["size"] = "two"
    elif mistake == "a misspelt field in the leader's container":
        _main(template["leaderTemplate"])["imagePullPolicyy"] = "IfNotPresent"
    elif mistake == "a misspelt field at the top of the spec":
        lws["spec"]["startupPolicyy"] = lws["spec"].pop("startupPolicy")
    elif mistake == "a misspelt field in the worker's volume":
        volume = template["workerTemplate"]["spec"]["volumes"][0]
        volume["emptydir"] = volume.pop("emptyDir")
    elif mistake == "a restart policy LWS does not know":
        template["restartPolicy"] = "Always"
    elif mistake == "no worker template":
        del template["workerTemplate"]
    else:
        env = _main(template["workerTemplate"])["env"]
        env.append(dict(env[-1]))
    problems = _lws_problems(lws)
    assert any(refusal in problem for problem in problems), f"{mistake}: want {refusal!r}, got {problems}"


def test_the_crd_alone_does_not_refuse_unknown_fields():
    """Why the test reads the CRD strictly: as vendored it names fields but closes no object, so a plain
    JSON-schema check would let a misspelling through (the API server refuses it, kubectl's default)."""
    lws = copy.deepcopy(_lws("restore-two-unit.yaml"))
    _main(lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"])["imagePullPolicyy"] = "IfNotPresent"
    assert not _lws_problems(lws, strict=False) and _lws_problems(lws, strict=True)


@pytest.mark.parametrize("file", ["capture-two-unit.yaml", "restore-two-unit.yaml"])
def test_one_group_of_two_units_that_start_and_fall_together(file):
    spec = _lws(file)["spec"]
    assert spec["leaderWorkerTemplate"]["size"] == 2
    assert spec["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart", \
        "a unit that restarts alone cannot rejoin the group's activation: the group must be recreated"
    assert spec["startupPolicy"] == "LeaderCreated", "LeaderReady deadlocks: the leader is Ready only once both units are"
    if file.startswith("capture"):
        assert spec["replicas"] == 1, "two capture groups would write the same artifact directory"


@pytest.mark.parametrize("file,verb", [("capture-two-unit.yaml", "capture"), ("restore-two-unit.yaml", "restore")])
def test_each_unit_runs_coldsnap_with_its_place_in_the_group(file, verb):
    lws = _lws(file)
    size = lws["spec"]["leaderWorkerTemplate"]["size"]
    ports = set()
    for role, template in _templates(lws).items():
        container = _main(template)
        _, options, engine = _coldsnap(_script(container), verb)
        assert options["--units"] == str(size), f"{role}: --units is not the group's size"
        if role == "leader":
            assert options["--unit"] == "0"
            host, _, port = options["--serve-rendezvous"].rpartition(":")
            assert host == "0.0.0.0", "the leader's coordinator must listen where the worker can reach it"
            ports.add(port)
        else:
            assert options["--unit"] == "$(LWS_WORKER_INDEX)"
            assert "--serve-rendezvous" not in options, "only unit 0 serves the coordinator"
        host, _, port = options["--rendezvous"].rpartition(":")
        assert host == "$(LWS_LEADER_ADDRESS)", f"{role}: the rendezvous is the leader's"
        ports.add(port)
        assert options["--address"] == "$(POD_IP)"
        (pod_ip,) = [e for e in container["env"] if e["name"] == "POD_IP"]
        assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        # the token file is the key of the rendezvous Secret, mounted read-only
        token = Path(options["--rendezvous-token-file"])
        (mount,) = [m for m in container["volumeMounts"] if token.parent == Path(m["mountPath"])]
        (volume,) = [v for v in template["spec"]["volumes"] if v["name"] == mount["name"]]
        assert mount.get("readOnly") is True
        assert volume["secret"]["secretName"] == TOKEN_SECRET
        assert {"key": TOKEN_KEY, "path": token.name} in volume["secret"]["items"]
        if verb == "capture":
            assert engine[:2] == ["vllm", "serve"]
            flags = _flags(engine)
            assert flags["--nnodes"] == str(size) and flags["--tensor-parallel-size"] == str(size)
            assert flags["--distributed-executor-backend"] == "mp" and flags["--load-format"] == "coldsnap"
            assert flags["--master-addr"] == "$(LWS_LEADER_ADDRESS)" and flags["--master-port"] == "29501"
            assert flags["--node-rank"] == ("0" if role == "leader" else "$(LWS_WORKER_INDEX)")
            assert ("--headless" in flags) == (role == "worker"), "vLLM's node rank 1 runs --headless, rank 0 serves"
        else:
            assert engine == [], "a restore runs the captured tree, no engine command"
    assert len(ports) == 1, f"the rendezvous port differs between --serve-rendezvous and --rendezvous: {ports}"


def test_capture_and_restore_name_the_same_artifact():
    """Unit K's restore reads the directory unit K's capture wrote (``unit-K`` under one artifact folder, as on
    two machines: the one descriptor and that unit's capsule): the same path on the same claim, read-only there."""
    def artifact(file: str, verb: str) -> dict[str, tuple[str, str, bool]]:
        found = {}
        for name, template in _templates(_lws(file)).items():
            container = _main(template)
            out, options, _ = _coldsnap(_script(container), verb)
            directory = Path(_expand(options["--out"] if verb == "capture" else out, container))
            (mount,) = [m for m in container["volumeMounts"] if directory.is_relative_to(m["mountPath"])]
            (volume,) = [v for v in template["spec"]["volumes"] if v["name"] == mount["name"]]
            found[name] = (str(directory), volume["persistentVolumeClaim"]["claimName"], bool(mount.get("readOnly")))
        return found

    captured, restored = artifact("capture-two-unit.yaml", "capture"), artifact("restore-two-unit.yaml", "restore")
    assert set(captured) == set(restored)
    for name in captured:
        assert captured[name][:2] == restored[name][:2], name
        assert not captured[name][2] and restored[name][2], "the capture writes the artifact; the restore only reads it"
    units = sorted(Path(directory).name for directory, _, _ in captured.values())
    assert units == ["unit-$(LWS_WORKER_INDEX)", "unit-0"]
    assert len({Path(directory).parent for directory, _, _ in captured.values()}) == 1


@pytest.mark.parametrize("file", ["capture-two-unit.yaml", "restore-two-unit.yaml"])
def test_the_units_are_the_same_but_for_their_place(file):
    """Both units run the same image, on the same GPU model, with the same privilege, one GPU each."""
    templates = _templates(_lws(file))
    images = {c["image"] for t in templates.values() for c in _containers(t["spec"])}
    products = {t["spec"]["nodeSelector"]["nvidia.com/gpu.product"] for t in templates.values()}
    assert len(images) == 1 and "@sha256:" in images.pop() and len(products) == 1
    for role, template in templates.items():
        (gpu,) = template["spec"]["initContainers"]
        assert gpu["resources"]["limits"]["nvidia.com/gpu"] == 1 and "securityContext" not in gpu
        main = _main(template)
        assert main["securityContext"] == {"privileged": True}
        assert main["resources"]["requests"]["nvidia.com/gpu"] == main["resources"]["limits"]["nvidia.com/gpu"] == 1
        state = [m for m in main["volumeMounts"] if m["mountPath"] == _env(main)["COLDSNAP_STATE_DIR"]]
        (volume,) = [v for v in template["spec"]["volumes"] if v["name"] == state[0]["name"]]
        assert volume == {"name": volume["name"], "emptyDir": {}}, f"{role}: the state root is the Pod's own"


def test_only_the_serving_leader_is_probed_and_reached():
    lws = _lws("restore-two-unit.yaml")
    leader, worker = (_main(t) for t in _templates(lws).values())
    assert leader["readinessProbe"]["httpGet"]["port"] == "http"
    assert {p["name"]: p["containerPort"] for p in leader["ports"]}["http"] == 8000
    assert not {"readinessProbe", "startupProbe", "livenessProbe"} & set(worker), "the worker serves no HTTP"
    (service,) = [d for _, d in DOCUMENTS if d["kind"] == "Service"]
    assert service["metadata"]["name"] != lws["metadata"]["name"], "LWS names its own headless Service after the set"
    selector = service["spec"]["selector"].items()
    leader_labels, worker_labels = (t["metadata"]["labels"].items() for t in _templates(lws).values())
    assert selector <= leader_labels and not selector <= worker_labels, "the Service must reach the leader only"
    assert all(p["targetPort"] in {q["name"] for q in leader["ports"]} for p in service["spec"]["ports"])


@pytest.mark.parametrize("file", ["capture-two-unit.yaml", "restore-two-unit.yaml"])
def test_what_the_schema_cannot_see(file):
    """Volume and probe-port names, and the kubelet's ``$(VAR)`` substitution: a name neither the container's
    env nor LWS defines is left as written, and bash would then run it as a command."""
    for role, template in _templates(_lws(file)).items():
        pod = template["spec"]
        volumes = {v["name"] for v in pod["volumes"]}
        for container in _containers(pod):
            mounts = {m["name"] for m in container.get("volumeMounts", [])}
            assert mounts <= volumes, f"{role}: {container['name']} mounts undeclared volumes {mounts - volumes}"
            ports = {p["name"] for p in container.get("ports", [])}
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                port = container.get(probe, {}).get("httpGet", {}).get("port")
                assert port is None or isinstance(port, int) or port in ports, f"{role}: {probe} names no port {port!r}"
            script = _script(container)
            assert "$$" not in script, "the kubelet turns $$ into $"
            named = set(re.findall(r"\$\(([A-Z_][A-Z0-9_]*)\)", script))
            assert named <= LWS_ENV | set(_env(container)), f"{role}: $(…) of nothing: {named - LWS_ENV - set(_env(container))}"


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
@pytest.mark.parametrize("file", ["capture-two-unit.yaml", "restore-two-unit.yaml"])
def test_the_entry_scripts_parse(file):
    for role, template in _templates(_lws(file)).items():
        for container in _containers(template["spec"]):
            done = subprocess.run(["bash", "-n", "-c", _script(container)], capture_output=True, text=True)
            assert done.returncode == 0, f"{role}: {container['name']}'s script: {done.stderr}"


def test_the_docs_name_the_manifests_and_the_token_secret():
    docs = (ROOT / "docs" / "kubernetes.md").read_text()
    readme = (ROOT / "deploy" / "kubernetes" / "README.md").read_text()
    assert all(path.name in docs for path in MANIFESTS) and "lws/" in readme
    command = f"kubectl create secret generic {TOKEN_SECRET} --from-literal={TOKEN_KEY}="
    assert command in docs and all(command in path.read_text() for path in MANIFESTS)


def _kubelet(text: str, container: dict, worker_index: int) -> str:
    """``$(VAR)`` as the kubelet substitutes it in the Pod of group member ``worker_index`` (the leader: 0),
    then ``$VAR`` from the container's env as bash would."""
    pod = {"LWS_LEADER_ADDRESS": "coldsnap-capture-tp2-0.coldsnap-capture-tp2", "LWS_WORKER_INDEX": str(worker_index),
           "POD_IP": f"10.1.0.{10 + worker_index}"}
    return _expand(re.sub(r"\$\((\w+)\)", lambda m: pod.get(m.group(1), m.group(0)), text), container)


def test_each_units_capture_line_is_a_request_of_coldsnaps_own_parser():
    """The leader's and the worker's ``coldsnap capture`` lines, as their Pods run them, go through the CLI's
    own parser into strict requests: unit K of 2 with the vLLM node rank K, one tensor-parallel rank each,
    and only the leader serving."""
    from coldsnap.cli import capture_request
    from coldsnap.contracts.request import OperationRequest

    for role, template in _templates(_lws("capture-two-unit.yaml")).items():
        container, index = _main(template), 0 if role == "leader" else 1
        (line,) = [line for line in _script(container).replace("\\\n", " ").splitlines()
                   if line.strip().startswith("coldsnap capture ")]
        words = shlex.split(_kubelet(line, container, index))
        words = words[2:words.index("||")] if "||" in words else words[2:]
        decoded = OperationRequest.model_validate_json(json.dumps(capture_request(words)))
        assert decoded.engine == "vllm" and decoded.partial
        assert (decoded.unit.index, decoded.unit.units, decoded.unit.unit_id) == (index, 2, f"unit-{index}")
        assert decoded.unit.rendezvous == "coldsnap-capture-tp2-0.coldsnap-capture-tp2:29600"
        assert decoded.unit.address == f"10.1.0.{10 + index}"
        assert [w.rank for w in decoded.units[0].workers] == [index]
        assert decoded.units[0].serving_port == (8000 if index == 0 else None)


def test_each_units_restore_line_parses_as_unit_k_of_2():
    """The ``coldsnap restore`` lines through the CLI's own parser: unit K of 2 at the leader's coordinator
    (the leader serving it), at the Pod's own address."""
    from coldsnap.cli.parser import build_parser
    from coldsnap.cli.requests import unit_selection

    for role, template in _templates(_lws("restore-two-unit.yaml")).items():
        container, index = _main(template), 0 if role == "leader" else 1
        (line,) = [line for line in _script(container).replace("\\\n", " ").splitlines()
                   if line.strip().startswith("coldsnap restore ")]
        words = shlex.split(_kubelet(line, container, index).replace('"$gpu"', "0").replace('"$receipt"', "/tmp/r"))
        selection = unit_selection(build_parser().parse_args(words[1:words.index("&")]))
        assert selection is not None and selection["index"] == index and selection["unit"]["units"] == 2
        assert selection["unit"]["address"] == f"10.1.0.{10 + index}"
        assert ("serve_rendezvous" in selection["unit"]) == (index == 0)

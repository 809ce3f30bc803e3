"""coldsnap publish / pull / restore oci://: a captured artifact through a real registry (Debian's docker-registry
with TLS and basic auth on localhost), restored from the registry alone under a second state root."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from coldsnap.payload.records import VALIDATION_RECORD_NAME
from coldsnap.payload.validation import verify_file
from coldsnap.registry import client as registry_client
from coldsnap.registry.client import client_for
from coldsnap.registry.errors import DigestMismatch, RegistryNotFound, RegistryUnreachable
from coldsnap.registry.publish import CHUNK_RECORD_NAME
from coldsnap.registry.pull import PullError, pull
from coldsnap.registry.pull_staging import staging_dir
from coldsnap.registry.reference import parse_reference
from tests.integration.test_capture_restore import PROMPT_2, cold_start_tokens, complete, workload
from tests.helpers import free_port
from tests.processes import kill_replicas
from tests.registry_server import local_registry, missing_tools

pytest.importorskip("torch")
pytestmark = [
    pytest.mark.criu,
    pytest.mark.skipif(os.geteuid() != 0, reason="CRIU needs root"),
    pytest.mark.skipif(bool(missing_tools()), reason=f"needs {', '.join(missing_tools())} (scripts/install-registry.sh)"),
]


def coldsnap(*args: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "coldsnap", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **env})


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    with local_registry(tmp_path_factory.mktemp("registry") / "server") as server:
        yield server


@pytest.fixture(scope="module")
def published(tmp_path_factory, registry):
    """A capture of the reference workload, published: (artifact, pinned reference, port, cold-start tokens)."""
    root = tmp_path_factory.mktemp("published")
    port = free_port()
    expected = cold_start_tokens(workload(port), port)
    artifact = root / "artifact"
    env = {"COLDSNAP_STATE_DIR": str(root / "capture-state")}
    done = coldsnap("capture", "--out", str(artifact), "--", *workload(port), env=env)
    assert done.returncode == 0, done.stderr
    # 64 KiB chunks: the tiny pack goes up and comes down as several, as a real one does
    done = coldsnap("publish", str(artifact), f"{registry.address}/team/tiny-lm:v1", "--json", "--chunk-size", "64K",
                    env=registry.client_env())
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["blobs_sent"] == report["blobs"] and report["bytes_sent"] == report["bytes_total"] > 0
    yield artifact, report["reference"], port, expected
    kill_replicas(artifact)


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.name.startswith((VALIDATION_RECORD_NAME, CHUNK_RECORD_NAME))}  # (host-bound records)


def test_a_second_publish_sends_only_the_index(published, registry):
    artifact, reference, _, _ = published
    # 64 KiB chunks: the tiny pack goes up and comes down as several, as a real one does
    done = coldsnap("publish", str(artifact), f"{registry.address}/team/tiny-lm:v1", "--json", "--chunk-size", "64K",
                    env=registry.client_env())
    assert done.returncode == 0, done.stderr
    again = json.loads(done.stdout)
    assert again["reference"] == reference  # same bytes, same digest
    assert again["blobs_sent"] == 0 and again["bytes_sent"] == 0 and again["manifests_sent"] == 0


def test_pull_gives_the_same_files_with_records_a_restore_trusts(published, registry, tmp_path):
    artifact, reference, _, _ = published
    done = coldsnap("pull", reference, str(tmp_path / "pulled"), env=registry.client_env())
    assert done.returncode == 0, done.stderr
    pulled = tmp_path / "pulled"
    assert _files(pulled) == _files(artifact)
    pack = next((pulled / "payload").glob("*.pack"))
    assert verify_file(pack).method == "record"  # the pull's streamed hash, not a second pass
    assert not staging_dir(pulled).exists()
    # pulling again into the same directory: nothing fetched
    done = coldsnap("pull", reference, str(pulled), "--json", env=registry.client_env())
    assert done.returncode == 0 and json.loads(done.stdout)["already_there"]


def test_restore_from_the_registry_alone_under_another_state_root(published, registry, tmp_path):
    """The second host: its own state root, no access to the capture's directory; the same tokens."""
    artifact, reference, port, expected = published
    env = {**registry.client_env(), "COLDSNAP_STATE_DIR": str(tmp_path / "host-2")}
    done = coldsnap("restore", f"oci://{reference}", "--prepare-only", env=env)
    assert done.returncode == 0, done.stderr
    cached = [p for p in (tmp_path / "host-2" / "oci").iterdir() if not p.name.startswith(".")]
    assert len(cached) == 1
    moved = artifact.with_name("artifact-away")
    artifact.rename(moved)  # the capture's directory is not what the restore reads
    try:
        done = coldsnap("restore", f"oci://{reference}", "--receipt-json", "-", env=env)
        assert done.returncode == 0, done.stderr
        assert "already on this host" in done.stderr
        receipt = json.loads(done.stdout)
        assert receipt["state"] == "succeeded" and receipt["artifact"] == str(cached[0])
        payload = next(s for s in receipt["timing"]["spans"] if s["name"] == "restore.admission.payload")["attributes"]
        verdicts = [v for k, v in payload.items() if k.endswith("verified_by")]
        assert verdicts and set(verdicts) == {"record"}, payload  # the pull's streamed digests, not a second hash
        assert complete(port, PROMPT_2) == expected
        kill_replicas(cached[0])
        # pinned and on this host: the registry is not asked (credentials it would refuse change nothing)
        wrong = tmp_path / "wrong-auth.json"
        wrong.write_text(json.dumps({"auths": {registry.address: {"auth": "Y29sZHNuYXA6d3Jvbmc="}}}))
        done = coldsnap("restore", f"oci://{reference}", "--prepare-only", env={**env, "REGISTRY_AUTH_FILE": str(wrong)})
        assert done.returncode == 0 and "already on this host" in done.stderr, done.stderr
    finally:
        moved.rename(artifact)


def test_concurrent_pulls_into_one_directory_both_succeed(published, registry, tmp_path):
    _, reference, _, _ = published
    env = {**os.environ, **registry.client_env()}
    racers = [subprocess.Popen([sys.executable, "-m", "coldsnap", "pull", reference, str(tmp_path / "pulled"), "--json"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    answers = [r.communicate(timeout=300) for r in racers]
    assert [r.returncode for r in racers] == [0, 0], answers
    assert sorted(json.loads(out)["already_there"] for out, _ in answers) == [False, True]


def test_pull_hands_what_it_wrote_to_the_owner(published, registry, tmp_path):
    artifact, reference, _, _ = published
    destination = tmp_path / "new" / "pulled"
    done = coldsnap("pull", reference, str(destination), "--owner", "12345:12346", env=registry.client_env())
    assert done.returncode == 0, done.stderr
    for path in [tmp_path / "new", *(tmp_path / "new").rglob("*")]:
        status = path.lstat()
        assert (status.st_uid, status.st_gid) == (12345, 12346), path
    for path in destination.rglob("*"):
        if path.is_file() and not path.name.startswith(VALIDATION_RECORD_NAME):
            assert path.stat().st_mode == (artifact / path.relative_to(destination)).stat().st_mode, path
    pack = next((destination / "payload").glob("*.pack"))
    assert verify_file(pack).method == "record"  # the hand-over carried the pull's record along


def test_an_interrupted_pull_resumes_with_what_arrived(published, registry, tmp_path, monkeypatch):
    _, reference, _, _ = published
    monkeypatch.setattr(registry_client, "RANGE_BYTES", 8 << 20)  # the images' pages file: many ranges
    for name, value in registry.client_env().items():
        monkeypatch.setenv(name, value)
    ref = parse_reference(reference)
    client = client_for(ref)
    real = client._blob_response
    calls = {"n": 0}

    def flaky(digest, headers):
        calls["n"] += 1
        if calls["n"] == 12:
            raise RegistryUnreachable("the network went away (test)")
        return real(digest, headers)

    monkeypatch.setattr(client, "_blob_response", flaky)
    destination = tmp_path / "pulled"
    with pytest.raises(RegistryUnreachable):
        pull(ref, destination, client)
    assert not destination.exists() and staging_dir(destination).is_dir()
    calls["n"] = -10**6  # the network is back
    result = pull(ref, destination, client)
    assert 0 < result.blobs_fetched < result.blobs and result.bytes_fetched < result.bytes_total
    assert destination.is_dir() and not staging_dir(destination).exists()


def test_a_blob_damaged_in_the_registry_is_refused_and_nothing_is_written(published, registry, tmp_path):
    artifact, reference, _, _ = published
    capsule = json.loads((artifact / "units" / "unit-0" / "capsule.json").read_text())
    image = max(capsule["files"], key=lambda f: f["size_bytes"])
    data = registry.storage / "docker/registry/v2/blobs/sha256" / image["sha256"][:2] / image["sha256"] / "data"
    original = data.read_bytes()
    data.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
    try:
        done = coldsnap("pull", reference, str(tmp_path / "pulled"), env=registry.client_env())
        assert done.returncode == 1 and image["sha256"] in done.stderr, done.stderr
        assert not (tmp_path / "pulled").exists()
    finally:
        data.write_bytes(original)


def test_wrong_credentials_are_named_and_nothing_secret_is_printed(published, registry, tmp_path):
    _, reference, _, _ = published
    auth = tmp_path / "auth.json"
    auth.write_text(json.dumps({"auths": {registry.address: {"auth": "Y29sZHNuYXA6d3JvbmctcGFzc3dvcmQ="}}}))
    done = coldsnap("pull", reference, str(tmp_path / "pulled"), env={**registry.client_env(), "REGISTRY_AUTH_FILE": str(auth)})
    assert done.returncode == 1 and str(auth) in done.stderr, done.stderr
    assert "wrong-password" not in done.stderr + done.stdout and "Y29sZHNu" not in done.stderr + done.stdout
    done = coldsnap("restore", f"oci://{reference}", "--prepare-only", env={**registry.client_env(), "REGISTRY_AUTH_FILE": str(auth),
                                                                            "COLDSNAP_STATE_DIR": str(tmp_path / "s")})
    assert done.returncode == 1 and "refused" in done.stderr and "Traceback" not in done.stderr


def test_a_damaged_artifact_is_not_published(published, registry, tmp_path):
    artifact, _, _, _ = published
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-a", str(artifact), str(copy)], check=True)
    pack = next((copy / "payload").glob("*.pack"))
    data = bytearray(pack.read_bytes())
    data[-1] ^= 1
    pack.write_bytes(bytes(data))
    done = coldsnap("publish", str(copy), f"{registry.address}/team/damaged:v1", env=registry.client_env())
    assert done.returncode == 1 and pack.name in done.stderr, done.stderr


def test_bad_references_are_usage_errors(registry, tmp_path):
    for command in (["pull", "no-registry-here", str(tmp_path / "x")], ["publish", str(tmp_path), "r.io/x:y"],
                    ["restore", "oci://Bad_Host/UPPER:tag"]):
        done = coldsnap(*command, env=registry.client_env())
        assert done.returncode == 2 and "Traceback" not in done.stderr, (command, done.stderr)


def test_pull_refuses_a_directory_holding_something_else(published, registry, tmp_path):
    _, reference, _, _ = published
    (tmp_path / "taken").mkdir()
    done = coldsnap("pull", reference, str(tmp_path / "taken"), env=registry.client_env())
    assert done.returncode == 2 and "already exists" in done.stderr


def test_a_digest_that_does_not_match_is_refused_before_any_file(published, registry, tmp_path, monkeypatch):
    _, reference, _, _ = published
    for name, value in registry.client_env().items():
        monkeypatch.setenv(name, value)
    ref = parse_reference(reference)
    wrong = ref.with_digest("sha256:" + "0" * 64)
    with pytest.raises((RegistryNotFound, DigestMismatch, PullError)):
        pull(wrong, tmp_path / "pulled", client_for(wrong))
    assert not (tmp_path / "pulled").exists()


def _pack_chunks(client, reference) -> list[str]:
    from coldsnap.registry.layout import PACK_TYPE, read_index

    index, _, _ = client.get_manifest(reference.pinned)
    digests = []
    for digest, _, kind in read_index(index, "index"):
        if kind == PACK_TYPE:
            manifest, _, _ = client.get_manifest(digest)
            digests += [layer["digest"] for layer in json.loads(manifest)["layers"]]
    return digests


def test_a_restore_starts_while_the_pack_arrives_and_keeps_what_it_pulled(published, tmp_path):
    """A host with no copy, its registry behind a slow link for the pack's chunks: CRIU restores the tree while
    they arrive, each is used only once verified, the restore gives the cold start's tokens, and the pulled
    copy stays, whole and recorded, for the next restore (which then needs no registry)."""
    from tests.throttled_link import throttled_link

    artifact, _, port, expected = published
    with local_registry(tmp_path / "plain-registry", tls=False, auth=False) as plain:
        done = coldsnap("publish", str(artifact), f"{plain.address}/team/tiny-lm:v1", "--json", "--chunk-size", "64K",
                        env=plain.client_env())
        assert done.returncode == 0, done.stderr
        reference = parse_reference(json.loads(done.stdout)["reference"])
        chunks = _pack_chunks(registry_client.RegistryClient(plain.address, reference.repository, plain_http=True),
                              reference)
        assert len(chunks) > 4
        with throttled_link(plain.address, set(chunks), seconds_per_response=0.5) as slow:
            far = f"{slow}/{reference.repository}@{reference.digest}"
            env = {"COLDSNAP_PLAIN_HTTP_REGISTRIES": slow, "COLDSNAP_STATE_DIR": str(tmp_path / "host-3"),
                   "COLDSNAP_PULL_STREAMS": "2"}
            done = coldsnap("restore", f"oci://{far}", "--receipt-json", "-", env=env)
        assert done.returncode == 0, done.stderr
        receipt = json.loads(done.stdout)
        spans = {s["name"]: s for s in receipt["timing"]["spans"]}
        verdicts = {k: v for k, v in spans["restore.admission.payload"]["attributes"].items() if k.endswith("verified_by")}
        assert verdicts == {"pack_verified_by": "arriving", "residual_verified_by": "record"}, verdicts
        criu, arrival = spans["restore.criu_restore"], spans["restore.pack_arrival"]
        # the tree was restored while the pack was still coming: the wait for its last chunk ends after CRIU did
        assert criu["start_ns"] < arrival["start_ns"] and arrival["duration_ns"] > 0.2e9, (criu, arrival)
        assert "the pull finished" in done.stderr and "every chunk verified" in done.stderr
        assert complete(port, PROMPT_2) == expected
        cached = Path(receipt["artifact"])
        kill_replicas(cached)
        pack = next((cached / "payload").glob("*.pack"))
        assert verify_file(pack).method == "record" and not list(cached.rglob("*.chunks"))
        assert not (cached / ".coldsnap-pull.json").exists()
    # the registry is gone: the next restore of the pinned reference is served from the cache
    done = coldsnap("restore", f"oci://{far}", "--prepare-only", env=env)
    assert done.returncode == 0 and "already on this host" in done.stderr, done.stderr


def test_an_interrupted_chunked_pull_resumes_in_place(published, registry, tmp_path, monkeypatch):
    """A streaming pull cut off after some chunks leaves DIR handed over but incomplete; the next pull finds it,
    hashes the chunks that arrived again and fetches only the others."""
    from coldsnap.registry.pull import PullSession
    from coldsnap.registry.pull_staging import incomplete

    _, reference, _, _ = published
    for name, value in registry.client_env().items():
        monkeypatch.setenv(name, value)
    ref = parse_reference(reference)
    client = client_for(ref)
    real = client.fetch_chunk
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RegistryUnreachable("the network went away (test)")
        return real(*args, **kwargs)

    monkeypatch.setattr(client, "fetch_chunk", flaky)
    monkeypatch.setattr("coldsnap.registry.pull.PARALLEL_STREAMS", 1)  # the chunks in order: three arrive
    destination = tmp_path / "pulled"
    session = PullSession(ref, destination, client).start()
    assert session.usable() == destination
    with pytest.raises(RegistryUnreachable):
        session.finish()
    assert destination.is_dir() and incomplete(destination) and not staging_dir(destination).exists()
    calls["n"] = -10**6  # the network is back
    result = pull(ref, destination, client)
    total = len(_pack_chunks(client, ref))
    assert result.blobs_fetched == total and calls["n"] == -10**6 + total - 3  # three were on disk already
    assert not incomplete(destination)
    pack = next((destination / "payload").glob("*.pack"))
    assert verify_file(pack).method == "record"


def test_an_artifact_holding_a_secret_is_published_only_with_allow_secrets(registry, tmp_path):
    """`capture --env HF_TOKEN` puts the token in the capsule (the artifact says so): publish refuses it before
    sending anything, naming the name, the file, offset and kind but never the value; --allow-secrets publishes."""
    secret = {"HF_TOKEN": "hf_" + "QwErTyUiOpAsDfGhJkLzXcVbNmQwErTyUi"}
    port = free_port()
    artifact = tmp_path / "artifact"
    done = coldsnap("capture", "--env", "HF_TOKEN", "--out", str(artifact), "--", *workload(port),
                    env={"COLDSNAP_STATE_DIR": str(tmp_path / "state"), **secret})
    assert done.returncode == 0, done.stderr
    reference = f"{registry.address}/team/holds-a-token:v1"
    refused = coldsnap("publish", str(artifact), reference, "--json", env={**registry.client_env(), **secret})
    assert refused.returncode == 1 and refused.stdout == "", refused.stderr
    assert "the capsule holds HF_TOKEN" in refused.stderr and "pages-1.img:" in refused.stderr
    assert secret["HF_TOKEN"] not in refused.stderr
    nothing = coldsnap("pull", reference, str(tmp_path / "pulled"), env=registry.client_env())
    assert nothing.returncode != 0  # nothing went up: the tag does not exist
    published = coldsnap("publish", str(artifact), reference, "--json", "--allow-secrets",
                         env={**registry.client_env(), **secret})
    assert published.returncode == 0, published.stderr
    assert "publishing all the same (--allow-secrets)" in published.stderr
    assert json.loads(published.stdout)["reference"].startswith(reference)

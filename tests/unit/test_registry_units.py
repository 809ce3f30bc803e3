"""References, credentials and the manifest layout of coldsnap.registry, without a registry."""

import base64
import json
import os
import stat
from pathlib import Path

import pytest

from coldsnap.payload.arrival import ArrivalFailed, PackArrival
from coldsnap.registry.commands import chunk_size
from coldsnap.registry.credentials import CredentialsError, find_credentials
from coldsnap.registry.layout import (CAPSULE_TYPE, PACK_TYPE, Blob, Chunk, LayoutError, chunked_pack_manifest_bytes,
                                      index_bytes, manifest_bytes, read_index, read_manifest)
from coldsnap.registry.reference import BadReference, parse_reference


@pytest.mark.parametrize("text, registry, repository, tag, digest", [
    ("127.0.0.1:5000/team/model:v1", "127.0.0.1:5000", "team/model", "v1", None),
    ("oci://registry.example.com/a/b/c", "registry.example.com", "a/b/c", None, None),
    ("localhost/x@sha256:" + "a" * 64, "localhost", "x", None, "sha256:" + "a" * 64),
    ("r.io:443/x:tag@sha256:" + "b" * 64, "r.io:443", "x", "tag", "sha256:" + "b" * 64),
])
def test_references_parse(text, registry, repository, tag, digest):
    reference = parse_reference(text)
    assert (reference.registry, reference.repository, reference.tag, reference.digest) == (registry, repository, tag, digest)
    assert parse_reference(str(reference)) == reference


@pytest.mark.parametrize("text, says", [
    ("model", "name the registry"),
    ("https://r.io/x", "REGISTRY/REPOSITORY"),
    ("user:pw@r.io/x", "no credentials"),
    ("r.io/UPPER", "repository name"),
    ("r.io/x:bad tag", "tag"),
    ("r.io/x@sha256:123", "64 lowercase hex"),
])
def test_bad_references_say_what_is_wrong(text, says):
    with pytest.raises(BadReference, match=says):
        parse_reference(text)


def _auth(tmp_path, monkeypatch, config):
    path = tmp_path / "auth.json"
    path.write_text(json.dumps(config))
    monkeypatch.setenv("REGISTRY_AUTH_FILE", str(path))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.delenv("DOCKER_CONFIG", raising=False)
    return path


def test_credentials_from_the_auth_file_in_every_key_form(tmp_path, monkeypatch):
    secret = base64.b64encode(b"alice:s3cret:with:colons").decode()
    path = _auth(tmp_path, monkeypatch, {"auths": {"https://r.io:5000/v1/": {"auth": secret}, "other.io": {"auth": "x"}}})
    found = find_credentials("r.io:5000")
    assert found is not None and (found.username, found.secret, found.source) == ("alice", "s3cret:with:colons", str(path))
    assert "s3cret" not in repr(found)
    assert find_credentials("nothing.io") is None


def test_credentials_from_a_helper_program(tmp_path, monkeypatch):
    helper = tmp_path / "bin" / "docker-credential-test"
    helper.parent.mkdir()
    helper.write_text('#!/bin/sh\nread host\n[ "$host" = r.io ] && echo \'{"Username": "bob", "Secret": "tok"}\' && exit 0\n'
                      'echo "credentials not found in native keychain"; exit 1\n')
    helper.chmod(helper.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{helper.parent}:{os.environ['PATH']}")
    _auth(tmp_path, monkeypatch, {"credHelpers": {"r.io": "test"}, "credsStore": "test"})
    found = find_credentials("r.io")
    assert found is not None and (found.username, found.secret, found.source) == ("bob", "tok", "docker-credential-test")
    assert find_credentials("elsewhere.io") is None  # credsStore asked, "not found": anonymous


def test_a_broken_auth_file_or_missing_helper_is_named(tmp_path, monkeypatch):
    path = _auth(tmp_path, monkeypatch, {})
    path.write_text("{not json")
    with pytest.raises(CredentialsError, match=str(path)):
        find_credentials("r.io")
    _auth(tmp_path, monkeypatch, {"credHelpers": {"r.io": "absent-helper"}})
    with pytest.raises(CredentialsError, match="docker-credential-absent-helper"):
        find_credentials("r.io")


def test_manifests_are_deterministic_and_read_back_strictly():
    config = Blob("units/u/capsule.json", "sha256:" + "1" * 64, 10, 0o644)
    layer = Blob("units/u/images/pages-1.img", "sha256:" + "2" * 64, 20, 0o600)
    data = manifest_bytes(CAPSULE_TYPE, config, [layer], {})
    assert data == manifest_bytes(CAPSULE_TYPE, config, [layer], {})
    assert [b.path for b in read_manifest(data, CAPSULE_TYPE, "m")] == [config.path, layer.path]
    assert read_manifest(data, CAPSULE_TYPE, "m")[1].mode == 0o600
    evil = json.loads(data)
    evil["layers"][0]["annotations"]["org.opencontainers.image.title"] = "../../etc/passwd"
    with pytest.raises(LayoutError, match="relative path"):
        read_manifest(json.dumps(evil).encode(), CAPSULE_TYPE, "m")
    with pytest.raises(LayoutError, match="not a coldsnap artifact"):
        read_index(json.dumps({"manifests": []}).encode(), "idx")
    with pytest.raises(LayoutError, match="exactly one descriptor"):
        read_index(index_bytes([(data, CAPSULE_TYPE, {})], {}), "idx")


def test_a_chunked_pack_manifest_binds_every_chunk_and_is_read_back_strictly():
    chunks = (Chunk(0, "sha256:" + "a" * 64, 4096), Chunk(4096, "sha256:" + "b" * 64, 100))
    pack = Blob("payload/" + "c" * 64 + ".pack", "sha256:" + "c" * 64, 4196, 0o644, PACK_TYPE, chunks)
    data = chunked_pack_manifest_bytes(pack)
    assert data == chunked_pack_manifest_bytes(pack)
    assert read_manifest(data, PACK_TYPE, "m") == [pack]  # one file, its digest the pack's own, its chunks in order

    def damaged(change) -> bytes:
        manifest = json.loads(data)
        change(manifest)
        return json.dumps(manifest).encode()

    for change, says in [
        (lambda m: m["layers"][1]["annotations"].update({"vnd.coldsnap.chunk.offset": "4000"}), "not at offset 4096"),
        (lambda m: m["annotations"].update({"vnd.coldsnap.pack.size": "5000"}), "hold 4196 bytes, the pack 5000"),
        (lambda m: m["annotations"].pop("vnd.coldsnap.pack.sha256"), "needs vnd.coldsnap.pack.sha256"),
        (lambda m: m["layers"][1]["annotations"].update({"org.opencontainers.image.title": "payload/other.pack"}),
         "chunks of one file"),
        (lambda m: m["layers"].reverse(), "not at offset 0"),
    ]:
        with pytest.raises(LayoutError, match=says):
            read_manifest(damaged(change), PACK_TYPE, "m")


def test_an_arrival_says_which_chunks_hold_a_range_and_wakes_waiters():
    import threading

    arrival = PackArrival(Path("/x/p.pack"), [0, 100, 200], 250)
    assert list(arrival.chunks_of(0, 1)) == [0] and list(arrival.chunks_of(99, 2)) == [0, 1]
    assert list(arrival.chunks_of(150, 100)) == [1, 2] and list(arrival.chunks_of(5, 0)) == []
    assert arrival.chunk_range(2) == (200, 250)
    threading.Timer(0.05, arrival.arrived, (1,)).start()
    arrival.wait(100, 100)  # returns once chunk 1 is in, with chunk 0 still missing
    assert not arrival.complete
    batches = arrival.as_they_arrive()
    assert next(batches) == [1]
    arrival.arrived(0)
    arrival.arrived(2)
    assert next(batches) == [0, 2] and arrival.complete
    failed = PackArrival(Path("/x/q.pack"), [0, 100], 200)
    failed.arrived(0)
    threading.Timer(0.05, failed.fail, ("chunk 1 did not match its digest",)).start()
    with pytest.raises(ArrivalFailed, match="did not match"):
        failed.wait()
    failed.wait(0, 100)  # what arrived before stays usable
    with pytest.raises(ArrivalFailed, match="stopped waiting"):
        PackArrival(Path("/x/r.pack"), [0], 10).wait(keep_going=lambda: False)


@pytest.mark.parametrize("text, size", [("256M", 256 << 20), ("64K", 64 << 10), ("1G", 1 << 30), ("4MiB", 4 << 20),
                                        ("65536", 65536), ("1k", None), ("5G", None), ("100000", None), ("x", None)])
def test_chunk_sizes(text, size):
    assert chunk_size(text) == size

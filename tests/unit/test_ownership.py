"""Files owned by the caller (coldsnap.ownership): resolving the owner, and handing a tree over."""

import io
import json
import os
import socket
import stat
from pathlib import Path

import pytest

from coldsnap.contracts import ContractError, OperationRequest, decode_document
from coldsnap.operation import EXIT_FAILED, EXIT_OK, EXIT_USAGE, OperationFailed, OperationOutcome, run_operation
from coldsnap.ownership import (REQUEST_SOURCE, SUDO_SOURCE, HandOver, Owner, OwnerError, hand_over, parse_owner,
                                resolve_owner)
from coldsnap.payload.records import VALIDATION_RECORD_NAME
from coldsnap.payload.validation import hash_and_record, verify_file
from tests.conftest import make_request

OWNER = Owner(12345, 23456)
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving files to another user needs root")


# --- resolving the owner ---------------------------------------------------------------------------------

def test_parse_owner():
    assert parse_owner("1000:1001") == Owner(1000, 1001, "--owner")
    assert str(parse_owner("0:0")) == "0:0"
    assert parse_owner(f"{2**32 - 2}:7").uid == 2**32 - 2


@pytest.mark.parametrize("text", ["", "1000", "1000:", ":1000", "a:b", "bob:bob", "-1:0", "1:-1", " 1:1", "1:1:1",
                                  "1.0:1", "١:1", f"{2**32 - 1}:0", f"0:{2**32}"])
def test_parse_owner_refuses_in_one_line_naming_the_source(text):
    with pytest.raises(OwnerError) as caught:
        parse_owner(text, "--owner")
    message = str(caught.value)
    assert message.startswith(f"--owner {text!r}: ") and "\n" not in message


def test_resolve_owner_order_flag_then_request_then_sudo():
    sudo = {"SUDO_UID": "1000", "SUDO_GID": "1000"}
    assert resolve_owner("7:8", (5, 6), sudo, euid=0) == Owner(7, 8, "--owner")
    assert resolve_owner(Owner(7, 8), (5, 6), sudo, euid=0) == Owner(7, 8, "--owner")
    assert resolve_owner(None, (5, 6), sudo, euid=0) == Owner(5, 6, REQUEST_SOURCE)
    assert resolve_owner(None, None, sudo, euid=0) == Owner(1000, 1000, SUDO_SOURCE)
    assert resolve_owner(None, None, {}, euid=0) is None  # nothing said: nothing changes owner


def test_sudo_counts_only_as_root():
    # `sudo -u bob coldsnap ...`: bob runs it, and what it writes is bob's already
    assert resolve_owner(None, None, {"SUDO_UID": "1000", "SUDO_GID": "1000"}, euid=4321) is None


@pytest.mark.parametrize(("environ", "expected"), [
    ({"SUDO_UID": "1000"}, "only SUDO_UID is set"),
    ({"SUDO_GID": "1000"}, "only SUDO_GID is set"),
    ({"SUDO_UID": "x", "SUDO_GID": "1000"}, "SUDO_UID:SUDO_GID 'x:1000': expected numeric UID:GID"),
])
def test_a_broken_sudo_environment_is_a_clear_error(environ, expected):
    with pytest.raises(OwnerError, match=expected):
        resolve_owner(None, None, environ, euid=0)


def test_only_root_gives_files_to_another_user():
    me = os.geteuid() if os.geteuid() != 0 else 4321
    with pytest.raises(OwnerError, match=rf"^--owner 12345:1: handing files to another user needs root \(this runs as uid {me}\)$"):
        resolve_owner("12345:1", None, {}, euid=me)
    with pytest.raises(OwnerError, match="the request's owner 12345:1: handing files"):
        resolve_owner(None, (12345, 1), {}, euid=me)
    if os.geteuid() != 0:
        assert resolve_owner(f"{me}:{os.getegid()}", None, {}) == Owner(me, os.getegid())


def test_the_request_field_is_strict_and_left_out_when_absent():
    document = make_request(owner={"uid": 1000, "gid": 1001})
    request = decode_document(OperationRequest, json.dumps(document).encode())
    assert request.owner is not None and (request.owner.uid, request.owner.gid) == (1000, 1001)
    assert request.to_json_value()["owner"] == {"uid": 1000, "gid": 1001}
    plain = decode_document(OperationRequest, json.dumps(make_request()).encode())
    assert "owner" not in plain.to_json_value()  # requests without it keep their digests
    for bad in ("1000:1001", {"uid": "1000", "gid": 1}, {"uid": -1, "gid": 1}, {"uid": 2**32 - 1, "gid": 1},
                {"uid": 1}, {"uid": 1, "gid": 1, "name": "bob"}):
        with pytest.raises(ContractError):
            decode_document(OperationRequest, json.dumps(make_request(owner=bad)).encode())


# --- handing a tree over ---------------------------------------------------------------------------------

def _tree(root: Path, outside: Path) -> dict[str, Path]:
    """A tree like an artifact's: files and folders, modes of every kind, links pointing out of it."""
    outside.mkdir()
    (outside / "secret").write_text("not the owner's")
    (outside / "folder").mkdir()
    (outside / "folder" / "inner").write_text("nor this")
    paths = {"root": root, "file": root / "request.json", "folder": root / "units" / "unit-0" / "images",
             "image": root / "units" / "unit-0" / "images" / "pages-1.img", "private": root / "private",
             "setid": root / "tool", "shared": root / "shared", "in_shared": root / "shared" / "log",
             "link_out": root / "link-out", "link_dir": root / "link-dir", "dangling": root / "dangling",
             "fifo": root / "fifo", "socket": root / "s.sock"}
    paths["folder"].mkdir(parents=True)
    paths["file"].write_text("{}")
    paths["image"].write_bytes(b"\0" * 4096)
    paths["private"].write_text("x")
    paths["private"].chmod(0o600)
    paths["setid"].write_text("#!/bin/sh\n")
    paths["setid"].chmod(0o6755)  # Linux drops setuid and setgid on chown
    paths["shared"].mkdir()
    paths["shared"].chmod(0o2775)  # a setgid directory
    paths["in_shared"].write_text("appended later")
    paths["link_out"].symlink_to(outside / "secret")
    paths["link_dir"].symlink_to(outside / "folder")
    paths["dangling"].symlink_to(root / "gone")
    os.mkfifo(paths["fifo"])
    with socket.socket(socket.AF_UNIX) as bound:
        bound.bind(str(paths["socket"]))
    return paths


def _modes(root: Path) -> dict[str, int]:
    return {str(p): os.lstat(p).st_mode for p in [root, *root.rglob("*")]}


@needs_root
def test_hand_over_gives_everything_in_the_tree_and_keeps_every_mode(tmp_path):
    paths = _tree(tmp_path / "artifact", tmp_path / "outside")
    before = _modes(paths["root"])
    report = hand_over([paths["root"]], OWNER)
    assert report.failed == [] and report.linked == [] and report.warnings() == []
    assert report.changed == len(before)
    for path in [paths["root"], *paths["root"].rglob("*")]:
        status = os.lstat(path)
        assert (status.st_uid, status.st_gid) == (12345, 23456), path
    assert _modes(paths["root"]) == before  # setuid, setgid (file and folder), 0600: all kept
    assert stat.S_IMODE(os.stat(paths["setid"]).st_mode) == 0o6755
    # links were not followed out of the tree
    for outside in (tmp_path / "outside", tmp_path / "outside" / "secret", tmp_path / "outside" / "folder",
                    tmp_path / "outside" / "folder" / "inner"):
        assert os.lstat(outside).st_uid == 0, outside
    # a second hand-over has nothing left to do
    assert hand_over([paths["root"]], OWNER).changed == 0


@needs_root
def test_a_file_the_owner_is_given_keeps_working_for_its_root_writer(tmp_path):
    log = tmp_path / "state" / "logs" / "unit-0.log"
    log.parent.mkdir(parents=True)
    with open(log, "ab") as engine:  # a restored engine appends to its log after the hand-over
        engine.write(b"before\n")
        engine.flush()
        hand_over([tmp_path / "state"], OWNER)
        engine.write(b"after\n")
    assert log.read_bytes() == b"before\nafter\n" and os.stat(log).st_uid == 12345


@needs_root
def test_a_hard_linked_file_is_left_as_it_was(tmp_path):
    tree = tmp_path / "tree"
    tree.mkdir()
    (tmp_path / "elsewhere").write_text("a file of someone else")
    os.link(tmp_path / "elsewhere", tree / "linked")
    report = hand_over([tree], OWNER)
    assert os.stat(tmp_path / "elsewhere").st_uid == 0
    assert report.linked == [str(tree / "linked")]
    assert "more than one hard link" in report.warnings()[0]
    assert os.stat(tree).st_uid == 12345


@needs_root
def test_a_symlinked_folder_given_as_a_path_is_not_followed(tmp_path):
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "file").write_text("x")
    (tmp_path / "claimed").symlink_to(tmp_path / "target")
    hand_over([tmp_path / "claimed"], OWNER)
    assert os.lstat(tmp_path / "claimed").st_uid == 12345
    assert os.stat(tmp_path / "target").st_uid == 0 and os.stat(tmp_path / "target" / "file").st_uid == 0


@needs_root
def test_missing_and_nested_paths(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    report = hand_over([tmp_path / "a" / "b", tmp_path / "a", tmp_path / "absent", tmp_path / "absent" / "x"], OWNER)
    assert report.changed == 2 and report.failed == []


@needs_root
def test_validation_records_still_vouch_after_the_hand_over(tmp_path):
    """A change of owner moves a file's ctime, which its validation record binds: the entries are carried over,
    so the first restore of a handed-over capture does not hash its packs again."""
    payload = tmp_path / "payload"
    payload.mkdir()
    pack, other = payload / "a.pack", payload / "b.pack"
    pack.write_bytes(b"weights" * 1000)
    other.write_bytes(b"more" * 1000)
    digest, other_digest = hash_and_record(pack), hash_and_record(other)
    hand_over([payload], OWNER)
    for name in (VALIDATION_RECORD_NAME, VALIDATION_RECORD_NAME + ".lock", "a.pack"):
        assert os.stat(payload / name).st_uid == 12345, name
    assert verify_file(pack, digest).method == "record"
    assert verify_file(other, other_digest).method == "record"


@needs_root
def test_a_record_of_a_changed_file_is_not_carried_over(tmp_path):
    pack = tmp_path / "a.pack"
    pack.write_bytes(b"x" * 100)
    digest = hash_and_record(pack)
    with open(pack, "r+b") as handle:  # same size, other bytes, mtime set back: the ctime gives it away
        handle.write(b"y")
    status = os.stat(pack)
    os.utime(pack, ns=(status.st_atime_ns, status.st_mtime_ns - 10**9))
    hand_over([tmp_path], OWNER)
    with pytest.raises(Exception, match="sha256|digest|mismatch"):
        verify_file(pack, digest)


# --- the operation's claims ------------------------------------------------------------------------------

def test_without_an_owner_nothing_is_claimed(tmp_path):
    claims = HandOver(None)
    claims.claim(tmp_path)
    claims.claim_new(tmp_path / "new")
    claims.claim_written(tmp_path / "file")
    assert claims.claimed == [] and claims.apply() is None


def test_claim_new_takes_the_topmost_folder_an_operation_makes(tmp_path):
    claims = HandOver(OWNER)
    claims.claim_new(tmp_path)  # found: not the operation's to give away
    assert claims.claimed == []
    claims.claim_new(tmp_path / "a" / "b" / "c")
    assert claims.claimed == [tmp_path / "a"]


@needs_root
def test_claim_written_hands_over_only_a_file_the_operation_wrote(tmp_path):
    (tmp_path / "read.json").write_text("{}")
    (tmp_path / "replaced.json").write_text("{}")
    claims = HandOver(OWNER)
    for name in ("read.json", "replaced.json", "made.json", "never.json"):
        claims.claim_written(tmp_path / name)
    (tmp_path / "made.json").write_text("{}")
    (tmp_path / "new.tmp").write_text("{}!")
    os.replace(tmp_path / "new.tmp", tmp_path / "replaced.json")
    claims.apply()
    owners = {p.name: os.stat(p).st_uid for p in tmp_path.iterdir()}
    assert owners == {"read.json": 0, "replaced.json": 12345, "made.json": 12345}


def _run(document, body, owner=None):
    stdout, stderr = io.BytesIO(), io.StringIO()
    status = run_operation(json.dumps(document).encode(), "req", body, "-", stdout=stdout, stderr=stderr, owner=owner)
    return status, stdout.getvalue(), stderr.getvalue()


def _writes_then(folder: Path, ending: BaseException | None):
    def body(context):
        context.hand_over.claim_new(folder)
        (folder / "logs").mkdir(parents=True)
        (folder / "logs" / "unit-0.log").write_text("output")
        if ending is not None:
            raise ending
        return OperationOutcome(artifact=str(folder))
    return body


@needs_root
@pytest.mark.parametrize("ending", [None, OperationFailed("capture.launch", "it exited"), KeyboardInterrupt(),
                                    RuntimeError("a bug")])
def test_the_envelope_hands_over_on_success_and_on_every_failure(tmp_path, ending):
    status, out, err = _run(make_request(), _writes_then(tmp_path / "made", ending), owner="12345:23456")
    assert status == (EXIT_OK if ending is None else EXIT_FAILED)
    assert {os.stat(p).st_uid for p in [tmp_path / "made", *(tmp_path / "made").rglob("*")]} == {12345}
    assert "handed 3 path(s) it wrote to 12345:23456 (--owner)" in err


@needs_root
def test_the_request_owner_and_sudo(tmp_path, monkeypatch):
    monkeypatch.setenv("SUDO_UID", "777")
    monkeypatch.setenv("SUDO_GID", "778")
    _run(make_request(owner={"uid": 4000, "gid": 4001}), _writes_then(tmp_path / "requested", None))
    assert os.stat(tmp_path / "requested").st_uid == 4000
    _run(make_request(), _writes_then(tmp_path / "sudo", None))
    assert (os.stat(tmp_path / "sudo").st_uid, os.stat(tmp_path / "sudo").st_gid) == (777, 778)
    monkeypatch.delenv("SUDO_UID")
    monkeypatch.delenv("SUDO_GID")
    status, _, err = _run(make_request(), _writes_then(tmp_path / "nobody", None))
    assert status == EXIT_OK and os.stat(tmp_path / "nobody").st_uid == 0 and "handed" not in err


def test_an_owner_that_cannot_be_given_is_a_usage_error_without_a_receipt(monkeypatch):
    monkeypatch.setenv("SUDO_UID", "1000")
    monkeypatch.delenv("SUDO_GID", raising=False)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    status, out, err = _run(make_request(), _writes_then(Path("/nonexistent/never"), None))
    assert (status, out) == (EXIT_USAGE, b"")
    assert err == "coldsnap: SUDO_UID:SUDO_GID: only SUDO_UID is set; set both, or pass --owner UID:GID\n"


def test_cli_owner_flag_errors_in_one_line(tmp_path, capsys):
    from coldsnap.cli import main

    for command in (["restore", str(tmp_path)], ["warm", str(tmp_path)], ["wake", str(tmp_path)],
                    ["capture", "--out", str(tmp_path / "a"), "--", "python", "-m", "coldsnap.workloads.torch_lm"]):
        assert main([*command, "--owner", "bob"] if command[0] != "capture" else
                    [command[0], "--owner", "bob", *command[1:]]) == EXIT_USAGE
        assert capsys.readouterr().err == f"coldsnap {command[0]}: --owner 'bob': expected numeric UID:GID, e.g. 1000:1000\n"


def test_a_restore_from_flags_does_not_inherit_the_capture_owner(tmp_path):
    from coldsnap.cli import _artifact_request, build_parser

    (tmp_path / "request.json").write_text(json.dumps(make_request(operation="capture", owner={"uid": 1, "gid": 1})))
    args = build_parser().parse_args(["restore", str(tmp_path)])
    assert "owner" not in _artifact_request(args, "restore")

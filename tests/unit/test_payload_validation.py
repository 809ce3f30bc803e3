"""The one verifier: full hash, the validation record and its stat-identity trust rule, and the CLI."""

import hashlib
import json
import logging
import os
import subprocess
import sys
import time

import pytest

from coldsnap.payload import validation
from coldsnap.payload.errors import ExpectedDigestError, PackDigestMismatch, PackUnreadable
from coldsnap.payload.records import RACY_WINDOW_NS, VALIDATION_RECORD_NAME
from coldsnap.payload.validation import read_validation_record, verify_file


def content_file(directory, content: bytes, suffix: str = ".pack"):
    path = directory / f"{hashlib.sha256(content).hexdigest()}{suffix}"
    path.write_bytes(content)
    return path


def settle():
    """Let the file's last change fall outside the racy window, as any pack older than 50 ms is."""
    time.sleep(RACY_WINDOW_NS / 1e9 + 0.01)


@pytest.fixture
def hashes(monkeypatch):
    """Counts full hashes: the proof that a ``record`` verdict read no byte of the file."""
    calls = []
    real = validation._hash_fd

    def counting(fd):
        calls.append(fd)
        return real(fd)

    monkeypatch.setattr(validation, "_hash_fd", counting)
    return calls


@pytest.fixture
def pack(tmp_path, monkeypatch):
    monkeypatch.setattr(validation, "HASH_CHUNK_BYTES", 1024 * 1024)  # several reads per hash
    path = content_file(tmp_path, os.urandom(3 * 1024 * 1024 + 17))
    settle()
    return path


def test_full_hash_then_record(pack, hashes):
    first = verify_file(pack)
    assert (first.method, first.sha256, first.size_bytes) == ("full-hash", pack.name[:64], pack.stat().st_size)
    entry = read_validation_record(pack.parent).files[pack.name]
    status = os.stat(pack)
    assert (entry.sha256, entry.size_bytes, entry.st_dev, entry.st_ino, entry.mtime_ns, entry.ctime_ns) == (
        first.sha256, status.st_size, status.st_dev, status.st_ino, status.st_mtime_ns, status.st_ctime_ns)

    second = verify_file(pack)
    assert second.method == "record" and second.sha256 == first.sha256 and len(hashes) == 1
    record_file = pack.parent / VALIDATION_RECORD_NAME
    assert json.loads(record_file.read_bytes())["format"] == 1 and oct(record_file.stat().st_mode & 0o777) == "0o644"


def test_changed_mtime_means_full_hash_again_then_accepted(pack, hashes):
    verify_file(pack)
    status = os.stat(pack)
    os.utime(pack, ns=(status.st_atime_ns, status.st_mtime_ns - 10**9))
    settle()
    again = verify_file(pack)
    assert again.method == "full-hash" and len(hashes) == 2
    assert read_validation_record(pack.parent).files[pack.name].mtime_ns == status.st_mtime_ns - 10**9
    assert verify_file(pack).method == "record" and len(hashes) == 2


def test_changed_content_same_size_is_rejected_and_the_entry_dropped(pack, hashes):
    verify_file(pack)
    size = pack.stat().st_size
    with open(pack, "r+b") as handle:
        handle.seek(size // 2)
        handle.write(b"\x00" if handle.read(1) != b"\x00" else b"\x01")
    assert pack.stat().st_size == size
    with pytest.raises(PackDigestMismatch) as caught:
        verify_file(pack)
    assert caught.value.expected == pack.name[:64] and caught.value.actual == hashlib.sha256(pack.read_bytes()).hexdigest()
    assert pack.name not in read_validation_record(pack.parent).files
    with pytest.raises(PackDigestMismatch):  # and stays rejected: nothing is trusted any more
        verify_file(pack)
    assert len(hashes) == 3


def test_replaced_file_with_the_same_bytes_is_rehashed(pack, hashes):
    verify_file(pack)
    data = pack.read_bytes()
    pack.unlink()
    pack.write_bytes(data)  # same name, same bytes, new inode and ctime
    settle()
    assert verify_file(pack).method == "full-hash" and len(hashes) == 2


def test_racily_clean_record_is_not_trusted(tmp_path, hashes, monkeypatch):
    fresh = content_file(tmp_path, b"written just now")
    # A wide window so that even a slow machine hashes inside it.
    monkeypatch.setattr(validation, "RACY_WINDOW_NS", 5 * 10**9)
    assert verify_file(fresh).method == "full-hash"
    # Hashed within the racy window of its last change: a same-tick write could hide behind the
    # unchanged timestamps, so the record is not trusted yet.
    assert verify_file(fresh).method == "full-hash"
    assert len(hashes) == 2
    monkeypatch.setattr(validation, "RACY_WINDOW_NS", RACY_WINDOW_NS)
    settle()
    verify_file(fresh)  # records a verdict made well after the change (if the last one was not already)
    assert verify_file(fresh).method == "record"


@pytest.mark.parametrize("garbage", [b"{not json", b'{"format": 2, "files": {}}', b'{"format": 1, "files": {"a/b": 1}}', b"\xff"])
def test_corrupt_record_means_rehash_and_rewrite(pack, hashes, caplog, garbage):
    record_file = pack.parent / VALIDATION_RECORD_NAME
    record_file.write_bytes(garbage)
    with caplog.at_level(logging.WARNING, logger="coldsnap.payload.validation"):
        assert verify_file(pack).method == "full-hash"
    assert len(caplog.records) == 1 and "ignoring the invalid validation record" in caplog.records[0].getMessage()
    assert pack.name in read_validation_record(pack.parent).files  # rewritten, valid again
    assert verify_file(pack).method == "record" and len(hashes) == 1


def test_entries_of_one_directory_are_merged(tmp_path):
    files = [content_file(tmp_path, bytes([i]) * (1000 + i), suffix) for i, suffix in enumerate((".pack", ".residual", ".pack"))]
    settle()
    for path in files:
        verify_file(path)
    assert sorted(read_validation_record(tmp_path).files) == sorted(p.name for p in files)
    assert all(verify_file(path).method == "record" for path in files)


def test_a_file_that_changes_while_hashed_is_accepted_but_not_recorded(pack, monkeypatch):
    real = validation._hash_fd

    def hash_then_touch(fd):
        result = real(fd)
        os.utime(pack)  # someone writes just as the hash ends
        return result

    monkeypatch.setattr(validation, "_hash_fd", hash_then_touch)
    assert verify_file(pack).method == "full-hash"
    assert pack.name not in read_validation_record(pack.parent).files


def test_expected_digest_rules(tmp_path):
    data = b"plain file"
    plain = tmp_path / "model.bin"
    plain.write_bytes(data)
    with pytest.raises(ExpectedDigestError, match="no expected SHA-256"):
        verify_file(plain)
    digest = hashlib.sha256(data).hexdigest()
    assert verify_file(plain, digest).sha256 == digest
    assert verify_file(plain, digest.upper()).sha256 == digest
    with pytest.raises(ExpectedDigestError, match="is not a hex SHA-256"):
        verify_file(plain, "abc")
    with pytest.raises(PackDigestMismatch):
        verify_file(plain, "0" * 64)


def test_a_wrong_expectation_keeps_a_correct_entry(pack, hashes):
    verify_file(pack)
    with pytest.raises(PackDigestMismatch):
        verify_file(pack, "0" * 64)
    assert verify_file(pack).method == "record"  # the entry still describes the file exactly


def test_unreadable_paths(tmp_path):
    with pytest.raises(PackUnreadable, match="No such file"):
        verify_file(tmp_path / ("0" * 64 + ".pack"))
    directory = tmp_path / ("1" * 64 + ".pack")
    directory.mkdir()
    with pytest.raises(PackUnreadable, match="not a regular file"):
        verify_file(directory)


def test_a_record_that_cannot_be_written_never_fails_verification(pack, caplog):
    (pack.parent / VALIDATION_RECORD_NAME).mkdir()  # unreadable and unreplaceable, even for root
    with caplog.at_level(logging.WARNING, logger="coldsnap.payload.validation"):
        assert verify_file(pack).method == "full-hash"
        assert verify_file(pack).method == "full-hash"
    messages = [r.getMessage() for r in caplog.records]
    assert any("cannot read the validation record" in m for m in messages)
    assert any("cannot update the validation record" in m for m in messages)


# --- the CLI ---------------------------------------------------------------------------------------


def coldsnap(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "coldsnap", *args], capture_output=True, timeout=120)


def test_cli_verify_valid_then_from_record(pack):
    first = coldsnap("payload", "verify", str(pack), "--json")
    assert first.returncode == 0 and first.stderr == b""
    report = json.loads(first.stdout)
    assert {k: report[k] for k in ("file", "sha256", "size_bytes", "method", "verdict")} == {
        "file": str(pack), "sha256": pack.name[:64], "size_bytes": pack.stat().st_size, "method": "full-hash", "verdict": "valid"}
    second = coldsnap("payload", "verify", str(pack))
    assert second.returncode == 0 and second.stderr == b""
    assert second.stdout.decode().startswith(f"{pack}: valid, sha256 {pack.name[:64]}, ") and b"(record," in second.stdout
    assert len(second.stdout.splitlines()) == 1


def test_cli_verify_rejects_a_changed_file_with_status_1(pack):
    with open(pack, "r+b") as handle:
        handle.write(b"\x00" * 8)
    result = coldsnap("payload", "verify", "--json", str(pack))
    assert result.returncode == 1 and b"Traceback" not in result.stderr
    assert result.stderr.decode().splitlines() == [f"{pack}: SHA-256 mismatch: expected {pack.name[:64]}, file has "
                                                   f"{hashlib.sha256(pack.read_bytes()).hexdigest()}"]
    assert json.loads(result.stdout)["verdict"] == "rejected"


def test_cli_verify_usage_errors_exit_2(tmp_path):
    plain = tmp_path / "weights.bin"
    plain.write_bytes(b"abc")
    cases = {
        (str(tmp_path / ("0" * 64 + ".pack")),): "cannot read: No such file or directory",
        (str(plain),): "no expected SHA-256",
        (str(plain), "--expected", "xyz"): "is not a hex SHA-256",
    }
    for args, problem in cases.items():
        result = coldsnap("payload", "verify", *args)
        assert result.returncode == 2 and result.stdout == b"" and b"Traceback" not in result.stderr, args
        lines = result.stderr.decode().splitlines()
        assert len(lines) == 1 and problem in lines[0], lines
    named = coldsnap("payload", "verify", str(plain), "--expected", hashlib.sha256(b"abc").hexdigest())
    assert named.returncode == 0, named.stderr


def test_cli_payload_help_explains_trust_and_exit_codes(capsys):
    from coldsnap.cli import main

    for argv, status in ((["payload", "verify", "--help"], 0), (["payload", "--help"], 0), (["payload"], 2)):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == status, argv
    text = capsys.readouterr().out
    assert "usage: coldsnap payload verify" in text and "st_dev, st_ino, size, mtime_ns, ctime_ns" in text
    assert "1 verified and rejected" in text and "2 usage error" in text

"""Secret-bearing names, the captured command's environment, and the scan: tokens of every known kind planted
in a page image at odd offsets, across a 4 KiB page's boundary and across the scan's own chunks."""

import os
import random

import pytest

from coldsnap.secrets import scan as scan_module
from coldsnap.secrets.engine_env import engine_environment
from coldsnap.secrets.names import is_secret_name
from coldsnap.secrets.scan import SecretScanner, scan_artifact, secret_values
from coldsnap.secrets.served_key import ApiKeyFileError, read_api_key, served_key_in_command

pytest.importorskip("hyperscan")

PLANTED = {
    "huggingface": b"hf_" + b"QwErTyUiOpAsDfGhJkLzXcVbNmQwErTyUi",
    "huggingface-org": b"api_org_" + b"QwErTyUiOpAsDfGhJkLzXcVbNmQwErTyUi",
    "openai-style": b"sk-proj-" + b"Zx9Kq2Lm7Np4Rs1Tv6Wy3Ab8Cd5Ef0GhIjKlMnOpQr",
    "github": b"ghp_" + b"a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8",
    "github-fine-grained": b"github_pat_" + b"A1b2C3d4E5" * 8 + b"_x",
    "aws-access-key-id": b"AKIA" + b"Q2W3E4R5T6Y7U8I9",
    "slack": b"xoxb-" + b"123456789012-abcdefABCDEF",
    "slack-webhook": b"hooks.slack.com/services/" + b"T01ABCDEF/B01ABCDEF/abcdefghijklmnopqrstuvwx",
    "jwt": b"eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.SflKxwRJSMeKKF2QT4fwpMeJf36POk6yJV",
    "pem-private-key": b"-----BEGIN RSA PRIVATE KEY-----\nMIIEpAIBAAKCAQEA...",
}


def _noise(size: int, seed: int = 7) -> bytearray:
    """Bytes like a page image's: binary, zero runs and the text a Python heap holds (strings end in NUL)."""
    rng = random.Random(seed)
    out = bytearray()
    words = [b"task-scheduler_and_more_words_here_x", b"disk-", b"TOKENIZERS_PARALLELISM", b"ghost_", b"sk-1",
             b"AKIAIOSFODNN7EXAMPLE", b"eyJ", b"hf_short", b"\x00" * 512]
    while len(out) < size:
        out += rng.randbytes(rng.randrange(16, 600)) if rng.random() < 0.5 else rng.choice(words) + b"\x00"
    return out[:size]


def _kinds(findings) -> list[tuple[int, str]]:
    return [(f.offset, f.kind) for f in findings]


def test_every_kind_is_found_at_odd_offsets_across_a_page_boundary():
    scanner = SecretScanner()
    data = _noise(64 * 4096)
    expected = []
    for index, (kind, token) in enumerate(PLANTED.items()):
        # one at an odd offset, one straddling a 4 KiB page's end
        odd = 4096 * (2 + 3 * index) + 1 + 2 * index
        straddle = 4096 * (3 + 3 * index) - len(token) // 2
        for offset in (odd, straddle):
            data[offset - 1:offset] = b" "
            data[offset:offset + len(token)] = token
            data[offset + len(token):offset + len(token) + 1] = b"\n"
            expected.append((offset, kind))
    assert _kinds(scanner.scan_bytes(bytes(data), "pages-1.img")) == sorted(expected)


def test_noise_and_lookalikes_find_nothing():
    """A page image's text is full of near-misses: task-..., an -EXAMPLE key, TOKENIZERS_..., short hf_ words."""
    assert SecretScanner().scan_bytes(bytes(_noise(1 << 20)), "x") == []
    near = b" hf_" + b"a" * 35 + b" xhf_" + b"a" * 34 + b" AKIA" + b"Q" * 17 + b" sk-" + b"a" * 20 + b" "
    assert SecretScanner().scan_bytes(near, "x") == []


def test_a_match_across_the_scans_own_chunks_is_found_once(monkeypatch):
    monkeypatch.setattr(scan_module, "CHUNK_BYTES", 1 << 16)
    token = PLANTED["github"]
    data = bytearray(_noise(1 << 18))
    starts = [(1 << 16) - 10, (2 << 16) - len(token), 3 << 16]
    for offset in starts:
        data[offset - 1:offset + len(token) + 1] = b" " + token + b" "
    assert _kinds(SecretScanner().scan_bytes(bytes(data), "x")) == [(s, "github") for s in starts]


def test_the_values_of_secret_named_variables_are_searched_by_name_never_shown():
    environment = {"DB_PASSWORD": "correct horse battery", "HOME": "/root", "API_KEY": "short", "PATH_TOKEN": "/a/b/c/d/e",
                   "COLDSNAP_STATE_DIR": "/run/coldsnap-xyz", "TOKENIZERS_PARALLELISM": "false-ish-long"}
    values = secret_values(environment)
    assert values == {"DB_PASSWORD": "correct horse battery"}  # too short, a path, a setting, not secret: left out
    data = b"\x00" * 5001 + b"correct horse battery" + b"\x00" * 10
    findings = SecretScanner(values).scan_bytes(data, "pages-1.img")
    assert [(f.offset, f.kind, f.line()) for f in findings] == [
        (5001, "value of $DB_PASSWORD", "pages-1.img:5001: value of $DB_PASSWORD")]


def test_scan_artifact_reports_files_and_leaves_out_the_weight_packs(tmp_path):
    (tmp_path / "units" / "unit-0" / "images").mkdir(parents=True)
    (tmp_path / "payload").mkdir()
    (tmp_path / "units" / "unit-0" / "images" / "pages-1.img").write_bytes(b"\x00" * 4093 + PLANTED["aws-access-key-id"])
    (tmp_path / "payload" / ("ab" * 32 + ".pack")).write_bytes(b" " + PLANTED["huggingface"] + b" ")
    (tmp_path / "artifact.json").write_text("{}")
    report = scan_artifact(tmp_path, SecretScanner())
    assert [f.line() for f in report.findings] == ["units/unit-0/images/pages-1.img:4093: aws-access-key-id"]
    assert report.files == 2 and [p for p, _ in report.not_scanned] == ["payload/" + "ab" * 32 + ".pack"]
    with_packs = scan_artifact(tmp_path, SecretScanner(), include_packs=True)
    assert {f.kind for f in with_packs.findings} == {"aws-access-key-id", "huggingface"}


@pytest.mark.parametrize("name, secret", [
    ("HF_TOKEN", True), ("HUGGING_FACE_HUB_TOKEN", True), ("VLLM_API_KEY", True), ("OPENAI_API_KEY", True),
    ("AWS_ACCESS_KEY_ID", True), ("AWS_REGION", True), ("AZURE_CLIENT_SECRET", True), ("DB_PASSWORD", True),
    ("GOOGLE_APPLICATION_CREDENTIALS", True), ("DOCKER_CONFIG", True), ("REGISTRY_AUTH_FILE", True),
    ("github-token", True), ("TOKENIZERS_PARALLELISM", False), ("PATH", False), ("HF_HOME", False),
    ("CUDA_VISIBLE_DEVICES", False), ("PASSTHROUGH", False), ("COLDSNAP_CONTROL", False), ("PWD", False),
])
def test_secret_bearing_names(name, secret):
    assert is_secret_name(name) is secret


def test_the_engine_environment_withholds_secrets_and_launcher_settings():
    launcher = {"PATH": "/bin", "HF_TOKEN": "hf_x", "AWS_PROFILE": "p", "MY_API_KEY": "k",
                "COLDSNAP_STATE_DIR": "/s", "COLDSNAP_CAPTURE_VERIFY": "0", "COLDSNAP_HYDRATE_THREADS": "4",
                "COLDSNAP_TRIM_LOCAL_MEMORY": "0", "COLDSNAP_NOT_REGISTERED": "1"}
    env = engine_environment({"CUDA_VISIBLE_DEVICES": "0", "DB_PASSWORD": "given"}, ["MY_API_KEY", "ABSENT_TOKEN"],
                             launcher)
    assert env.variables == {"PATH": "/bin", "MY_API_KEY": "k", "COLDSNAP_HYDRATE_THREADS": "4",
                             "COLDSNAP_TRIM_LOCAL_MEMORY": "0", "CUDA_VISIBLE_DEVICES": "0", "DB_PASSWORD": "given"}
    assert env.withheld == ("AWS_PROFILE", "HF_TOKEN") and env.held == ("DB_PASSWORD", "MY_API_KEY")
    assert env.settings_withheld == ("COLDSNAP_CAPTURE_VERIFY", "COLDSNAP_NOT_REGISTERED", "COLDSNAP_STATE_DIR")


def test_the_served_key_in_a_command_and_in_a_file(tmp_path):
    assert served_key_in_command("vllm", ["vllm", "serve", "m", "--api-key", "k"], {}) == "the command gives --api-key"
    assert served_key_in_command("vllm", ["vllm", "serve", "m", "--api-key=k"], {}) is not None
    assert served_key_in_command("vllm", ["vllm", "serve", "m"], {"VLLM_API_KEY": "k"}) is not None
    assert served_key_in_command("sglang", ["python", "-m", "sglang.launch_server", "--admin-api-key", "k"], {})
    assert served_key_in_command("torch-lm", ["python", "--api-key", "k"], {}) is None
    key = tmp_path / "key"
    key.write_text("  s3cret-key\n")
    assert read_api_key(key) == "s3cret-key"
    for text, problem in (("", "is empty"), ("a b", "without spaces")):
        key.write_text(text)
        with pytest.raises(ApiKeyFileError, match=problem):
            read_api_key(key)
    with pytest.raises(ApiKeyFileError, match="No such file"):
        read_api_key(tmp_path / "absent")


def test_the_scan_reads_at_more_than_a_gigabyte_a_second_here_or_says_how_fast(tmp_path):
    """Not a timed goal (benchmarks/ measure it); a floor that catches a scan gone pathological (a regex
    fallback at ~50 MB/s)."""
    image = tmp_path / "pages-1.img"
    image.write_bytes(bytes(_noise(64 << 20)) * 2)
    os.sync()
    scanner = SecretScanner()
    report = scan_artifact(tmp_path, scanner, files=[image])
    assert report.bytes_scanned == 128 << 20 and report.bytes_per_second > 100e6, report.bytes_per_second

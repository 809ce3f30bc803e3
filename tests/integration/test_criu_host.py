"""The CRIU that scripts/install-criu.sh installed, as coldsnap finds and uses it (real CRIU, real kernel)."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from coldsnap.snapshot.criu_binary import Criu, CriuError, find_criu

pytestmark = [
    pytest.mark.criu,
    pytest.mark.skipif(os.geteuid() != 0, reason="CRIU dump/restore and criu check need root"),
]


@pytest.fixture(scope="module")
def criu() -> Criu:
    # Not a skip: the test command installs CRIU first, so a missing one is a broken install.
    assert find_criu(), "no CRIU found: run scripts/install-criu.sh (the test command does)"
    return Criu()


def test_installed_criu_is_the_pinned_version_and_passes_check(criu):
    version = criu.version()
    assert version.numbers[:2] >= (4, 2)
    assert version.fills_huge_pages and version.fills_in_parallel, f"{version}: not the CRIU scripts/build-criu.sh builds"
    check = criu.check()
    assert check.ok, check.output


def test_doctor_says_criu_works_and_no_gpu_here():
    result = subprocess.run([sys.executable, "-m", "coldsnap", "doctor", "--json"], capture_output=True, timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["criu"]["version_ok"] and report["criu"]["check_ok"], report["criu"]
    if not os.path.exists("/proc/driver/nvidia/version"):
        assert report["cuda"]["available"] is False and report["cuda"]["devices"] == []
        assert report["nvidia_driver"] is None
    table = subprocess.run([sys.executable, "-m", "coldsnap", "doctor"], capture_output=True, text=True, timeout=120)
    assert re.search(r"^criu check\s+ok\s+Looks good\.$", table.stdout, re.M), table.stdout


def test_dump_and_restore_a_process_tree(criu, tmp_path):
    # Its own session (setsid), so CRIU needs no --shell-job.
    sleeper = subprocess.Popen(["sleep", "600"], start_new_session=True)
    pid = sleeper.pid
    images = tmp_path / "images"
    images.mkdir()
    try:
        dump = subprocess.run([criu.path, "dump", "-t", str(pid), "-D", str(images), "-o", "dump.log"], capture_output=True, timeout=60)
        assert dump.returncode == 0, (images / "dump.log").read_text()[-2000:]
        sleeper.wait(timeout=10)  # reap it: restore reuses the pid
        restore = subprocess.run(
            [criu.path, "restore", "-D", str(images), "-d", "-o", "restore.log"], capture_output=True, timeout=60
        )
        assert restore.returncode == 0, (images / "restore.log").read_text()[-2000:]
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            assert handle.read().split(b"\0")[:2] == [b"sleep", b"600"]
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        time.sleep(0.05)


def test_missing_criu_is_a_typed_error(monkeypatch):
    monkeypatch.setenv("COLDSNAP_CRIU", "/nonexistent/criu")
    with pytest.raises(CriuError) as caught:
        Criu()
    assert caught.value.op == "locate" and "COLDSNAP_CRIU=/nonexistent/criu" in str(caught.value)

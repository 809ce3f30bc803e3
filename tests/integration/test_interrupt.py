"""A capture stopped with SIGTERM kills what it started and still publishes a failed receipt."""

import json
import signal
import subprocess
import sys
import time

from tests.processes import group_members, launched_pid


def test_sigterm_during_capture(tmp_path):
    receipt = tmp_path / "receipt.json"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "coldsnap", "capture", "--engine", "torch-lm", "--out", str(tmp_path / "artifact"),
         "--port", "1", "--receipt-json", str(receipt), "--", sys.executable, "-c", "import time; time.sleep(120)"],
        stderr=subprocess.PIPE,
    )
    line = launcher.stderr.readline()
    while b"waiting for its coldsnap agent" not in line:
        assert line, "capture ended before it waited for the command"
        line = launcher.stderr.readline()
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=60) == 1
    document = json.loads(receipt.read_text())
    assert document["state"] == "failed" and document["error"]["code"] == "interrupted"
    time.sleep(0.2)
    assert group_members(launched_pid(document)) == []  # the started command was killed
    assert not (tmp_path / "artifact" / "artifact.json").exists()

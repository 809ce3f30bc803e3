"""`coldsnap demo` runs the whole capture/restore cycle and reports it."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytestmark = [pytest.mark.criu, pytest.mark.skipif(os.geteuid() != 0, reason="CRIU needs root")]


def test_demo_json(tmp_path):
    """Also: the demo leaves nothing in the temporary folder or the state root it was given (a killed
    server's socket files, compile caches, its restore's state folder), only the host caches the state
    root keeps by design."""
    scratch, state = tmp_path / "tmp", tmp_path / "state"
    scratch.mkdir()
    state.mkdir()
    result = subprocess.run([sys.executable, "-m", "coldsnap", "demo", "--json", "--dir", str(tmp_path / "demo")],
                            capture_output=True, timeout=600,
                            env={**os.environ, "TMPDIR": str(scratch), "COLDSNAP_STATE_DIR": str(state)})
    assert sorted(p.name for p in scratch.iterdir()) == []
    # (host caches: the model folder's hash records, CRIU's kernel probes of this boot)
    assert sorted(p.name for p in state.iterdir() if p.is_dir() and p.name not in ("records", "criu-kdat")) == []
    assert result.returncode == 0, result.stderr.decode()
    figures = json.loads(result.stdout)
    assert figures["same_tokens_as_cold_start"] is True
    assert figures["cold_start_to_first_token_s"] > 0 and figures["restore_to_first_validated_token_s"] > 0
    assert "restore.criu_restore" in figures["restore_phases_s"] and "capture.criu_dump" in figures["capture_phases_s"]
    assert (tmp_path / "demo" / "artifact" / "artifact.json").exists()
    assert figures["image_to_non_model_rss"] <= 1.1  # the image holds no weights and no KV

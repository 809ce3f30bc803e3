"""Every benchmark answers ``--help`` on a machine without a GPU or an engine: its description and
arguments, no traceback (the GPU work starts in ``main``, never at import)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py")
                    if p.stem not in ("__init__", "common", "equality", "vllm_state_probe"))


def test_the_benchmarks_are_found():
    assert {"vllm_startup", "sglang_startup", "restore_latency", "nccl_residue"} <= set(BENCHMARKS)


@pytest.mark.parametrize("module", BENCHMARKS)
def test_a_benchmark_explains_itself(module):
    done = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", "--help"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 0 and "usage:" in done.stdout and "Traceback" not in done.stderr, done.stderr[-2000:]

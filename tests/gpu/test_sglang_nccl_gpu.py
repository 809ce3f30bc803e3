"""SGLang's NCCL teardown and rebuild on one GPU (tests/gpu/sglang_nccl_checks.py), in its own process; skipped
without SGLang."""

import subprocess
import sys

import pytest

from tests.gpu.sglang_nccl_checks import SKIP

pytestmark = pytest.mark.gpu


def test_sglangs_nccl_is_aborted_and_its_groups_made_again():
    result = subprocess.run([sys.executable, "-m", "tests.gpu.sglang_nccl_checks"], capture_output=True, text=True,
                            timeout=600)
    print(result.stdout)
    if result.returncode == SKIP:
        pytest.skip(result.stdout.strip().splitlines()[-1])
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-6000:]

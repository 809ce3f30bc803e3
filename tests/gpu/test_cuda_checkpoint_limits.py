"""The CUDA checkpoint API's limits on two GPUs (tests/gpu/cuda_checkpoint_limits.py), in its own process."""

import subprocess
import sys

import pytest

from tests.gpu.cuda_checkpoint_limits import SKIP

pytestmark = pytest.mark.gpu


def test_the_states_coldsnap_tears_down_to_restore():
    result = subprocess.run([sys.executable, "-m", "tests.gpu.cuda_checkpoint_limits"], capture_output=True,
                            text=True, timeout=600)
    print(result.stdout)
    if result.returncode == SKIP:
        pytest.skip(result.stdout.strip().splitlines()[-1])
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]

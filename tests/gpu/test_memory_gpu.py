"""Stable regions, torch allocation and hydration on the GPU; each check in its own process."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

# Read the check names without importing the module (it imports torch, absent in CI).
CHECK_NAMES = [
    node.name
    for node in ast.parse((Path(__file__).parent / "gpu_checks.py").read_text()).body
    if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")
]


SKIP = 77  # gpu_checks.SKIP: the check needs hardware this host lacks


@pytest.mark.parametrize("name", CHECK_NAMES)
def test_gpu_check(name):
    result = subprocess.run([sys.executable, "-m", "tests.gpu.gpu_checks", name], capture_output=True, text=True, timeout=300)
    print(result.stdout)
    if result.returncode == SKIP:  # the check says why it cannot run on this host
        pytest.skip(result.stdout.strip().splitlines()[-1])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]

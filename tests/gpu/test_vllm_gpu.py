"""vLLM on the GPU (tests/gpu/vllm_checks.py), each check in its own process; skipped without vLLM."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

CHECK_NAMES = [
    node.name
    for node in ast.parse((Path(__file__).parent / "vllm_checks.py").read_text()).body
    if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")
]
SKIP = 77


@pytest.mark.parametrize("name", CHECK_NAMES)
def test_vllm_gpu_check(name):
    # vLLM's first start on a fresh host compiles and warms kernels for minutes
    result = subprocess.run([sys.executable, "-m", "tests.gpu.vllm_checks", name], capture_output=True, text=True,
                            timeout=1500)
    print(result.stdout)
    if result.returncode == SKIP:
        pytest.skip(result.stdout.strip().splitlines()[-1])
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-6000:]

"""coldsnap._C builds and imports without a GPU, and says why CUDA is unavailable."""

import subprocess
import sys
from pathlib import Path

import pytest

from coldsnap.native import native

NO_DRIVER = not Path("/proc/driver/nvidia/version").exists()


def test_extension_loads_and_reports_how_it_was_built():
    info = native().build_info()
    assert info["cuda_loading"] == "dlopen" and info["cuda_library"] == "libcuda.so.1"


@pytest.mark.skipif(not NO_DRIVER, reason="this host has an NVIDIA driver (tests/gpu covers it)")
def test_probe_without_driver_says_why():
    probe = native().cuda_probe()
    assert probe["available"] is False
    assert probe["reason"].startswith("libcuda.so.1 not found")
    assert probe["devices"] == [] and probe["checkpoint_api"] is False and probe["vmm_api"] is False


@pytest.mark.skipif(not NO_DRIVER, reason="this host has an NVIDIA driver (tests/gpu covers it)")
def test_driver_calls_raise_typed_error_not_crash():
    C = native()
    with pytest.raises(C.CudaError) as caught:
        C.driver_version()
    assert caught.value.code is None and "libcuda.so.1" in str(caught.value)


def test_extension_is_not_linked_against_cuda():
    path = native().__file__
    ldd = subprocess.run(["ldd", path], capture_output=True, text=True, check=True).stdout
    assert "libcuda" not in ldd and "libcudart" not in ldd


def test_import_coldsnap_touches_no_gpu_and_no_engine():
    code = (
        "import sys, coldsnap, coldsnap.contracts, coldsnap.cli, coldsnap_vllm, coldsnap_sglang\n"
        "bad = [m for m in ('torch', 'vllm', 'sglang', 'coldsnap._C') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)

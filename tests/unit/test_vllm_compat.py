"""coldsnap's vLLM plugin across releases: which hooks it picks on 0.26 and 0.33 (their API surfaces,
read from the wheels by scripts/vllm-api-surface.py), and that it loads harmlessly on a vLLM it does not
support. vLLM 0.32's CPU build runs the plugin end to end in tests/integration/test_vllm_cpu.py."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from coldsnap_vllm import compat

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
REPO = Path(__file__).resolve().parents[2]


def surface(version: str) -> dict[str, bool]:
    return json.loads((FIXTURES / f"vllm-{version}-surface.json").read_text())["symbols"]


def test_the_recorded_surfaces_cover_every_probed_symbol():
    for version in ("0.26.0", "0.33.0"):
        assert set(surface(version)) == set(compat.PROBED), f"re-record {version}: scripts/vllm-api-surface.py"


def test_vllm_0_26_hooks():
    found = compat.probe(surface("0.26.0").__getitem__)
    assert found == {
        # one KV buffer per layer, in V1 (a method) and in Model Runner V2 (the default on Hopper)
        "kv_allocation": ["vllm.v1.worker.gpu_model_runner:GPUModelRunner._allocate_kv_cache_tensors",
                          "vllm.v1.worker.gpu.attn_utils:_allocate_kv_cache"],
        "build_model": compat.INITIALIZE_MODEL,
        "online_quantization": "model",
        "sleep_backends": True,
        "nccl_rebuild": "constructor",
        "distributed_checkpoint_hooks": False,
        "load_format": True,
    }


def test_vllm_0_33_hooks():
    found = compat.probe(surface("0.33.0").__getitem__)
    assert found == {
        "kv_allocation": ["vllm.v1.worker.utils:allocate_kv_cache"],
        "build_model": compat.CREATE_MODEL,
        "online_quantization": "config",
        "sleep_backends": True,
        "nccl_rebuild": "from_unique_id_bytes",
        "distributed_checkpoint_hooks": True,
        "load_format": True,
    }


@pytest.mark.parametrize("version, ok", [("0.26.0", True), ("0.33.0", True), ("0.33.1rc1", True), ("0.25.1", False),
                                         ("0.34.0", False), ("1.0.0", False), ("unknown", False)])
def test_supported_range(version, ok):
    assert compat.supported(version) is ok


class _Tensor:
    def __init__(self, size, block_stride=0):
        self.size, self.block_stride = size, block_stride


class _Config:
    def __init__(self, *tensors):
        self.kv_cache_tensors = list(tensors)


def test_kv_capacity_per_layer_shared_and_packed():
    from coldsnap_vllm.placement import kv_capacity

    per_layer = _Config(_Tensor(5000), _Tensor(5000), _Tensor(100))
    assert kv_capacity(per_layer, shared_backing=False) == 8192 + 8192 + 4096  # 0.26: each its own, 4 KiB-aligned
    assert kv_capacity(per_layer, shared_backing=True) == 8192  # 0.27+: one backing of the common size
    packed = _Config(_Tensor(8192, block_stride=64), _Tensor(8192, block_stride=64), _Tensor(4096))
    assert kv_capacity(packed, shared_backing=False) == 8192 + 4096  # packed tensors alias one backing


def _fake_vllm(tmp_path: Path, version: str, modules: dict[str, str]) -> dict[str, str]:
    """A stand-in ``vllm`` package (what a release outside the supported range may look like)."""
    root = tmp_path / "site"
    for name, source in {"vllm": f"__version__ = {version!r}\n", **modules}.items():
        path = root.joinpath(*name.split(".")) / "__init__.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(REPO)])}


REGISTER = textwrap.dedent("""
    import logging, sys
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s", stream=sys.stdout)
    import coldsnap_vllm
    coldsnap_vllm.register()
    coldsnap_vllm.register()
    print("installed", coldsnap_vllm.register.installed)
""")


def test_plugin_loads_harmlessly_against_an_unsupported_vllm(tmp_path):
    pytest.importorskip("torch")
    env = _fake_vllm(tmp_path, "0.20.0", {"vllm.model_executor": ""})
    done = subprocess.run([sys.executable, "-c", REGISTER], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    warnings = [line for line in done.stdout.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1, done.stdout  # once, though the engine registers twice
    assert "vLLM 0.20.0" in warnings[0] and "runs without coldsnap" in warnings[0]
    assert done.stdout.rstrip().endswith("installed False")

"""coldsnap's vLLM plugin across releases: which hooks it picks on 0.26, 0.31, 0.32 and 0.33 (their API
surfaces, read from the wheels by scripts/api-surface.py), and that it loads harmlessly on a vLLM it
does not support. vLLM 0.32's CPU build runs the plugin end to end in tests/integration/test_vllm_cpu.py."""

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


SURFACES = ("0.26.0", "0.31.0", "0.32.0", "0.33.0")  # each has its test below


def surface(version: str) -> dict[str, bool]:
    return json.loads((FIXTURES / f"vllm-{version}-surface.json").read_text())["symbols"]


def test_the_recorded_surfaces_cover_every_probed_symbol():
    recorded = sorted(p.name.split("-")[1] for p in FIXTURES.glob("vllm-*-surface.json"))
    assert recorded == sorted(SURFACES), "a recorded surface without its test (or the reverse)"
    for version in SURFACES:
        assert set(surface(version)) == set(compat.PROBED), f"re-record {version}: scripts/api-surface.py"


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
        "sleep_pools": True,
        "recovery_replay": True,
        "vllm_snapshot_guard": [],  # no `vllm snapshot` before 0.31
        "hisparse_kv_binding": False,
    }


VLLM_0_33_HOOKS = {
    "kv_allocation": ["vllm.v1.worker.utils:allocate_kv_cache"],
    "build_model": compat.CREATE_MODEL,
    "online_quantization": "config",
    "sleep_backends": True,
    "nccl_rebuild": "from_unique_id_bytes",
    "distributed_checkpoint_hooks": True,  # from 0.27
    "load_format": True,
    "sleep_pools": True,
    "recovery_replay": True,
    "vllm_snapshot_guard": [compat.SNAPSHOT_CREATE_CHECK, compat.SNAPSHOT_CHILD],  # `vllm snapshot`, from 0.31
    "hisparse_kv_binding": True,  # from 0.30; refused by the loader
}


@pytest.mark.parametrize("version, differences", [
    ("0.31.0", {"online_quantization": "model"}),  # 0.31 builds with create_model, tells online quantization late
    ("0.32.0", {}),
    ("0.33.0", {}),
])
def test_vllm_0_31_to_0_33_hooks(version, differences):
    assert compat.probe(surface(version).__getitem__) == {**VLLM_0_33_HOOKS, **differences}


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
    assert kv_capacity(per_layer, shared_backing=True) == 8192  # 0.29+: one backing of the common size
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


# The KV allocation code of vLLM 0.26 (V1 `_allocate_kv_cache_tensors`, MRV2 `_allocate_kv_cache`: the
# same loop) and 0.32+ (`allocate_kv_cache`: one backing), reduced to what touches torch; run through the
# stand-in against a real host region.
ALLOCATORS = '''
import torch

def per_layer(kv_cache_config, device):
    raw, packed = {}, None
    for t in kv_cache_config.kv_cache_tensors:
        if t.block_stride > 0:
            if packed is None:
                packed = torch.zeros(t.size, dtype=torch.int8, device=device)
            tensor = packed
        else:
            tensor = torch.zeros(t.size, dtype=torch.int8, device=device)
        for name in t.shared_by:
            raw[name] = tensor
    return raw

def shared(kv_cache_config, device):
    buf = torch.zeros(kv_cache_config.kv_cache_tensors[0].size, dtype=torch.int8, device=device)
    scratch = torch.zeros(16, dtype=torch.float32, device=device)  # not a KV buffer: stays torch's
    return {name: buf for t in kv_cache_config.kv_cache_tensors for name in t.shared_by}, scratch
'''


class _Layer(_Tensor):
    def __init__(self, size, names, block_stride=0):
        super().__init__(size, block_stride)
        self.shared_by = names


def _allocators(tmp_path):
    import importlib.util

    path = tmp_path / "vllm_like_allocators.py"
    path.write_text(ALLOCATORS)
    spec = importlib.util.spec_from_file_location("vllm_like_allocators", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_per_layer_kv_buffers_are_carved_from_one_region(tmp_path, fresh_regions):
    torch = pytest.importorskip("torch")
    from coldsnap_vllm.placement import call_with_kv_region, kv_capacity

    allocators = _allocators(tmp_path)
    config = _Config(_Layer(5000, ["l0"]), _Layer(5000, ["l1"]), _Layer(12288, ["l2", "l3"]))
    raw, region = call_with_kv_region(allocators.per_layer, kv_capacity(config, False), "host", 0, config, "cpu")
    assert region is not None and region.tag == "kv_cache"
    starts = sorted(t.data_ptr() - region.base for t in {id(t): t for t in raw.values()}.values())
    assert starts == [0, 8192, 16384]  # each layer its own 4 KiB-aligned slice, in order
    assert raw["l2"] is raw["l3"] and raw["l0"].numel() == 5000 and raw["l0"].dtype == torch.int8
    assert all(int(t.abs().sum()) == 0 for t in raw.values())  # zeros, as torch.zeros promised
    assert allocators.torch is torch  # the module's torch is back


def test_a_shared_backing_takes_one_slice_and_other_tensors_stay_torchs(tmp_path, fresh_regions):
    pytest.importorskip("torch")
    from coldsnap_vllm.placement import call_with_kv_region, kv_capacity

    allocators = _allocators(tmp_path)
    config = _Config(_Layer(20000, ["l0"]), _Layer(20000, ["l1"]))
    (raw, scratch), region = call_with_kv_region(allocators.shared, kv_capacity(config, True), "host", 0, config, "cpu")
    assert region is not None and raw["l0"].data_ptr() == region.base and region.allocations() == [(0, 20000)]
    assert not region.base <= scratch.data_ptr() < region.base + region.size


def test_kv_buffers_that_do_not_fit_leave_the_kv_cache_outside_the_region(tmp_path, fresh_regions):
    pytest.importorskip("torch")
    from coldsnap_vllm.placement import call_with_kv_region

    allocators = _allocators(tmp_path)
    config = _Config(_Layer(2 << 20, ["l0"]), _Layer(2 << 20, ["l1"]))
    # a planned size too small for this vLLM's allocation pattern: no half-placed KV cache is reported
    raw, region = call_with_kv_region(allocators.per_layer, 2 << 20, "host", 0, config, "cpu")
    assert region is None and len(raw) == 2


class _Worker:
    """vLLM's ``Worker`` as far as its memory-pool context goes (0.26 and 0.33 alike)."""

    def __init__(self, load_format, sleep_mode=True, backend="cumem"):
        from types import SimpleNamespace

        self.vllm_config = SimpleNamespace(
            load_config=SimpleNamespace(load_format=load_format),
            model_config=SimpleNamespace(enable_sleep_mode=sleep_mode, sleep_mode_backend=backend))

    def _maybe_get_memory_pool_context(self, tag):
        return f"cumem pool {tag}"


def test_coldsnap_loads_stay_out_of_the_sleep_pools(monkeypatch, caplog):
    from types import SimpleNamespace

    monkeypatch.setattr(compat, "_warned", set())
    worker_module = SimpleNamespace(Worker=type("Worker", (_Worker,), {}))
    compat.keep_coldsnap_loads_out_of_sleep_pools(worker_module)
    compat.keep_coldsnap_loads_out_of_sleep_pools(worker_module)  # once only: not wrapped twice
    Worker = worker_module.Worker
    assert Worker._maybe_get_memory_pool_context.__wrapped__ is _Worker._maybe_get_memory_pool_context

    assert Worker("safetensors")._maybe_get_memory_pool_context("weights") == "cumem pool weights"
    monkeypatch.setenv(compat.SLEEP_BACKEND_ENV, "coldsnap")
    with caplog.at_level("WARNING", logger="vllm.coldsnap"):
        for tag in ("weights", "kv_cache"):
            context = Worker("coldsnap")._maybe_get_memory_pool_context(tag)
            with context:  # a no-op context: torch's own allocator
                pass
            assert context != f"cumem pool {tag}"
    assert caplog.text == ""
    monkeypatch.delenv(compat.SLEEP_BACKEND_ENV)
    with caplog.at_level("WARNING", logger="vllm.coldsnap"):
        Worker("coldsnap")._maybe_get_memory_pool_context("weights")  # vLLM's cumem backend: said once
        Worker("coldsnap")._maybe_get_memory_pool_context("kv_cache")
    assert caplog.text.count("only coldsnap's sleep backend releases") == 1
    assert Worker("coldsnap", backend="coldsnap")._maybe_get_memory_pool_context("weights") != "cumem pool weights"


def test_a_vllm_without_the_pool_hook_loses_only_that(monkeypatch, caplog):
    from types import SimpleNamespace

    monkeypatch.setattr(compat, "_warned", set())
    with caplog.at_level("WARNING", logger="vllm.coldsnap"):
        compat.keep_coldsnap_loads_out_of_sleep_pools(SimpleNamespace())
    assert "disabled on vLLM" in caplog.text and "_maybe_get_memory_pool_context" in caplog.text


def _snapshot_args(load_format="coldsnap", **more):
    from types import SimpleNamespace

    return SimpleNamespace(load_format=load_format, **more)  # vLLM's parsed engine arguments, as far as read


def test_vllm_snapshot_of_a_coldsnap_model_needs_coldsnaps_sleep_backend(monkeypatch):
    monkeypatch.delenv(compat.SLEEP_BACKEND_ENV, raising=False)
    with pytest.raises(ValueError, match="needs coldsnap's sleep backend: vLLM's 'cumem' backend") as refused:
        compat.refuse_vllm_snapshot_of_coldsnap_regions(_snapshot_args())  # 0.31/0.32: no --sleep-mode-backend
    assert "CUDA checkpoint image" in str(refused.value) and compat.SLEEP_BACKEND_ENV in str(refused.value)
    with pytest.raises(ValueError, match="'cumem'"):
        compat.refuse_vllm_snapshot_of_coldsnap_regions(_snapshot_args(sleep_mode_backend="cumem"))  # 0.33
    compat.refuse_vllm_snapshot_of_coldsnap_regions(_snapshot_args(sleep_mode_backend="coldsnap"))
    compat.refuse_vllm_snapshot_of_coldsnap_regions(_snapshot_args("safetensors"))  # not coldsnap's: vLLM's business
    monkeypatch.setenv(compat.SLEEP_BACKEND_ENV, "coldsnap")
    compat.refuse_vllm_snapshot_of_coldsnap_regions(_snapshot_args())


def _stand_in_module(name, **attributes):
    """A stand-in for one of vLLM's snapshot modules (``__spec__`` named as the real one's)."""
    import importlib.machinery
    import types

    module = types.ModuleType("__main__" if name == "as __main__" else name)
    module.__spec__ = importlib.machinery.ModuleSpec(compat.SNAPSHOT_SERVER_MODULE if name == "as __main__" else name,
                                                    None)
    for key, value in attributes.items():
        setattr(module, key, value)
    return module


def test_vllm_snapshot_create_refuses_after_vllms_own_checks(monkeypatch):
    monkeypatch.delenv(compat.SLEEP_BACKEND_ENV, raising=False)
    checked = []

    def validate_create_args(args):
        checked.append(args)

    cli = _stand_in_module(compat.SNAPSHOT_CLI_MODULE, validate_create_args=validate_create_args)
    compat.guard_vllm_snapshot_create(cli)
    compat.guard_vllm_snapshot_create(cli)  # plugins load more than once: wrapped once
    assert cli.validate_create_args.__wrapped__ is validate_create_args
    cli.validate_create_args(_snapshot_args("safetensors"))
    with pytest.raises(ValueError, match="needs coldsnap's sleep backend"):
        cli.validate_create_args(_snapshot_args())
    assert len(checked) == 2  # vLLM's own checks ran first, both times


@pytest.mark.parametrize("name", [compat.SNAPSHOT_SERVER_MODULE, "as __main__"])
def test_vllm_snapshot_server_refuses_before_the_engine_starts(monkeypatch, name):
    import asyncio

    monkeypatch.delenv(compat.SLEEP_BACKEND_ENV, raising=False)
    started = []

    async def run_vllm_snapshot_child(control, args):
        started.append(args.load_format)

    server = _stand_in_module(name, run_vllm_snapshot_child=run_vllm_snapshot_child)
    compat.guard_vllm_snapshot_server(server)
    compat.guard_vllm_snapshot_server(server)
    assert server.run_vllm_snapshot_child.__wrapped__ is run_vllm_snapshot_child
    with pytest.raises(ValueError, match="needs coldsnap's sleep backend"):
        asyncio.run(server.run_vllm_snapshot_child(None, _snapshot_args()))
    asyncio.run(server.run_vllm_snapshot_child(None, _snapshot_args(sleep_mode_backend="coldsnap")))
    assert started == ["coldsnap"]


def test_an_ordinary_main_module_and_a_vllm_without_the_hooks_are_left_alone(monkeypatch, caplog):
    import types

    monkeypatch.setattr(compat, "_warned", set())
    main = types.ModuleType("__main__")
    main.run_vllm_snapshot_child = object()  # not vLLM's snapshot server, whatever it holds
    compat.guard_vllm_snapshot_server(main)
    assert not hasattr(main.run_vllm_snapshot_child, "__wrapped__")
    with caplog.at_level("WARNING", logger="vllm.coldsnap"):
        compat.guard_vllm_snapshot_create(_stand_in_module(compat.SNAPSHOT_CLI_MODULE))
        compat.guard_vllm_snapshot_server(_stand_in_module(compat.SNAPSHOT_SERVER_MODULE))
    assert caplog.text.count("disabled on vLLM") == 2 and "validate_create_args" in caplog.text


def test_the_loader_refuses_hisparse_with_a_reason():
    from types import SimpleNamespace

    compat.refuse_hisparse(SimpleNamespace(attention_config=SimpleNamespace(hisparse_config=None)))
    compat.refuse_hisparse(SimpleNamespace())  # a vLLM without HiSparse (before 0.30)
    with pytest.raises(RuntimeError, match="hisparse KV binding is not supported by coldsnap"):
        compat.refuse_hisparse(SimpleNamespace(attention_config=SimpleNamespace(hisparse_config=object())))


class _StandInSleepFactory:
    """A stand-in for vLLM's ``SleepModeBackendFactory``: creates the backend the config names."""

    _registry: dict = {}

    @classmethod
    def create_backend(cls, model_config):
        return model_config.sleep_mode_backend


def test_the_sleep_backend_variable_leaves_models_coldsnap_did_not_load_to_vllm(monkeypatch, caplog):
    pytest.importorskip("torch")
    from types import SimpleNamespace

    import coldsnap_vllm
    from coldsnap_vllm.process import ProcessState

    factory = type("Factory", (_StandInSleepFactory,), {})
    monkeypatch.setenv(compat.SLEEP_BACKEND_ENV, "coldsnap")
    coldsnap_vllm._select_sleep_backend(factory)
    config = SimpleNamespace(sleep_mode_backend="cumem")
    monkeypatch.setattr(ProcessState, "placed", None)
    with caplog.at_level("INFO", logger="vllm.coldsnap"):
        assert factory.create_backend(config) == "cumem"  # vLLM's own sleep, as configured
    assert "not loaded with --load-format coldsnap" in caplog.text
    monkeypatch.setattr(ProcessState, "placed", object())  # coldsnap's loader placed the weights
    assert factory.create_backend(config) == "coldsnap" and config.sleep_mode_backend == "cumem"

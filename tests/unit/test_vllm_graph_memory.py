"""vLLM's CUDA-graph pool in coldsnap's cudagraph region (coldsnap_vllm.graph_memory): when it is set up,
and that every holder of vLLM's old pool id is pointed at the new one. No GPU here: vLLM's platform and
graph wrapper are stand-ins (sys.modules), the region's reservation is refused or not reached; the
region itself, a capture into it, its unmap and a 0xFF-poisoned replay run in
tests/gpu/gpu_checks.py::engine_graph_pool_scratch_discarded."""

from __future__ import annotations

import logging
import sys
import weakref
from types import ModuleType, SimpleNamespace

import pytest

from coldsnap.memory import RegionError
from coldsnap_vllm import compat, graph_memory


class FakeCudaPlatform:
    _global_graph_pool = None

    def graph_pool_handle(self):
        return ("torch", id(object()))


class FakeGraphWrapper:
    _all_instances: weakref.WeakSet = weakref.WeakSet()

    def __init__(self, pool):
        self.graph_pool = pool
        FakeGraphWrapper._all_instances.add(self)


@pytest.fixture
def fake_vllm(monkeypatch):
    """``vllm.platforms.current_platform`` and ``vllm.compilation.cuda_graph.CUDAGraphWrapper`` stand-ins."""
    FakeCudaPlatform._global_graph_pool = ("torch", 1)
    FakeGraphWrapper._all_instances = weakref.WeakSet()
    platforms = ModuleType("vllm.platforms")
    platforms.current_platform = FakeCudaPlatform()
    cuda_graph = ModuleType("vllm.compilation.cuda_graph")
    cuda_graph.CUDAGraphWrapper = FakeGraphWrapper
    for name, module in {"vllm": ModuleType("vllm"), "vllm.platforms": platforms,
                         "vllm.compilation": ModuleType("vllm.compilation"),
                         "vllm.compilation.cuda_graph": cuda_graph}.items():
        monkeypatch.setitem(sys.modules, name, module)
    return platforms.current_platform


def test_every_holder_of_the_old_pool_captures_into_the_new_one(fake_vllm):
    old = FakeCudaPlatform._global_graph_pool
    built_during_compilation = [FakeGraphWrapper(old), FakeGraphWrapper(old)]
    elsewhere = FakeGraphWrapper(("torch", 99))  # a wrapper given a pool of its own keeps it
    manager = SimpleNamespace(pool=old, graphs={}, capture=lambda: None,
                              breakable_cg_runner=SimpleNamespace(graph_pool=old))
    drafts = SimpleNamespace(prefill_cudagraph_manager=SimpleNamespace(pool=old, graphs={}, capture=lambda: None))
    runner = SimpleNamespace(cudagraph_manager=manager, speculator=drafts, block_tables=SimpleNamespace(pool=old))
    # Model Runner V2 builds its managers before its KV cache, whose hook sets the pool up: they are found
    assert compat.model_runner_v2_graph_managers(runner) == [manager, drafts.prefill_cudagraph_manager]

    assert compat.point_graph_captures_at(("region", 7), *compat.model_runner_v2_graph_managers(runner)) == old
    assert type(fake_vllm)._global_graph_pool == ("region", 7)
    assert [w.graph_pool for w in built_during_compilation] == [("region", 7)] * 2
    assert manager.pool == ("region", 7) and manager.breakable_cg_runner.graph_pool == ("region", 7)
    assert drafts.prefill_cudagraph_manager.pool == ("region", 7)
    assert runner.block_tables.pool == old  # not a graph manager
    assert elsewhere.graph_pool == ("torch", 99)


def test_a_fresh_pool_is_the_one_given_or_a_new_one_of_torchs(fake_vllm):
    wrapper = FakeGraphWrapper(FakeCudaPlatform._global_graph_pool)
    compat.move_graphs_to_a_fresh_pool(None, ("region", 8))
    assert wrapper.graph_pool == ("region", 8)
    compat.move_graphs_to_a_fresh_pool(None)
    assert wrapper.graph_pool[0] == "torch" and wrapper.graph_pool == type(fake_vllm)._global_graph_pool


def test_no_region_at_more_than_one_rank_or_when_switched_off(fake_vllm, monkeypatch):
    def must_not_reserve(*args, **kwargs):
        raise AssertionError("reserved")

    monkeypatch.setattr(graph_memory, "reserve", must_not_reserve)
    assert graph_memory.place_graph_pool(0, world=2) is None  # graphs with NCCL kernels are recaptured
    monkeypatch.setenv(graph_memory.GRAPH_REGION_ENV, "0")
    assert graph_memory.place_graph_pool(0, world=1) is None
    assert type(fake_vllm)._global_graph_pool == ("torch", 1)


def test_a_region_that_cannot_be_had_leaves_vllms_pool_with_one_warning(fake_vllm, monkeypatch, caplog):
    def refused(*args, **kwargs):
        raise RegionError("cuMemAddressReserve failed")

    monkeypatch.setattr(graph_memory, "reserve", refused)
    with caplog.at_level(logging.WARNING, logger="vllm.coldsnap"):
        assert graph_memory.place_graph_pool(0, world=1) is None
    assert type(fake_vllm)._global_graph_pool == ("torch", 1)
    assert [r.getMessage() for r in caplog.records if "cuMemAddressReserve" in r.getMessage()]


def test_the_poison_runs_only_when_asked(monkeypatch):
    region = SimpleNamespace(mapped_bytes=0, tensor=lambda *a: pytest.fail("touched"))
    monkeypatch.delenv(graph_memory.POISON_ENV, raising=False)
    assert not graph_memory.GraphRegionPoison.wanted()
    monkeypatch.setenv(graph_memory.POISON_ENV, "1")
    assert graph_memory.GraphRegionPoison.wanted()
    graph_memory.GraphRegionPoison(region)()  # nothing mapped: nothing to fill


def test_a_failure_pointing_vllm_at_the_pool_leaves_the_engine_running(fake_vllm, monkeypatch, caplog):
    """The plugin never breaks its engine: whatever fails while the pool is set up, vLLM keeps its own."""
    monkeypatch.setattr(graph_memory, "reserve", lambda *a, **k: SimpleNamespace(base=0x7000_0000_0000))
    monkeypatch.setattr(graph_memory, "engine_graph_pool", lambda tag: ("region", 3))

    def broken(*args):
        raise TypeError("a vLLM whose platform moved")

    monkeypatch.setattr(compat, "point_graph_captures_at", broken)
    with caplog.at_level(logging.WARNING, logger="vllm.coldsnap"):
        assert graph_memory.place_graph_pool(0, world=1, runner=None) is None
    assert any("TypeError" in r.getMessage() for r in caplog.records)


def test_an_attribute_that_raises_is_not_a_graph_manager():
    class Exploding:
        def __getattr__(self, name):
            raise RuntimeError("lazy object")

    manager = SimpleNamespace(pool=1, graphs={}, capture=lambda: None)
    runner = SimpleNamespace(weird=Exploding(), cudagraph_manager=manager)
    assert compat.model_runner_v2_graph_managers(runner) == [manager]

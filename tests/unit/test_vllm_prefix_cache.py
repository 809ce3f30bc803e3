"""A restored vLLM engine empties its prefix cache before its first request (coldsnap_vllm.prefix_cache).

The EngineCore stands in for vLLM's (no vLLM import: the wrapper takes any class with add_request and
reset_prefix_cache); a restore is a change of the process start time, as CRIU makes it.
"""

import logging
import types

from coldsnap_vllm import prefix_cache
from coldsnap_vllm.prefix_cache import RestoreWatch, install_prefix_cache_reset


class StandInEngineCore:
    def __init__(self, refuse: int = 0):
        self.events: list[str] = []
        self.refuse = refuse

    def add_request(self, request, wave=0):
        self.events.append(f"add {request}")

    def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
        if self.refuse:
            self.refuse -= 1
            self.events.append("reset refused")
            return False
        self.events.append("reset")
        return True


def _module(start: list[int]):
    cls = type("EngineCore", (StandInEngineCore,), {})
    module = types.SimpleNamespace(EngineCore=cls)
    return module, cls


def test_the_first_request_after_a_restore_empties_the_prefix_cache_once(monkeypatch):
    ticks = [100]
    monkeypatch.setattr(prefix_cache.host, "process_start_ticks", lambda: ticks[0])
    module, cls = _module(ticks)
    install_prefix_cache_reset(module)
    install_prefix_cache_reset(module)  # idempotent: one wrapper
    engine = cls()
    engine.add_request("a")
    assert engine.events == ["add a"]  # never restored: nothing emptied
    ticks[0] = 250  # CRIU restored the process: a new kernel task
    engine.add_request("b")
    engine.add_request("c")
    assert engine.events == ["add a", "reset", "add b", "add c"]
    ticks[0] = 400  # restored again (another restore of the same capsule)
    engine.add_request("d")
    assert engine.events[-2:] == ["reset", "add d"]


def test_a_refused_reset_is_tried_again_at_the_next_request(monkeypatch, caplog):
    ticks = [1]
    monkeypatch.setattr(prefix_cache.host, "process_start_ticks", lambda: ticks[0])
    module, cls = _module(ticks)
    install_prefix_cache_reset(module)
    engine = cls(refuse=1)
    ticks[0] = 2
    with caplog.at_level(logging.ERROR, logger="vllm.coldsnap"):
        engine.add_request("a")
        engine.add_request("b")
        engine.add_request("c")
    assert engine.events == ["reset refused", "add a", "reset", "add b", "add c"]
    assert "refused to empty its prefix cache" in caplog.text


def test_the_watch_tells_a_restore_by_the_start_time():
    ticks = [5]
    watch = RestoreWatch(lambda: ticks[0])
    assert not watch.restored()
    ticks[0] = 6
    assert watch.restored() and watch.restored()
    watch.settled()
    assert not watch.restored()


def test_a_vllm_without_the_hooks_or_with_the_fix_turned_off_runs_unchanged(monkeypatch, caplog):
    install_prefix_cache_reset(types.SimpleNamespace())  # no EngineCore: one warning, no raise
    module, cls = _module([1])
    monkeypatch.setenv(prefix_cache.KEEP_ENV, "1")
    with caplog.at_level(logging.WARNING, logger="vllm.coldsnap"):
        install_prefix_cache_reset(module)
    assert cls.add_request is StandInEngineCore.add_request
    assert "keeps its prefix cache" in caplog.text

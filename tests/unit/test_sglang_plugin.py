"""coldsnap_sglang's own logic without SGLang: the memory-saver factory, the agent's attachment after
``alloc_memory_pool`` (TP1 attaches, TP > 1 and a draft runner do not), the prefix-cache flush through
the server, and the graph hooks. The runner and the server are stand-ins (SGLang needs a GPU to run a
model); tests/integration/test_sglang_hooks.py runs the hooks inside SGLang's real modules."""

from __future__ import annotations

import http.server
import logging
import threading
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from coldsnap.agent.placement import place_model_in_region  # noqa: E402
from coldsnap.memory import release_all  # noqa: E402
from coldsnap_sglang import agent_bootstrap, memory_saver  # noqa: E402
from coldsnap_sglang.process import ProcessState  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_process_state(monkeypatch):
    for name in ("active", "placed", "memory", "agent", "runner", "recovery"):
        monkeypatch.setattr(ProcessState, name, getattr(ProcessState, name))
    monkeypatch.setattr(ProcessState, "recovery_files", [])
    monkeypatch.delenv("COLDSNAP_CONTROL", raising=False)
    yield
    release_all()


def _placed() -> None:
    ProcessState.active = True
    ProcessState.placed = place_model_in_region(torch.nn.Linear(16, 16))  # a host region on this machine


def test_memory_saver_is_sglangs_until_the_coldsnap_load_format_placed_a_model(caplog):
    sglangs = object()
    assert memory_saver.create(lambda enable: sglangs, False) is sglangs
    ProcessState.active = True  # the load format was chosen, nothing placed yet (the runner's own adapter)
    assert memory_saver.create(lambda enable: sglangs, False) is sglangs
    _placed()
    adapter = memory_saver.create(lambda enable: sglangs, False)
    assert isinstance(adapter, memory_saver.ColdsnapMemorySaverAdapter) and not adapter.enabled
    with caplog.at_level(logging.WARNING, logger="sglang.coldsnap"):
        memory_saver.create(lambda enable: sglangs, True)
    assert "--enable-memory-saver is ignored" in caplog.text
    with adapter.region("kv_cache"):  # a host model: no pluggable allocator, ordinary allocation
        assert torch.zeros(4).sum() == 0


def _runner(**fields: object) -> SimpleNamespace:
    """A stand-in for SGLang's ModelRunner: the attributes the hook reads."""
    defaults: dict[str, object] = {"tp_size": 1, "is_draft_worker": False, "server_args": SimpleNamespace(pp_size=1)}
    return SimpleNamespace(**{**defaults, **fields})


def test_the_agents_model_memory_is_complete_after_alloc_memory_pool_at_tp1():
    _placed()
    runner = _runner()
    result = agent_bootstrap.after_alloc_memory_pool(lambda r: "pools", runner)
    assert result == "pools" and ProcessState.runner is runner
    assert ProcessState.memory is not None and set(ProcessState.memory.regions) == {"weights"}
    assert ProcessState.agent is None  # not under `coldsnap capture`: no control socket


@pytest.mark.parametrize("fields, warning", [
    ({"tp_size": 2}, "no agent attaches"),
    ({"is_draft_worker": True}, None),
])
def test_no_agent_for_a_draft_runner_or_at_tp_above_one(caplog, fields, warning):
    _placed()
    runner = _runner(**fields)
    with caplog.at_level(logging.WARNING, logger="sglang.coldsnap"):
        assert agent_bootstrap.after_alloc_memory_pool(lambda r: "pools", runner) == "pools"
    assert ProcessState.memory is None
    assert (warning in caplog.text) if warning else "coldsnap" not in caplog.text


def test_sglang_without_the_coldsnap_load_format_is_left_alone():
    runner = _runner()
    assert agent_bootstrap.after_alloc_memory_pool(lambda r: "pools", runner) == "pools"
    assert ProcessState.memory is None and ProcessState.runner is None


class _Server(http.server.BaseHTTPRequestHandler):
    status = 200
    seen: list[tuple[str, str]] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        type(self).seen.append(("POST", self.path))
        self.send_response(type(self).status)
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize("status", [200, 400])
def test_the_prefix_cache_is_flushed_through_the_server(status):
    _Server.status, _Server.seen = status, []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Server)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        ProcessState.runner = SimpleNamespace(server_args=SimpleNamespace(host="0.0.0.0", port=server.server_address[1]))
        if status == 200:
            agent_bootstrap.flush_scheduler_cache()
        else:  # SGLang answers 400 when the scheduler is not idle: the capture must not go on
            with pytest.raises(RuntimeError, match="/flush_cache failed"):
                agent_bootstrap.flush_scheduler_cache()
    finally:
        server.shutdown()
    assert _Server.seen == [("POST", "/flush_cache")]


def test_graphs_are_kept_or_dropped_and_captured_again():
    runner = SimpleNamespace(decode_cuda_graph_runner=object(), prefill_cuda_graph_runner=None)
    graphs = agent_bootstrap.SglangGraphs(runner)
    assert graphs.release_graphs("retain") == [] and runner.decode_cuda_graph_runner is not None
    assert graphs.release_graphs("recreate") == ["decode_cuda_graph_runner"]
    assert runner.decode_cuda_graph_runner is None

    def init_cuda_graphs() -> None:
        runner.decode_cuda_graph_runner = object()
        runner.prefill_cuda_graph_runner = object()

    runner.init_cuda_graphs = init_cuda_graphs
    assert graphs.recapture_graphs() == ["decode_cuda_graph_runner", "prefill_cuda_graph_runner"]

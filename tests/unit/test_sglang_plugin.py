"""coldsnap_sglang's own logic without SGLang: the memory-saver factory, the agent's attachment after
``alloc_memory_pool`` (TP 1 and TP > 1 attach; PP, DP and a draft runner do not), the prefix-cache flush through
the server, the graph hooks (a speculative draft's included), the refused memory-occupation endpoints
and the speculative settings the target's load reads. The runner and the server are stand-ins (SGLang needs a GPU to run a
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
    for name in ("active", "placed", "draft", "draft_expected", "draft_in_pack", "memory", "agent", "runner", "scheduler", "recovery",
                 "recovery_plan"):
        monkeypatch.setattr(ProcessState, name, getattr(ProcessState, name))
    monkeypatch.setattr(ProcessState, "recovery_files", [])
    monkeypatch.setattr(ProcessState, "replays", [])
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
    defaults: dict[str, object] = {"tp_size": 1, "is_draft_worker": False, "gpu_id": 0,
                                   "server_args": SimpleNamespace(pp_size=1, dp_size=1)}
    return SimpleNamespace(**{**defaults, **fields})


def test_the_agents_model_memory_is_complete_after_alloc_memory_pool_at_tp1():
    _placed()
    runner = _runner()
    result = agent_bootstrap.after_alloc_memory_pool(lambda r: "pools", runner)
    assert result == "pools" and ProcessState.runner is runner
    assert ProcessState.memory is not None and set(ProcessState.memory.regions) == {"weights"}
    assert ProcessState.agent is None  # not under `coldsnap capture`: no control socket


def test_at_tp_above_one_the_agent_takes_its_rank_and_the_sglang_collectives(monkeypatch):
    from coldsnap_sglang.distributed import SglangCollectives

    attached: dict[str, object] = {}
    monkeypatch.setattr(agent_bootstrap, "_tensor_parallel_surface", lambda: True)  # SGLang's modules, not here
    monkeypatch.setattr(agent_bootstrap, "_distributed_rank", lambda: (1, 2))
    monkeypatch.setattr("coldsnap.agent.attach", lambda memory, **kwargs: attached.update(kwargs))
    _placed()
    agent_bootstrap.after_alloc_memory_pool(lambda r: "pools", _runner(tp_size=2, tp_rank=1, gpu_id=1))
    assert (attached["rank"], attached["world"]) == (1, 2)
    assert isinstance(attached["collectives"], SglangCollectives) and attached["collectives"].rank == 1
    from coldsnap_sglang.scheduler_thread import in_lockstep
    assert attached["collectives"]._step is in_lockstep  # teardown and rebuild where every rank runs its own


@pytest.mark.parametrize("fields, warning", [
    ({"tp_size": 2}, "capture at TP > 1 disabled"),  # an SGLang without what the rebuild needs (none here)
    ({"server_args": SimpleNamespace(pp_size=2, dp_size=1)}, "no agent attaches"),
    ({"server_args": SimpleNamespace(pp_size=1, dp_size=2)}, "no agent attaches"),
    ({"is_draft_worker": True}, None),
])
def test_no_agent_for_a_draft_runner_or_with_pipeline_or_data_parallelism(caplog, fields, warning):
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


class _GraphPool:
    """A stand-in for SGLang's process-wide graph memory pool (``set_global_graph_memory_pool``)."""

    def __init__(self) -> None:
        self.pool: object = ("old", 1)

    def set(self, value: object) -> None:
        self.pool = value


def test_graphs_are_kept_or_dropped_and_captured_again():
    runner = SimpleNamespace(decode_cuda_graph_runner=object(), prefill_cuda_graph_runner=None)
    pool = _GraphPool()
    graphs = agent_bootstrap.SglangGraphs(runner, set_graph_pool=lambda: pool.set)
    assert graphs.release_graphs("retain") == [] and runner.decode_cuda_graph_runner is not None
    assert pool.pool == ("old", 1)  # kept with its graphs
    assert graphs.release_graphs("recreate") == ["decode_cuda_graph_runner"]
    assert runner.decode_cuda_graph_runner is None
    assert pool.pool is None  # the recapture takes a fresh pool: torch refuses to capture into the released one


def test_at_tp_above_one_graphs_are_dropped_whatever_the_policy():
    """They hold NCCL kernels of the communicators the snapshot ends."""
    runner = SimpleNamespace(decode_cuda_graph_runner=object(), prefill_cuda_graph_runner=object())
    graphs = agent_bootstrap.SglangGraphs(runner, set_graph_pool=lambda: _GraphPool().set, world=2)
    assert graphs.release_graphs("retain") == ["decode_cuda_graph_runner", "prefill_cuda_graph_runner"]

    def init_cuda_graphs() -> None:
        runner.decode_cuda_graph_runner = object()
        runner.prefill_cuda_graph_runner = object()

    runner.init_cuda_graphs = init_cuda_graphs
    assert graphs.recapture_graphs() == ["decode_cuda_graph_runner", "prefill_cuda_graph_runner"]


def _draft_worker() -> SimpleNamespace:
    """A stand-in for SGLang's spec worker (the scheduler's ``draft_worker``) over an EagleDraftWorker."""
    draft_runner = SimpleNamespace(decode_cuda_graph_runner=None, prefill_cuda_graph_runner=None)
    draft = SimpleNamespace(cuda_graph_runner=object(), cuda_graph_runner_for_draft_extend=object(),
                            draft_runner=draft_runner)
    spec = SimpleNamespace(draft_worker=draft, adaptive_controller=None, captured=0)

    def init_cuda_graphs() -> None:  # EAGLEWorkerV2.init_cuda_graphs → the draft's _capture_cuda_graphs
        spec.captured += 1
        draft.cuda_graph_runner, draft.cuda_graph_runner_for_draft_extend = object(), object()

    spec.init_cuda_graphs = init_cuda_graphs
    return spec


def test_a_speculative_drafts_graphs_are_dropped_and_captured_again_after_the_targets():
    order: list[str] = []
    runner = SimpleNamespace(decode_cuda_graph_runner=object(), prefill_cuda_graph_runner=None,
                             init_cuda_graphs=lambda: order.append("target"))
    spec = _draft_worker()
    graphs = agent_bootstrap.SglangGraphs(runner, lambda: spec, set_graph_pool=lambda: _GraphPool().set)
    assert graphs.release_graphs("retain") == [] and spec.draft_worker.cuda_graph_runner is not None
    assert graphs.release_graphs("recreate") == ["decode_cuda_graph_runner", "draft.cuda_graph_runner",
                                                 "draft.cuda_graph_runner_for_draft_extend"]
    assert spec.draft_worker.cuda_graph_runner is None and spec.draft_worker.cuda_graph_runner_for_draft_extend is None
    runner.init_cuda_graphs = lambda: (order.append("target"), setattr(runner, "decode_cuda_graph_runner", object()))
    spec_capture = spec.init_cuda_graphs
    spec.init_cuda_graphs = lambda: (order.append("draft"), spec_capture())
    assert graphs.recapture_graphs() == ["decode_cuda_graph_runner", "draft.cuda_graph_runner",
                                         "draft.cuda_graph_runner_for_draft_extend"]
    assert order == ["target", "draft"] and spec.captured == 1


def test_recreate_refuses_sglangs_adaptive_speculation():
    spec = _draft_worker()
    spec.adaptive_controller = object()  # its runtime states hold graph runners for every step size
    graphs = agent_bootstrap.SglangGraphs(SimpleNamespace(decode_cuda_graph_runner=None), lambda: spec,
                                          set_graph_pool=lambda: _GraphPool().set)
    with pytest.raises(RuntimeError, match="does not support SGLang's --speculative-adaptive"):
        graphs.release_graphs("recreate")
    assert spec.draft_worker.cuda_graph_runner is not None  # nothing dropped


def test_recreate_is_refused_before_anything_is_dropped_on_an_sglang_without_the_graph_pool_setter(monkeypatch):
    from coldsnap_sglang import compat

    monkeypatch.setattr(compat, "GRAPH_POOL_SETTER", "sglang.srt.model_executor.runner_utils.pool:gone")
    runner = SimpleNamespace(decode_cuda_graph_runner=object(), prefill_cuda_graph_runner=None)
    with pytest.raises(RuntimeError, match="graph policy 'recreate' needs SGLang's"):
        agent_bootstrap.SglangGraphs(runner).release_graphs("recreate")
    assert runner.decode_cuda_graph_runner is not None


def test_the_scheduler_is_noted_around_its_graph_capture():
    scheduler = SimpleNamespace(draft_worker="spec")
    assert agent_bootstrap.around_init_all_cuda_graphs(lambda s: "captured", scheduler) == "captured"
    assert ProcessState.scheduler is scheduler and agent_bootstrap._spec_worker() == "spec"


@pytest.mark.parametrize("load_format", ["coldsnap", "safetensors"])
def test_memory_occupation_is_refused_with_one_message_on_a_coldsnap_server(load_format):
    import asyncio

    async def release_memory_occupation(manager: object, obj: object, request: object = None) -> str:
        return "released"

    manager = SimpleNamespace(server_args=SimpleNamespace(load_format=load_format))
    call = memory_saver.refuse_memory_occupation(release_memory_occupation, manager, object(), None)
    if load_format != "coldsnap":
        assert asyncio.run(call) == "released"
        return
    with pytest.raises(ValueError) as refused:
        asyncio.run(call)
    message = str(refused.value)
    assert "/release_memory_occupation is not available on a server started with --load-format coldsnap" in message
    assert "coldsnap warm" in message and "coldsnap wake" in message


@pytest.mark.parametrize("spec, expected", [
    (None, None),  # an SGLang without get_spec, or not published yet
    ({"speculative_algorithm": None, "speculative_draft_model_path": None}, None),
    ({"speculative_algorithm": "NGRAM", "speculative_draft_model_path": None}, None),  # no draft model
    ({"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": "/m/draft",
      "speculative_draft_load_format": None}, "inherited"),
    ({"speculative_algorithm": "EAGLE", "speculative_draft_model_path": "/m/eagle",
      "speculative_draft_load_format": "safetensors"}, "safetensors"),
])
def test_the_targets_load_knows_whether_a_draft_follows(monkeypatch, spec, expected):
    from coldsnap_sglang import compat

    def get_spec() -> SimpleNamespace:
        if spec is None:
            raise ValueError("config namespace 'spec' not published")
        return SimpleNamespace(**spec)

    monkeypatch.setattr(compat, "lookup", lambda symbol: get_spec if symbol == compat.SPEC_CONFIG else None)
    assert compat.speculative_draft_load_format() == expected


@pytest.fixture
def scheduler_thread(monkeypatch):
    from coldsnap_sglang import scheduler_thread as module

    monkeypatch.setattr(module, "LOCKSTEP", module.Lockstep())
    return module


def test_graph_work_runs_on_the_schedulers_thread_between_two_iterations(scheduler_thread):
    """The agent's job runs inside the loop's request broadcast on the scheduler's own thread (no second
    Python thread fighting its busy loop for the GIL), and the requests go on; errors come back."""
    stop = threading.Event()
    passed: list[list[str]] = []

    def event_loop() -> None:  # SGLang's idle loop at TP 1: the request "broadcast" again and again, never blocking
        while not stop.is_set():
            passed.append(scheduler_thread.around_broadcast_requests(lambda receiver, requests: requests, None, ["r"]))

    loop = threading.Thread(target=event_loop, name="scheduler")
    loop.start()
    try:
        while not passed:
            pass
        assert scheduler_thread.on_scheduler_thread(lambda: threading.current_thread().name) == "scheduler"
        with pytest.raises(RuntimeError, match="capture failed"):
            scheduler_thread.on_scheduler_thread(lambda: (_ for _ in ()).throw(RuntimeError("capture failed")))
    finally:
        stop.set()
        loop.join()
    assert all(requests == ["r"] for requests in passed)  # the step's marker never reaches SGLang


def test_graph_work_runs_on_the_callers_thread_without_the_loop(scheduler_thread, monkeypatch):
    here = threading.current_thread().name
    assert scheduler_thread.on_scheduler_thread(lambda: threading.current_thread().name) == here  # never broadcast
    scheduler_thread.around_broadcast_requests(lambda receiver, requests: requests, None, [])  # once, then stopped
    monkeypatch.setattr(scheduler_thread, "ALONE_PICKUP_SECONDS", 0.05)
    ran: list[str] = []
    assert scheduler_thread.on_scheduler_thread(lambda: ran.append(threading.current_thread().name) or "done") == "done"
    scheduler_thread.around_broadcast_requests(lambda receiver, requests: requests, None, [])  # the loop comes back
    assert ran == [here]  # the caller took the job back, and it never runs twice


def test_the_marker_rides_the_requests_however_sglang_passes_them(scheduler_thread):
    scheduler_thread.around_broadcast_requests(lambda receiver, recv_reqs: recv_reqs, None, [])  # the loop runs
    ran: list[str] = []
    agent = threading.Thread(target=lambda: ran.append(scheduler_thread.on_scheduler_thread(lambda: "step")))
    agent.start()
    while not scheduler_thread.LOCKSTEP._submitted:
        pass
    assert scheduler_thread.around_broadcast_requests(lambda receiver, recv_reqs: recv_reqs, None, recv_reqs=["r"]) == ["r"]
    agent.join(5)
    assert ran == ["step"]

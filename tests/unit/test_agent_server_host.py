"""A real AgentServer over host model memory, driven by AgentClient through the typed protocol:
status → prepare (packs written, regions released, serving lock held) → resume (bytes back, lock
released), the refusals launchers rely on, and the engine hooks in their order."""

import os
import hashlib
import threading
import uuid

import pytest

from coldsnap.agent.client import AgentClient, AgentError
from coldsnap.agent.protocol import Prepare, PrepareReply, Resume, ResumeReply
from coldsnap.agent.hooks import AgentHooks
from coldsnap.agent.server import AgentServer
from coldsnap.hydrate import write_pack_from_regions
from tests.unit.test_model_memory_host import ALLOCATED, EMBED, HEAD, MiB, live_memory

pytestmark = pytest.mark.usefixtures("fresh_regions")

WATCHDOG = "coldsnap-agent-watchdog"


@pytest.fixture(autouse=True)
def patient_watchdog(monkeypatch):
    """Prepare arms a watchdog that SIGKILLs the process group (pytest's) if no resume comes in time."""
    monkeypatch.setenv("COLDSNAP_AGENT_RESUME_TIMEOUT_S", "3600")


def _agent(hooks: AgentHooks | None = None):
    memory, live = live_memory()
    lock = threading.Lock()
    control = f"@coldsnap-test-agent-{uuid.uuid4().hex[:12]}"
    agent = AgentServer(control, memory, lock, port=8123, hooks=hooks).start()
    return agent, AgentClient(control, timeout=30), memory, lock, live


def _sha256(path: str) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _watchdogs() -> set[threading.Thread]:
    """Watchdog threads alive now (a failed test may leave its own armed: compare before and after)."""
    return {t for t in threading.enumerate() if t.name == WATCHDOG}


def _wait_disarmed(watchdogs: set[threading.Thread]) -> None:
    """The watchdog polls the agent's state every 0.5 s and ends once it is no longer prepared."""
    for thread in watchdogs:
        thread.join(3)
        assert not thread.is_alive(), "the watchdog outlived the resume"


def test_status_prepare_resume_round_trip(tmp_path):
    agent, client, memory, lock, live = _agent()
    digest = memory.layout.digest()

    status = client.status()
    assert (status.state, status.port, status.rank, status.world_size) == ("serving", 8123, 0, 1)
    assert status.layout_digest == digest and status.layout == memory.layout.to_json_value()
    regions = {tag: (r.backend, r.base, r.size, r.mapped, r.high_water, r.chunk_bytes) for tag, r in status.regions.items()}
    assert regions == {
        "weights": ("host", memory.regions["weights"].base, 4 * MiB, 4 * MiB, 4 * MiB, 2 * MiB),
        "kv_cache": ("host", memory.regions["kv_cache"].base, 2 * MiB, 2 * MiB, 2 * MiB, 2 * MiB),
    }
    before = _watchdogs()

    progress: list[tuple[str, int, int]] = []
    prepared = client.prepare(Prepare(pack_dir=str(tmp_path)), on_progress=lambda *update: progress.append(update))
    assert isinstance(prepared, PrepareReply) and prepared.layout_digest == digest
    assert prepared.payload is not None and prepared.residual is not None
    for ref in (prepared.payload, prepared.residual):
        assert ref.path.startswith(str(tmp_path)) and _sha256(ref.path) == ref.sha256
    assert prepared.payload.path != prepared.residual.path
    assert {tag: r.mapped for tag, r in prepared.regions.items()} == {"weights": 0, "kv_cache": 0}
    assert {tag: r.base for tag, r in prepared.regions.items()} == {tag: r.base for tag, r in status.regions.items()}
    assert prepared.rss_bytes > 0 and prepared.device_bytes == 0 and prepared.graphs_released == []
    assert {"drain", "payload_write", "residual_write", "unmap_weights", "unmap_kv_cache"} <= set(prepared.seconds)
    assert progress and progress[-1] == ("writing the native pack", EMBED[1] + HEAD[1], EMBED[1] + HEAD[1])
    assert client.status().state == "prepared" and agent.state == "prepared"
    assert lock.locked()  # drained: the engine serves nothing while its memory is gone
    armed = _watchdogs() - before
    assert len(armed) == 1  # prepare armed one

    resume = Resume(layout_digest=digest, payload=prepared.payload.path, residual=prepared.residual.path)
    resumed = client.resume(resume, on_progress=lambda *update: progress.append(update))
    assert isinstance(resumed, ResumeReply) and resumed.rank == 0 and resumed.graphs_recaptured == []
    assert (resumed.hydrate.source, resumed.hydrate.bytes) == ("native", EMBED[1] + HEAD[1]) and not resumed.hydrate.staged
    assert progress[-1] == ("hydrating weights", EMBED[1] + HEAD[1], EMBED[1] + HEAD[1])
    assert {"map_weights", "map_kv_cache", "hydrate", "residual", "zero_kv_cache"} <= set(resumed.seconds)
    weights, kv = memory.regions["weights"], memory.regions["kv_cache"]
    assert bytes(weights.host_view(0, ALLOCATED)) == live[:ALLOCATED]
    assert bytes(kv.host_view()) == bytes(kv.mapped_bytes) and kv.mapped_bytes == 2 * MiB
    status = client.status()
    assert status.state == "serving"
    assert {t: r.mapped for t, r in status.regions.items()} == {"weights": 4 * MiB, "kv_cache": 2 * MiB}
    assert not lock.locked()
    _wait_disarmed(armed)


def test_refusals_leave_the_agent_where_it_was(tmp_path):
    agent, client, memory, lock, live = _agent()
    digest = memory.layout.digest()
    with pytest.raises(AgentError) as refused:
        client.resume(Resume(layout_digest=digest))
    assert refused.value.code == "agent.state" and "resume needs state prepared or standby, not serving" in str(refused.value)
    assert not lock.locked()

    before = _watchdogs()
    prepared = client.prepare(Prepare(pack_dir=str(tmp_path)))
    armed = _watchdogs() - before
    with pytest.raises(AgentError) as refused:
        client.prepare(Prepare(pack_dir=str(tmp_path)))
    assert refused.value.code == "agent.state" and "prepare needs state serving, not prepared" in str(refused.value)
    assert _watchdogs() - before == armed and len(armed) == 1  # the refused prepare armed no second one

    with pytest.raises(AgentError) as refused:
        client.resume(Resume(layout_digest="0" * 64, payload=prepared.payload.path, residual=prepared.residual.path))
    assert refused.value.code == "agent.memory" and refused.value.failure.type == "ModelMemoryError"
    assert "layout digest 000000000000" in refused.value.failure.message
    status = client.status()
    assert status.state == "prepared" and lock.locked()
    assert {t: r.mapped for t, r in status.regions.items()} == {"weights": 0, "kv_cache": 0}

    # a refused resume does not spend the prepared state: the launcher's next, right one succeeds
    resume = Resume(layout_digest=digest, payload=prepared.payload.path, residual=prepared.residual.path)
    resumed = client.resume(resume)
    assert resumed.hydrate.source == "native" and not lock.locked()
    assert bytes(memory.regions["weights"].host_view(0, ALLOCATED)) == live[:ALLOCATED]
    _wait_disarmed(armed)


def test_prepare_without_a_pack_dir_and_resume_from_a_pack_written_before(tmp_path):
    agent, client, memory, lock, live = _agent()
    # a pack cut earlier from the same layout (a capture's), not by this prepare
    earlier = write_pack_from_regions(tmp_path, memory.layout, memory.regions)
    before = _watchdogs()
    prepared = client.prepare(Prepare(pack_dir=None))
    assert prepared.payload is None and prepared.residual is None
    assert all(r.mapped == 0 for r in prepared.regions.values()) and lock.locked()
    armed = _watchdogs() - before

    with pytest.raises(AgentError) as refused:
        client.resume(Resume(layout_digest=memory.layout.digest()))
    assert refused.value.code == "agent.memory"
    assert refused.value.failure.message == "restoring the weights needs a payload pack or safetensors files"
    assert client.status().state == "prepared" and lock.locked()

    resumed = client.resume(Resume(layout_digest=memory.layout.digest(), payload=str(earlier.path)))
    assert resumed.hydrate.bytes == EMBED[1] + HEAD[1] and not lock.locked()
    weights = memory.regions["weights"]
    for offset, length in (EMBED, HEAD):
        assert bytes(weights.host_view(offset, length)) == live[offset:offset + length]
    _wait_disarmed(armed)


def test_hooks_run_in_order_around_the_memory_work(tmp_path):
    calls: list[str] = []
    state: dict = {}

    def before_release(name: str):
        def hook() -> None:
            # packs already written, regions not yet released, engine drained
            calls.append(name)
            state[name] = (lock.locked(), {t: r.mapped_bytes for t, r in memory.regions.items()},
                           sorted(p.suffix for p in tmp_path.iterdir()))
        return hook

    def after_resume(name: str):
        def hook() -> None:
            calls.append(name)
            state[name] = (lock.locked(), bytes(memory.regions["weights"].host_view(0, ALLOCATED)) == live[:ALLOCATED])
        return hook

    def release_graphs(policy: str) -> list[str]:
        calls.append(f"release_graphs:{policy}")
        return ["decode"]

    def recapture_graphs() -> list[str]:
        calls.append("recapture_graphs")
        return ["decode"]

    hooks = AgentHooks(before_release=[before_release("before_release:1"), before_release("before_release:2")],
                       after_resume=[after_resume("after_resume:1"), after_resume("after_resume:2")],
                       release_graphs=release_graphs, recapture_graphs=recapture_graphs)
    agent, client, memory, lock, live = _agent(hooks)
    before = _watchdogs()
    prepared = client.prepare(Prepare(pack_dir=str(tmp_path), graph_policy="recreate"))
    assert calls == ["release_graphs:recreate", "before_release:1", "before_release:2"]
    assert prepared.graphs_released == ["decode"] and "release_graphs" in prepared.seconds
    packs = sorted(p.suffix for p in tmp_path.iterdir())
    for name in ("before_release:1", "before_release:2"):
        assert state[name] == (True, {"weights": 4 * MiB, "kv_cache": 2 * MiB}, packs)
    armed = _watchdogs() - before

    resumed = client.resume(Resume(layout_digest=prepared.layout_digest, payload=prepared.payload.path,
                                   residual=prepared.residual.path))
    assert calls[3:] == ["after_resume:1", "after_resume:2", "recapture_graphs"]
    assert state["after_resume:1"] == state["after_resume:2"] == (True, True)  # hydrated, not serving yet
    assert resumed.graphs_recaptured == ["decode"] and "recapture_graphs" in resumed.seconds
    assert agent.graphs_released == [] and not lock.locked()
    _wait_disarmed(armed)


def test_a_failing_hook_fails_prepare_and_the_engine_keeps_serving(tmp_path):
    def broken() -> None:
        raise RuntimeError("allocator refused to hand blocks back")

    agent, client, memory, lock, live = _agent(AgentHooks(before_release=[broken]))
    before = _watchdogs()
    with pytest.raises(AgentError) as failed:
        client.prepare(Prepare(pack_dir=str(tmp_path)))
    assert failed.value.failure.model_dump() == {
        "code": "agent.internal", "type": "RuntimeError", "message": "allocator refused to hand blocks back"}
    assert client.status().state == "serving" and not lock.locked() and _watchdogs() <= before
    assert bytes(memory.regions["weights"].host_view()) == live  # nothing was released



WATCHDOG_SCRIPT = """
import os, sys, threading, time, tempfile
from coldsnap.agent.memory import ModelMemory
from coldsnap.agent.protocol import Prepare, Resume
from coldsnap.agent.progress_lines import ProgressLines
from coldsnap.agent.server import AgentServer
from coldsnap.contracts.layout import MemoryLayout
from coldsnap.memory import reserve

weights = reserve("weights", 2 << 20, backend="host"); weights.map()
layout = MemoryLayout.model_validate({"format": 1, "regions": [{"tag": "weights", "size_bytes": weights.size, "tensors": [
    {"name": "w", "dtype": "uint8", "shape": [4096], "offset": 0, "length": 4096}]}]})
agent = AgentServer(f"@wd-{os.getpid()}", ModelMemory(layout, {"weights": weights}), threading.Lock())
directory, progress, started = tempfile.mkdtemp(), ProgressLines(None), time.monotonic()
prepared = agent.prepare(Prepare(pack_dir=directory), progress)
time.sleep(1.8)
agent.resume(Resume(layout_digest=prepared.layout_digest, payload=prepared.payload.path), progress, [])
prepared = agent.prepare(Prepare(pack_dir=directory), progress)  # at once: the first watchdog has not ticked yet
time.sleep(max(0.0, 3.0 - (time.monotonic() - started)))  # within the second prepare's own 2 s
agent.resume(Resume(layout_digest=prepared.layout_digest, payload=prepared.payload.path), progress, [])
print("survived", flush=True)
"""


def test_a_watchdog_of_an_earlier_prepare_does_not_time_a_later_one():
    """Resume then prepare again within the watchdog's tick: the first prepare's watchdog must not kill the
    process 2 s after the *first* prepare (it did, SIGKILLing its process group). Own session: a
    regression kills only the child."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", WATCHDOG_SCRIPT], capture_output=True, text=True, timeout=60,
                            start_new_session=True, env={**os.environ, "COLDSNAP_AGENT_RESUME_TIMEOUT_S": "2"})
    assert result.returncode == 0 and "survived" in result.stdout, (result.returncode, result.stderr[-2000:])


FAKE_RESTORE_SCRIPT = """
import os, sys, threading, time, tempfile
from coldsnap.agent.client import Lease
from coldsnap.agent.memory import ModelMemory
from coldsnap.agent.protocol import Prepare
from coldsnap.agent.progress_lines import ProgressLines
from coldsnap.agent.server import AgentServer
from coldsnap.contracts.layout import MemoryLayout
from coldsnap.memory import reserve

weights = reserve("weights", 2 << 20, backend="host"); weights.map()
layout = MemoryLayout.model_validate({"format": 1, "regions": [{"tag": "weights", "size_bytes": weights.size, "tensors": [
    {"name": "w", "dtype": "uint8", "shape": [4096], "offset": 0, "length": 4096}]}]})
control = f"@fake-restore-{os.getpid()}"
agent = AgentServer(control, ModelMemory(layout, {"weights": weights}), threading.Lock()).start()
agent.prepare(Prepare(pack_dir=tempfile.mkdtemp()), ProgressLines(None))
agent.process_start = lambda: -1  # fake: the kernel task changed, as after a CRIU restore
if sys.argv[1] == "leased":
    lease = Lease([control])
time.sleep(4)
print("survived", flush=True)
"""


@pytest.mark.parametrize("leased", [False, True])
def test_a_restored_agent_nobody_leases_stops_its_tree(leased):
    """The launcher takes its lease right after CRIU returns; killed while CRIU ran, it leaves a restored
    tree nobody holds. The watchdog sees the restore (faked here: the process start time it reads is
    replaced; tests/integration/test_capture_restore.py restores with real CRIU) and, with no lease within
    COLDSNAP_AGENT_LEASE_WAIT_S, SIGKILLs its process group; a leased one lives on. Own session: the kill
    hits only the child."""
    import signal
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", FAKE_RESTORE_SCRIPT, "leased" if leased else "alone"],
                            capture_output=True, text=True, timeout=60, start_new_session=True,
                            env={**os.environ, "COLDSNAP_AGENT_LEASE_WAIT_S": "1"})
    if leased:
        assert result.returncode == 0 and "survived" in result.stdout, result.stderr[-2000:]
    else:
        assert result.returncode == -signal.SIGKILL and "no launcher took the lease within 1 s" in result.stderr, \
            (result.returncode, result.stderr[-2000:])


def test_standby_parks_a_restored_agent_until_resume_and_its_ttl_stops_it(tmp_path, monkeypatch):
    """standby: refused unless prepared and restored (a new process start time); then the agent is in
    state standby with its memory released and its lease-free deadlines replaced by the TTL; resume
    leaves it as from prepared. An expired standby removes its record and stops its process group."""
    from coldsnap.agent.protocol import Standby

    agent, client, memory, lock, live = _agent()
    digest = memory.layout.digest()
    with pytest.raises(AgentError) as refused:
        client.standby(Standby(ttl_s=None))
    assert refused.value.code == "agent.state" and "standby needs state prepared, not serving" in str(refused.value)
    prepared = client.prepare(Prepare(pack_dir=str(tmp_path)))
    with pytest.raises(AgentError) as refused:  # prepared, but this process was never restored
        client.standby(Standby(ttl_s=None))
    assert "standby needs a restored process" in str(refused.value)

    agent.process_start = lambda: -1  # as after a CRIU restore
    stopped: list[str] = []
    import coldsnap.agent.server as server

    monkeypatch.setattr(server, "_stop_process_group", lambda reason="": stopped.append(reason))
    record = tmp_path / "standby.json"
    record.write_text("{}")
    parked = client.standby(Standby(ttl_s=1, record=str(record)))
    assert parked.rank == 0 and parked.pinned_bytes == 0 and parked.pin_error is None
    status = client.status()
    assert status.state == "standby" and lock.locked()  # requests wait for the wake
    assert {t: r.mapped for t, r in status.regions.items()} == {"weights": 0, "kv_cache": 0}
    with pytest.raises(AgentError) as refused:
        client.standby(Standby(ttl_s=None))
    assert "standby needs state prepared, not standby" in str(refused.value)

    resumed = client.resume(Resume(layout_digest=digest, payload=prepared.payload.path, residual=prepared.residual.path))
    assert resumed.hydrate.source == "native" and not lock.locked() and client.status().state == "serving"
    assert bytes(memory.regions["weights"].host_view(0, ALLOCATED)) == live[:ALLOCATED]
    import time

    time.sleep(1.6)  # past the TTL: a woken standby's deadline is gone with its state
    assert record.exists() and not stopped


def test_a_standby_nobody_wakes_removes_its_record_and_stops(tmp_path, monkeypatch):
    import coldsnap.agent.server as server
    from coldsnap.agent.protocol import Standby

    stopped: list[str] = []
    monkeypatch.setattr(server, "_stop_process_group", lambda reason="": stopped.append(reason))
    agent, client, memory, lock, _ = _agent()
    client.prepare(Prepare(pack_dir=str(tmp_path)))
    agent.process_start = lambda: -1
    record = tmp_path / "standby.json"
    record.write_text("{}")
    client.standby(Standby(ttl_s=1, record=str(record)))
    deadline = threading.Event()
    deadline.wait(2.5)
    assert stopped and "not woken within 1 s" in stopped[0] and not record.exists()
    agent.state = "serving"  # end the expiry thread (the real one SIGKILLs the group instead)


def test_a_standby_recaptures_dropped_graphs_with_its_regions_mapped_then_releases_them(tmp_path, monkeypatch):
    """Graphs the snapshot dropped (they held NCCL kernels) are captured at standby, with every region
    mapped for the capture's warm-up and released after it; the wake then captures nothing."""
    import coldsnap.agent.server as server
    from coldsnap.agent.protocol import Standby

    monkeypatch.setattr(server, "_stop_process_group", lambda reason="": None)
    calls: list[tuple[str, dict[str, int]]] = []
    hooks = AgentHooks(release_graphs=lambda policy: ["decode"], recapture_graphs=lambda: calls.append(
        ("recapture", {t: r.mapped_bytes for t, r in memory.regions.items()})) or ["decode"])
    agent, client, memory, lock, live = _agent(hooks)
    prepared = client.prepare(Prepare(pack_dir=str(tmp_path)))
    agent.process_start = lambda: -1
    parked = client.standby(Standby(ttl_s=None))
    assert parked.graphs_recaptured == ["decode"] and "recapture_graphs" in parked.seconds
    assert calls == [("recapture", {"weights": 4 * MiB, "kv_cache": 2 * MiB})]  # mapped for the capture
    assert {t: r.mapped for t, r in client.status().regions.items()} == {"weights": 0, "kv_cache": 0}  # and released
    resumed = client.resume(Resume(layout_digest=memory.layout.digest(), payload=prepared.payload.path,
                                   residual=prepared.residual.path))
    assert resumed.graphs_recaptured == [] and len(calls) == 1
    assert bytes(memory.regions["weights"].host_view(0, ALLOCATED)) == live[:ALLOCATED]


class HostPackStandingInForPinned:
    """Stands in for :class:`coldsnap.hydrate.PinnedPack`, which needs a GPU: fills host regions from the
    same pack through the hydration engine."""

    def __init__(self, path: str):
        self.path, self.length, self.closed = path, os.path.getsize(path), False

    def hydrate(self, regions, *, layout_digest=None):
        from coldsnap.hydrate import hydrate_pack

        return hydrate_pack(self.path, regions, layout_digest=layout_digest)

    def close(self):
        self.closed = True


def _parked(tmp_path, monkeypatch):
    import coldsnap.agent.server as server
    from coldsnap.agent.protocol import Standby

    monkeypatch.setattr(server, "_stop_process_group", lambda reason="": None)
    agent, client, memory, lock, live = _agent()
    prepared = client.prepare(Prepare(pack_dir=str(tmp_path)))
    agent.process_start = lambda: -1
    client.standby(Standby(ttl_s=None))
    agent._pinned = HostPackStandingInForPinned(prepared.payload.path)  # what pin_payload does on a GPU
    return agent, client, memory, live, prepared


def test_a_prefill_fills_the_weights_before_the_wake_and_its_resume_takes_them(tmp_path, monkeypatch):
    from coldsnap.activation.early_wake import _send_prefill

    agent, client, memory, live, prepared = _parked(tmp_path, monkeypatch)
    assert _send_prefill(agent.control) is True  # the early wake's own line, answered at once
    assert _send_prefill(agent.control) is False  # once
    agent._prefill.thread.join(10)
    assert memory.regions["weights"].mapped_bytes == 4 * MiB and memory.regions["kv_cache"].mapped_bytes == 0
    resumed = client.resume(Resume(layout_digest=memory.layout.digest(), payload=prepared.payload.path,
                                   residual=prepared.residual.path))
    assert resumed.hydrate.source == "native" and resumed.hydrate.stats.get("prefilled") is True
    assert "prefill_hydrate" in resumed.seconds and "hydrate" not in resumed.seconds
    assert bytes(memory.regions["weights"].host_view(0, ALLOCATED)) == live[:ALLOCATED]
    assert bytes(memory.regions["kv_cache"].host_view()) == bytes(2 * MiB)


def test_a_prefill_for_another_source_or_no_wake_is_released(tmp_path, monkeypatch):
    import coldsnap.agent.server as server

    agent, client, memory, live, prepared = _parked(tmp_path, monkeypatch)
    monkeypatch.setattr(server, "PREFILL_HOLD_S", 0.2)
    from coldsnap.activation.early_wake import _send_prefill

    assert _send_prefill(agent.control)
    deadline = threading.Event()
    for _ in range(40):  # the standby's watcher releases weights no resume took
        if agent._prefill is None:
            break
        deadline.wait(0.1)
    assert agent._prefill is None and memory.regions["weights"].mapped_bytes == 0

    assert _send_prefill(agent.control)  # again, then a resume that wants another source: released, refilled
    agent._prefill.thread.join(10)
    other = tmp_path / "copy.pack"
    other.write_bytes(open(prepared.payload.path, "rb").read())
    resumed = client.resume(Resume(layout_digest=memory.layout.digest(), payload=str(other),
                                   residual=prepared.residual.path))
    assert resumed.hydrate.stats.get("prefilled") is None and "hydrate" in resumed.seconds
    assert bytes(memory.regions["weights"].host_view(0, ALLOCATED)) == live[:ALLOCATED]

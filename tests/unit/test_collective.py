"""coldsnap.collective on the CPU: the host backend, and the rank teardown/rebuild sequence through a
real coordinator (threads stand in for rank processes)."""

import threading
import time

import pytest

torch = pytest.importorskip("torch")
zmq = pytest.importorskip("zmq")

from coldsnap.collective import CollectiveError, HostBackend, NcclBackend, RankCollectives  # noqa: E402
from coldsnap.coord import Coordinator, CoordinatorClient, CoordinatorError  # noqa: E402

TOKEN = b"collective-test-token-0123456789"


def on_ranks(world, work, timeout=60):
    """Run work(rank) in one thread per rank; returns {rank: result or exception}."""
    results = {}

    def run(rank):
        try:
            results[rank] = work(rank)
        except Exception as exc:  # collected: asserted by the caller
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return results


@pytest.fixture
def coordinator():
    servers = []

    def start(world):
        server = Coordinator("127.0.0.1:0", TOKEN, world, ttl=60)
        thread = threading.Thread(target=server.serve, daemon=True)
        thread.start()
        servers.append((server, thread))
        return server

    yield start
    for server, thread in servers:
        server.stop()
        thread.join(5)


def connected_group(world):
    """Each rank's RankCollectives with a 'tp' host communicator joined (the engine's own first start)."""
    backends = [HostBackend() for _ in range(world)]
    unique_id = backends[0].create_unique_id()
    groups = [RankCollectives(r, world) for r in range(world)]
    results = on_ranks(world, lambda r: groups[r].connect("tp", backends[r], unique_id))
    assert all(not isinstance(v, Exception) for v in results.values()), results
    return groups


def test_host_all_reduce_sums_in_place_on_every_rank():
    groups = connected_group(3)
    tensors = [torch.full((4, 5), float(r + 1)) for r in range(3)]
    on_ranks(3, lambda r: groups[r].communicators["tp"].all_reduce(tensors[r]))
    for tensor in tensors:
        assert torch.equal(tensor, torch.full((4, 5), 6.0))


def test_teardown_then_rebuild_through_the_coordinator(coordinator):
    server = coordinator(2)
    groups = connected_group(2)
    seconds = [{}, {}]

    def cycle(rank):
        with CoordinatorClient(server.endpoint, TOKEN, rank) as client:
            groups[rank].teardown(client, seconds[rank])
            assert not groups[rank].live
            with pytest.raises(CollectiveError, match="torn down"):
                groups[rank].communicators["tp"].all_reduce(torch.ones(2))
            groups[rank].rebuild(client, seconds[rank])
        tensor = torch.full((3,), float(rank + 10))
        groups[rank].communicators["tp"].all_reduce(tensor)  # the same handle, a new connection
        return tensor

    results = on_ranks(2, cycle)
    for rank in range(2):
        assert torch.equal(results[rank], torch.full((3,), 21.0)), results[rank]
        assert groups[rank].communicators["tp"].generation == 1
        assert {"teardown", "teardown_barrier", "rebuild", "rebuild_barrier"} <= set(seconds[rank])


def test_an_aborted_activation_fails_a_rank_waiting_in_rebuild_at_once(coordinator):
    """The launcher saw rank 1 fail (its agent refused the resume) and aborted the coordinator: rank 0,
    torn down and waiting to rebuild, fails within a tick instead of its 60 s barrier timeout, and keeps
    no half-built connection."""
    server = coordinator(2)
    groups = connected_group(2)
    on_ranks(2, lambda r: groups[r].teardown(CoordinatorClient(server.endpoint, TOKEN, r), {}))
    fresh = Coordinator("127.0.0.1:0", TOKEN, 2, ttl=60)  # the restore's own activation
    thread = threading.Thread(target=fresh.serve, daemon=True)
    thread.start()
    try:
        with CoordinatorClient(fresh.endpoint, TOKEN, 0) as client:
            threading.Timer(0.3, fresh.abort, args=("rank 1 failed: layout digest mismatch",)).start()
            started = time.monotonic()
            with pytest.raises(CoordinatorError, match="rank 1 failed"):
                groups[0].rebuild(client, {}, timeout=60)
            assert time.monotonic() - started < 3
        assert not groups[0].live
    finally:
        fresh.stop()
        thread.join(5)


def test_coordinator_abort_fails_a_waiting_barrier_at_once(coordinator):
    server = coordinator(2)
    with CoordinatorClient(server.endpoint, TOKEN, 0) as client:
        threading.Timer(0.3, server.abort, args=("rank 1 failed: layout mismatch",)).start()
        started = time.monotonic()
        with pytest.raises(CoordinatorError, match="rank 1 failed: layout mismatch"):
            client.barrier("collectives.rebuild", timeout=60)
        assert time.monotonic() - started < 3
        with pytest.raises(CoordinatorError, match="layout mismatch"):  # and every later one
            client.get("collective/tp/1/unique_id", timeout=60)


def test_host_ids_are_checked():
    backend = HostBackend()
    with pytest.raises(CollectiveError, match="not a host communicator id"):
        backend.connect(b"garbage", 2, 1)
    with pytest.raises(CollectiveError, match="must join the communicator whose unique id it created"):
        backend.connect(b"127.0.0.1:1:" + b"00" * 16, 2, 0)


def test_missing_nccl_is_a_typed_error():
    with pytest.raises(CollectiveError, match="cannot be loaded"):
        NcclBackend(0, library="/nonexistent/libnccl.so.2")


def test_group_rejects_bad_ranks_and_duplicates():
    with pytest.raises(ValueError):
        RankCollectives(2, 2)
    groups = connected_group(2)
    with pytest.raises(CollectiveError, match="exists already"):
        groups[0].connect("tp", HostBackend(), b"x")

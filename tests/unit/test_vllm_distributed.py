"""coldsnap_vllm.distributed's teardown/rebuild sequence, with stand-ins for vLLM's GPU-only classes.

vLLM's PyNcclCommunicator and CUDA device communicators cannot exist on a CPU machine; the classes
named *ForCpuTest below stand in for exactly those, with the attributes vLLM 0.33 gives them. The
coordinator, barriers and ordering are real. (On vLLM's CPU build the same code runs against real
groups with nothing to tear down: tests/integration/test_vllm_cpu.py.)"""

import threading

import pytest

pytest.importorskip("zmq")

from coldsnap_vllm.distributed import VllmCollectives  # noqa: E402
from tests.helpers import run_ranks_with_coordinator  # noqa: E402

TOKEN = b"vllm-distributed-test-token-0123"


class NcclLibraryForCpuTest:
    def __init__(self, rank):
        self.rank = rank
        self.aborted = []
        self.abort_blocks = None  # an Event the abort waits on: a CUDA graph still holding the communicator

    def ncclCommAbort(self, comm):
        if self.abort_blocks is not None:
            self.abort_blocks.wait(10)
        self.aborted.append(comm)

    def ncclGetUniqueId(self):
        class UniqueId:
            internal = bytes([7 + self.rank]) * 128
        return UniqueId()


class PyNcclForCpuTest:
    built: list = []

    def __init__(self, rank, unique_id=None, group="gloo-cpu-group"):
        self.disabled = False
        self.available = True
        self.nccl = NcclLibraryForCpuTest(rank)
        self.comm = f"ncclComm of rank {rank}"
        self.unique_id = unique_id
        self.group = group

    @property
    def destroyed(self):
        return self.disabled and self.nccl.aborted == [self.comm]

    def destroy(self):
        raise AssertionError("vLLM's destroy gives up on a blocked abort after 5 s; coldsnap aborts itself")

    @classmethod
    def from_unique_id_bytes(cls, unique_id, rank, world_size, device):
        made = cls(rank, unique_id, group=None)
        made.args = (rank, world_size, device)
        cls.built.append(made)
        return made


class DeviceCommunicatorForCpuTest:
    def __init__(self, rank, device, nccl=True):
        self.pynccl_comm = PyNcclForCpuTest(rank) if nccl else None
        self.ca_comm = "custom all-reduce IPC buffers"
        self.device = device


class GroupForCpuTest:
    def __init__(self, name, rank_in_group, world_size, device, nccl=True):
        self.unique_name = name
        self.rank_in_group = rank_in_group
        self.world_size = world_size
        self.device_communicator = DeviceCommunicatorForCpuTest(rank_in_group, device, nccl)


class ParallelStateForCpuTest:
    def __init__(self):
        self.calls = []

    def checkpoint_prepare_distributed_state(self):
        self.calls.append("prepare")

    def checkpoint_restore_distributed_state(self):
        self.calls.append("restore")


def run_ranks(world, groups_of, work):
    states = [ParallelStateForCpuTest() for _ in range(world)]
    collectives = [VllmCollectives(r, world, groups=lambda r=r: groups_of[r], communicator_class=PyNcclForCpuTest,
                                   state=states[r]) for r in range(world)]
    errors = run_ranks_with_coordinator(TOKEN, world, lambda r, client: work(collectives[r], client))
    assert errors == []
    return collectives, states


def test_nccl_is_torn_down_and_rebuilt_inside_the_same_groups():
    groups_of = [[GroupForCpuTest("world:0", r, 2, f"cuda:{r}"), GroupForCpuTest("tp:0", r, 2, f"cuda:{r}")]
                 for r in range(2)]
    old = [[g.device_communicator.pynccl_comm for g in groups] for groups in groups_of]
    seconds = [{}, {}]
    PyNcclForCpuTest.built = []

    def cycle(collectives, client):
        collectives.teardown(client, seconds[collectives.rank])
        for group in groups_of[collectives.rank]:
            assert group.device_communicator.pynccl_comm.destroyed and group.device_communicator.ca_comm is None
        collectives.rebuild(client, seconds[collectives.rank])

    _, states = run_ranks(2, groups_of, cycle)
    assert {"abort_world:0", "abort_tp:0"} <= set(seconds[0])
    for rank in range(2):
        assert states[rank].calls == ["prepare", "restore"]
        assert {"teardown", "teardown_barrier", "rebuild", "rebuild_barrier"} <= set(seconds[rank])
        for group, previous in zip(groups_of[rank], old[rank]):
            new = group.device_communicator.pynccl_comm
            assert new is not previous and new.args == (rank, 2, f"cuda:{rank}")
            assert new.group == "gloo-cpu-group"  # the group object vLLM recorded stays
    # both members of each group joined the id its rank 0 minted (rank 0's library: byte 7)
    assert {bytes(c.unique_id) for c in PyNcclForCpuTest.built} == {bytes([7]) * 128}
    assert len(PyNcclForCpuTest.built) == 4


def test_groups_without_nccl_have_nothing_to_tear_down():
    """vLLM's CPU build: gloo and shared memory, which the snapshot carries."""
    groups_of = [[GroupForCpuTest("tp:0", r, 2, "cpu", nccl=False)] for r in range(2)]

    def cycle(collectives, client):
        collectives.teardown(client, {})
        collectives.rebuild(client, {})

    _, states = run_ranks(2, groups_of, cycle)
    assert states[0].calls == states[1].calls == []
    assert all(g.device_communicator.ca_comm for groups in groups_of for g in groups)  # untouched


def test_an_abort_that_does_not_return_fails_the_teardown(monkeypatch):
    """A CUDA graph still holding the communicator blocks ncclCommAbort: the capture must fail, not
    checkpoint a half-aborted communicator (vLLM's own destroy gives up after 5 s and goes on)."""
    from coldsnap_vllm import distributed

    monkeypatch.setattr(distributed, "ABORT_TIMEOUT_S", 0.2)
    release = threading.Event()
    pynccl = PyNcclForCpuTest(0)
    pynccl.nccl.abort_blocks = release
    try:
        with pytest.raises(distributed.VllmTeardownError, match="tp:0: ncclCommAbort did not return within 0 s"):
            distributed._abort_pynccl(pynccl, "tp:0")
        assert not pynccl.disabled
    finally:
        release.set()

"""coldsnap_sglang.distributed's teardown/rebuild sequence at TP 2, with stand-ins for SGLang's GPU-only classes.

SGLang's ``PyNcclCommunicator``, custom all-reduces and symmetric-memory communicator cannot exist on a
CPU machine; the classes named *ForCpuTest below stand in for exactly those, with the attributes and
constructor SGLang 0.5.17 gives them (tests/integration/test_sglang_hooks.py checks those against its
real modules). The coordinator, the barriers and the two ranks' threads are real."""

import re
from types import SimpleNamespace

import pytest

pytest.importorskip("zmq")

from coldsnap.collective.torch_groups import NcclTeardownError  # noqa: E402
from coldsnap_sglang import distributed  # noqa: E402
from coldsnap_sglang.distributed import SglangCollectives  # noqa: E402
from tests.helpers import run_ranks_with_coordinator  # noqa: E402

TOKEN = b"sglang-distributed-test-token-01"


class NcclLibraryForCpuTest:
    """SGLang's ``NCCLLibrary``: ``lib`` is the ctypes library, which binds ``ncclCommAbort`` unasked."""

    def __init__(self, result=0):
        self.aborted = []

        def ncclCommAbort(comm):  # noqa: N802 - NCCL's name
            self.aborted.append(comm)
            return result

        self.lib = SimpleNamespace(ncclCommAbort=ncclCommAbort)

    @staticmethod
    def ncclGetErrorString(result):  # noqa: N802 - SGLang's name
        return "unhandled system error"


class PyNcclForCpuTest:
    built: list = []

    def __init__(self, group, device, is_symmetric_memory_enabled=False):
        self.group, self.device = group, device
        self.symmetric = is_symmetric_memory_enabled
        self.nccl = NcclLibraryForCpuTest()
        self.comm = f"ncclComm of {group}"
        self.available = True
        self.disabled = True  # SGLang's state between its in-place `change_state` toggles
        type(self).built.append(self)


class LegacyCustomAllreduceForCpuTest:
    """SGLang's CUDA IPC ``CustomAllreduce``: peers' buffers opened with cudaIpcOpenMemHandle."""

    made: list = []

    def __init__(self, group, device):
        self.group, self.device, self.rank = group, device, int(group[-1])
        self.meta_ptrs = [0x1000, 0x2000]
        self.buffer_ptrs = [0x3000, 0x4000]
        self._ptr = 1
        self.disabled = True  # toggled off by a piecewise graph runner just now
        self.original_disabled = False
        self.closed = False
        type(self).made.append(self)

    def close(self):
        assert not self.disabled  # SGLang's close does nothing while the flag is toggled
        self.closed = True
        self._ptr = 0


class CustomAllReduceV2ForCpuTest:
    made: list = []

    def __init__(self, group, device):
        self.group, self.device = group, device
        self.disabled = False
        self.closed = False
        type(self).made.append(self)

    def close(self):
        self.closed = True


class TorchSymmMemForCpuTest:
    def __init__(self, group, device):
        self.group, self.device = group, device
        self.buffer = "a rendezvoused symmetric buffer"
        self.disabled = False


class GroupForCpuTest:
    """SGLang's ``GroupCoordinator``: the attributes coldsnap reads and replaces."""

    def __init__(self, name, rank, custom=None, symmetric=False, nccl=True):
        self.unique_name = name
        self.ranks = [0, 1]
        self.rank_in_group = rank
        self.device = SimpleNamespace(index=rank, type="cuda")
        self.cpu_group = f"gloo {name} rank {rank}"
        self.device_group = None  # torch's NCCL group: not registered with torch here
        self.pynccl_comm = PyNcclForCpuTest(self.cpu_group, self.device) if nccl else None
        self.ca_comm = custom(self.cpu_group, self.device) if custom else None
        self.torch_symm_mem_comm = TorchSymmMemForCpuTest(self.cpu_group, self.device) if symmetric else None
        self.pymscclpp_comm = None
        self.qr_comm = None


@pytest.fixture
def unmapped(monkeypatch):
    """The peers' IPC mappings coldsnap closes (coldsnap._C's close_ipc_mapping needs a GPU)."""
    closed = []
    monkeypatch.setattr("coldsnap.native.native", lambda: SimpleNamespace(
        close_ipc_mapping=lambda pointer, device: closed.append((pointer, device))))
    return closed


def run_ranks(groups_of, work, symmetric_memory=False):
    collectives = [SglangCollectives(r, 2, groups=lambda r=r: groups_of[r], communicator_class=PyNcclForCpuTest,
                                     symmetric_memory_enabled=lambda: symmetric_memory) for r in range(2)]
    errors = run_ranks_with_coordinator(TOKEN, 2, lambda r, client: work(collectives[r], client))
    return collectives, errors


def test_nccl_custom_all_reduce_and_symmetric_memory_are_ended_and_made_again_inside_the_same_groups(unmapped):
    groups_of = [[GroupForCpuTest("tp:0", r, custom=LegacyCustomAllreduceForCpuTest, symmetric=True),
                  GroupForCpuTest("moe_tp:0", r, custom=CustomAllReduceV2ForCpuTest)] for r in range(2)]
    old = [[(g.pynccl_comm, g.ca_comm) for g in groups] for groups in groups_of]
    seconds = [{}, {}]
    PyNcclForCpuTest.built = []

    def cycle(collectives, client):
        collectives.teardown(client, seconds[collectives.rank])
        for group in groups_of[collectives.rank]:
            assert group.ca_comm is None and group.torch_symm_mem_comm is None
            assert not group.pynccl_comm.available and group.pynccl_comm.comm is None
        collectives.rebuild(client, seconds[collectives.rank])

    _, errors = run_ranks(groups_of, cycle)
    assert errors == []
    for rank in range(2):
        assert {"teardown", "teardown_barrier", "rebuild", "rebuild_barrier", "abort_tp:0", "abort_moe_tp:0"} <= \
            set(seconds[rank])
        for group, (pynccl, custom) in zip(groups_of[rank], old[rank]):
            assert pynccl.nccl.aborted == [f"ncclComm of {group.cpu_group}"]
            assert custom.closed
            new = group.pynccl_comm  # SGLang's own constructor again, over the group's gloo group
            assert new is not pynccl and (new.group, new.device, new.symmetric) == (group.cpu_group, group.device, False)
            assert new.disabled  # as SGLang leaves it after start-up
            assert type(group.ca_comm) is type(custom) and group.ca_comm is not custom
            assert group.ca_comm.group == group.cpu_group
        assert isinstance(groups_of[rank][0].torch_symm_mem_comm, TorchSymmMemForCpuTest)
    # the legacy all-reduce's peer buffers were unmapped on each rank's own device: rank 0's peer is rank 1
    assert sorted(unmapped) == [(0x1000, 1), (0x2000, 0), (0x3000, 1), (0x4000, 0)]


def test_groups_without_nccl_have_nothing_to_tear_down():
    groups_of = [[GroupForCpuTest("tp:0", r, nccl=False)] for r in range(2)]

    def cycle(collectives, client):
        collectives.teardown(client, {})
        collectives.rebuild(client, {})

    _, errors = run_ranks(groups_of, cycle)
    assert errors == []


@pytest.mark.parametrize("what, expected", [
    ("pymscclpp_comm", "MSCCL\\+\\+ all-reduce \\(--enable-mscclpp\\) in group tp:0"),
    ("symmetric memory", "NCCL symmetric memory \\(--enable-symm-mem\\)"),
])
def test_communicators_coldsnap_cannot_rebuild_fail_the_capture_before_anything_is_ended(what, expected):
    groups_of = [[GroupForCpuTest("tp:0", r)] for r in range(2)]
    if what == "pymscclpp_comm":
        for groups in groups_of:
            groups[0].pymscclpp_comm = SimpleNamespace(disabled=False)

    _, errors = run_ranks(groups_of, lambda collectives, client: collectives.teardown(client, {}, timeout=5),
                          symmetric_memory=what == "symmetric memory")
    assert errors and all(isinstance(exc, NcclTeardownError) for _, exc in errors)
    assert all(re.search(expected, str(exc)) for _, exc in errors)
    assert all(groups[0].pynccl_comm.available for groups in groups_of)  # nothing was torn down


def test_an_abort_that_fails_says_nccls_error():
    pynccl = PyNcclForCpuTest("gloo", SimpleNamespace(index=0))
    pynccl.nccl = NcclLibraryForCpuTest(result=2)
    with pytest.raises(RuntimeError, match="NCCL error 2: unhandled system error"):
        distributed._abort_call(pynccl)()

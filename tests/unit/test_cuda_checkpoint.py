"""Sequencing and rollback of the CUDA checkpoint of a process tree.

The driver here is a fake, because no GPU can exist on this machine; it is named so. The real driver
path (coldsnap._C → cuCheckpointProcess*) is checked on the H200 in tests/gpu.
"""

import pytest

from coldsnap.native import native
from coldsnap.snapshot.cuda_checkpoint import CudaCheckpointError, NativeCheckpointDriver, TreeCheckpoint, gpu_processes


class FakeCheckpointDriverForCpuTests:
    """Models the driver's per-process state machine; ``fail`` = {(op, pid)} makes those calls fail."""

    transitions = {"lock": ("running", "locked"), "checkpoint": ("locked", "checkpointed"),
                   "restore": ("checkpointed", "locked"), "unlock": ("locked", "running")}

    def __init__(self, pids, fail=()):
        self.process_state = {pid: "running" for pid in pids}
        self.fail = set(fail)
        self.calls = []

    def call(self, op, pid, timeout_ms=0, gpu_pairs=None):
        self.calls.append((op, pid, gpu_pairs))
        before, after = self.transitions[op]
        if (op, pid) in self.fail or self.process_state[pid] != before:
            raise CudaCheckpointError(op, pid, f"CUDA_ERROR_ILLEGAL_STATE in {self.process_state[pid]}", cuda_code=401)
        self.process_state[pid] = after

    def state(self, pid):
        return self.process_state[pid]


def test_checkpoint_and_restore_a_tree():
    driver = FakeCheckpointDriverForCpuTests([10, 11])
    tree = TreeCheckpoint(driver)
    tree.checkpoint([10, 11])
    assert driver.process_state == {10: "checkpointed", 11: "checkpointed"} == tree.states
    pairs = [("GPU-00000000-0000-0000-0000-000000000001", "GPU-00000000-0000-0000-0000-000000000002")]
    tree.restore([10, 11], pairs)
    assert driver.process_state == {10: "running", 11: "running"} == tree.states
    assert ("restore", 10, pairs) in driver.calls


def test_failed_lock_unlocks_the_others():
    driver = FakeCheckpointDriverForCpuTests([10, 11, 12], fail={("lock", 11)})
    with pytest.raises(CudaCheckpointError) as caught:
        TreeCheckpoint(driver).checkpoint([10, 11, 12])
    assert caught.value.op == "lock" and caught.value.pid == 11 and caught.value.rolled_back
    assert driver.process_state == {10: "running", 11: "running", 12: "running"}


def test_failed_checkpoint_restores_and_unlocks_the_others():
    driver = FakeCheckpointDriverForCpuTests([10, 11], fail={("checkpoint", 10)})
    with pytest.raises(CudaCheckpointError) as caught:
        TreeCheckpoint(driver).checkpoint([10, 11])
    assert caught.value.op == "checkpoint" and "put back to running" in str(caught.value)
    assert caught.value.cuda_code == 401  # the driver's CUresult survives the rollback
    assert driver.process_state == {10: "running", 11: "running"}


def test_failed_restore_is_reported_per_pid():
    driver = FakeCheckpointDriverForCpuTests([10, 11])
    tree = TreeCheckpoint(driver)
    tree.checkpoint([10, 11])
    driver.fail.add(("restore", 11))
    with pytest.raises(CudaCheckpointError) as caught:
        tree.restore([10, 11])
    assert caught.value.pid == 11 and tree.states[11] == "failed" and tree.states[10] == "locked"
    assert caught.value.cuda_code == 401


def test_native_driver_without_gpu_is_a_typed_error():
    if native().cuda_probe()["available"]:
        pytest.skip("this host has a GPU")
    with pytest.raises(CudaCheckpointError, match="libcuda.so.1"):
        NativeCheckpointDriver().call("lock", 1, timeout_ms=10)


def test_no_gpu_processes_here():
    import os

    assert gpu_processes([os.getpid()]) == []

"""The local-memory trim around a checkpoint (coldsnap.agent.device_state), against a fake driver: this
machine has no GPU. The real driver's behaviour is checked on the GPU host (tests/gpu/test_cuda_host.py)."""

from __future__ import annotations

import pytest

from coldsnap.agent.device_state import TRIM_ENV, TRIMMED_STACK_BYTES, LocalMemoryTrim

MIB = 1 << 20


class FakeDriverNoGpu:
    """cuCtxGetLimit/cuCtxSetLimit/cuMemGetInfo as the driver answers them: the reservation follows the
    stack limit (132 SMs x 2048 threads per byte of stack), and a refused device raises CudaError."""

    class CudaError(RuntimeError):
        pass

    def __init__(self, stacks: dict[int, int], refuse: set[int] = frozenset()):
        self.stacks = dict(stacks)
        self.refuse = refuse
        self.calls: list[tuple] = []

    def context_limit(self, device: int, limit: int) -> int:
        assert limit == 0
        return self.stacks[device]

    def set_context_limit(self, device: int, limit: int, value: int) -> None:
        self.calls.append((device, limit, value))
        if device in self.refuse:
            raise self.CudaError("CUDA_ERROR_UNSUPPORTED_LIMIT")
        self.stacks[device] = value

    def device_memory(self, device: int) -> tuple[int, int]:
        used = 132 * 2048 * self.stacks[device]
        return 80 * 1024 * MIB - used, 80 * 1024 * MIB


def test_lower_frees_the_reservation_and_restore_sets_the_captured_limit_back(monkeypatch):
    monkeypatch.delenv(TRIM_ENV, raising=False)
    driver = FakeDriverNoGpu({0: 2048, 1: 1024})
    trim = LocalMemoryTrim(driver)
    measured = trim.lower([0, 1])
    assert measured["stack_bytes"] == 2048
    assert measured["local_memory_freed_bytes"] == 132 * 2048 * ((2048 - TRIMMED_STACK_BYTES) + (1024 - TRIMMED_STACK_BYTES))
    assert driver.stacks == {0: TRIMMED_STACK_BYTES, 1: TRIMMED_STACK_BYTES}
    trim.restore()
    assert driver.stacks == {0: 2048, 1: 1024}
    calls = len(driver.calls)
    trim.restore()  # idempotent: resume and standby both call it
    assert len(driver.calls) == calls


def test_a_refusing_driver_leaves_that_device_alone(monkeypatch, caplog):
    monkeypatch.delenv(TRIM_ENV, raising=False)
    driver = FakeDriverNoGpu({0: 1024, 1: 1024}, refuse={1})
    trim = LocalMemoryTrim(driver)
    measured = trim.lower([0, 1])
    assert trim.captured == {0: 1024}
    assert measured["local_memory_freed_bytes"] == 132 * 2048 * (1024 - TRIMMED_STACK_BYTES)
    assert "device 1's local memory left as it is" in caplog.text
    trim.restore()
    assert driver.stacks == {0: 1024, 1: 1024}


def test_switched_off_or_nothing_to_trim(monkeypatch):
    driver = FakeDriverNoGpu({0: 1024})
    monkeypatch.setenv(TRIM_ENV, "0")
    assert LocalMemoryTrim(driver).lower([0]) == {}
    monkeypatch.delenv(TRIM_ENV)
    assert LocalMemoryTrim(driver).lower([]) == {}
    driver.stacks[0] = TRIMMED_STACK_BYTES
    trim = LocalMemoryTrim(driver)
    assert trim.lower([0]) == {"stack_bytes": 0, "local_memory_freed_bytes": 0} and trim.captured == {}
    assert driver.calls == []


def test_a_failed_set_back_raises(monkeypatch):
    monkeypatch.delenv(TRIM_ENV, raising=False)
    driver = FakeDriverNoGpu({0: 1024})
    trim = LocalMemoryTrim(driver)
    trim.lower([0])
    driver.refuse = {0}
    with pytest.raises(FakeDriverNoGpu.CudaError):
        trim.restore()
    assert trim.captured == {0: 1024}  # still owed: a retry sets it back


def test_torch_pools_by_kind_and_what_coldsnaps_regions_serve(monkeypatch):
    """torch's segments (a fake ``torch.cuda.memory_snapshot``: no GPU here) summed by pool kind, and those
    lying in a coldsnap region counted apart: the region is unmapped before the checkpoint, so they are not
    in the image though torch still counts them."""
    from types import SimpleNamespace

    from coldsnap.agent import device_state

    region = (0x7000_0000_0000, 32 << 30)
    segments = [
        {"segment_pool_id": (0, 0), "address": 0x1000_0000, "total_size": 20 * MIB, "allocated_size": 8 * MIB},
        {"segment_pool_id": (0, 1), "address": region[0], "total_size": 600 * MIB, "allocated_size": 30 * MIB},
        {"segment_pool_id": (0, 1), "address": region[0] + (600 << 20), "total_size": 56 * MIB, "allocated_size": 2 * MIB},
        {"segment_pool_id": (1, 0), "address": 0x2000_0000, "total_size": 4 * MIB, "allocated_size": 4 * MIB},
    ]
    fake_torch = SimpleNamespace(cuda=SimpleNamespace(memory_snapshot=lambda: segments))
    monkeypatch.setattr(device_state, "cuda_torch", lambda: fake_torch)
    pools = device_state.torch_pool_bytes([region])
    assert pools == {"graph_pool_reserved": 660 * MIB, "graph_pool_allocated": 36 * MIB, "other_reserved": 20 * MIB,
                     "other_allocated": 8 * MIB, "in_regions_reserved": 656 * MIB}
    assert device_state.torch_pool_bytes()["in_regions_reserved"] == 0
    monkeypatch.setattr(device_state, "cuda_torch", lambda: None)
    assert device_state.torch_pool_bytes([region]) == {}

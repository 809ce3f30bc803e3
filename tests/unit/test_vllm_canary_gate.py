"""The canary gate behind coldsnap's vLLM /sleep and /wake_up routes, with an engine that really sleeps.

vLLM's CPU build ignores sleep, so a real wake can never fail here; FakeSleepingEngine stands in for a
GPU engine whose sleep drops its weights (and whose wake can bring back the wrong ones).
"""

import asyncio

import pytest

from coldsnap_vllm.canary import CanaryGate, CanaryMismatch


class FakeSleepingEngine:
    def __init__(self):
        self.weights = [5, 6, 7]
        self.asleep = False
        self.calls = []

    async def sleep(self, level, mode):
        self.calls.append(("sleep", level))
        self.asleep = True

    async def wake_up(self, tags):
        self.calls.append(("wake_up", tags))
        if tags is not None and "weights" not in tags:
            return False  # KV only: still partly asleep
        self.asleep = False
        return True

    async def answer(self):
        assert not self.asleep, "asked while asleep"
        return list(self.weights)


def test_wake_passes_when_the_canary_comes_back_the_same():
    engine = FakeSleepingEngine()
    gate = CanaryGate(engine, engine.answer)
    asyncio.run(gate.sleep(1))
    assert gate.expected == [5, 6, 7] and engine.asleep
    assert asyncio.run(gate.wake_up(["kv_cache"])) == {"status": "sleeping", "tags": ["kv_cache"]}
    assert asyncio.run(gate.wake_up(None)) == {"status": "awake", "tags": None, "canary": "matched"}


def test_wake_with_wrong_weights_goes_back_to_sleep_and_says_why():
    engine = FakeSleepingEngine()
    gate = CanaryGate(engine, engine.answer)
    asyncio.run(gate.sleep(1))
    engine.weights = [5, 6, 8]  # what a bad hydration would leave
    with pytest.raises(CanaryMismatch, match="asleep again"):
        asyncio.run(gate.wake_up(None))
    assert engine.asleep and engine.calls[-1] == ("sleep", 1)


class FakeEngineOf026(FakeSleepingEngine):
    """vLLM 0.26's AsyncLLM: wake_up returns None; is_sleeping says whether it is (still) asleep."""

    async def wake_up(self, tags):
        await super().wake_up(tags)
        return None

    async def is_sleeping(self):
        return self.asleep


def test_a_wake_up_that_returns_nothing_is_checked_with_is_sleeping():
    engine = FakeEngineOf026()
    gate = CanaryGate(engine, engine.answer)
    asyncio.run(gate.sleep(1))
    assert asyncio.run(gate.wake_up(["kv_cache"])) == {"status": "sleeping", "tags": ["kv_cache"]}
    assert asyncio.run(gate.wake_up(None)) == {"status": "awake", "tags": None, "canary": "matched"}

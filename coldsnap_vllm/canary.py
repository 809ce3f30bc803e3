"""The exact-response canary around an engine's sleep and wake (no vLLM or web imports: testable alone)."""

from __future__ import annotations

from typing import Any, Awaitable, Callable

__all__ = ["CanaryGate", "CanaryMismatch", "CANARY_PROMPT", "CANARY_TOKENS"]

CANARY_PROMPT = "Reply with exactly: coldsnap-cuda-snapshot-ok"
CANARY_TOKENS = 16


class CanaryMismatch(RuntimeError):
    """The woken engine did not reproduce the canary; it has been put back to sleep."""


class CanaryGate:
    """Sleep and wake an engine client, proving the wake with the canary. ``ask`` returns the greedy
    canary tokens from the engine (vLLM: :func:`vllm_canary`)."""

    def __init__(self, engine: Any, ask: Callable[[], Awaitable[list[int]]]):
        self.engine = engine
        self.ask = ask
        self.expected: list[int] | None = None

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        if self.expected is None:  # while the weights are certainly the served ones
            self.expected = await self.ask()
        await self.engine.sleep(level, mode)

    async def wake_up(self, tags: list[str] | None = None) -> dict[str, Any]:
        fully_awake = await self.engine.wake_up(tags)
        if fully_awake is None:  # vLLM 0.26's wake_up returns nothing: ask
            fully_awake = not await self.engine.is_sleeping()
        if not fully_awake:
            return {"status": "sleeping", "tags": tags}
        if self.expected is None:
            return {"status": "awake", "tags": tags, "canary": "not recorded (the engine slept before coldsnap saw it)"}
        answered = await self.ask()
        if answered != self.expected:
            await self.engine.sleep(1, "abort")
            raise CanaryMismatch(f"the canary answered tokens {answered[:8]}… after waking, {self.expected[:8]}… before "
                                 "sleeping; the server is asleep again")
        return {"status": "awake", "tags": tags, "canary": "matched"}

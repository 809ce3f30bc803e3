"""vLLM's penalty statistics dropped before a checkpoint and zeroed at resume (coldsnap_vllm.sampler_state),
on a CPU torch: a model runner shaped like Model Runner V2's (sampler.penalties_state)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from coldsnap_vllm.sampler_state import PenaltyStatistics

torch = pytest.importorskip("torch")


def runner_with_statistics(slots: int = 8, vocab: int = 100) -> SimpleNamespace:
    state = SimpleNamespace(output_bin_counts=torch.ones(slots, vocab, dtype=torch.int32),
                            prompt_bin_mask=torch.ones(slots, (vocab + 31) // 32, dtype=torch.int32))
    return SimpleNamespace(sampler=SimpleNamespace(penalties_state=state))


def test_released_statistics_come_back_zeroed_with_their_shape():
    runner = runner_with_statistics()
    state = runner.sampler.penalties_state
    statistics = PenaltyStatistics(runner)
    statistics.release()
    assert state.output_bin_counts.numel() == 0 and state.prompt_bin_mask.numel() == 0
    assert statistics.dropped_bytes == 8 * 100 * 4 + 8 * 4 * 4
    statistics.release()  # idempotent: a standby's park releases again
    assert statistics.released["output_bin_counts"][0] == (8, 100)
    statistics.restore()
    assert state.output_bin_counts.shape == (8, 100) and state.output_bin_counts.dtype == torch.int32
    assert not state.output_bin_counts.any() and not state.prompt_bin_mask.any()
    statistics.restore()  # nothing owed any more
    assert state.output_bin_counts.shape == (8, 100)


def test_a_runner_without_penalty_statistics_is_left_alone():
    for runner in (SimpleNamespace(), SimpleNamespace(sampler=SimpleNamespace())):
        statistics = PenaltyStatistics(runner)
        statistics.release()
        statistics.restore()
        assert statistics.dropped_bytes == 0 and statistics.released == {}

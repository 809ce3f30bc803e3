"""The reference check's plan, mode and comparison (coldsnap.activation.reference_check)."""

import pytest

from coldsnap.activation.canary_probes import PROBES, ProbeAnswer
from coldsnap.activation.canary import Canary
from coldsnap.activation.reference_check import (REFERENCE_ENV, ReferenceAnswers, reference_mode, reference_plan)


def _answers(tokens=(5, 6, 7), argmax=(1, 2), probe_ids=(9, 10), probe_logprobs=(-0.5, -1.25), refused=False):
    probe = None if refused else ProbeAnswer([3, 4], list(probe_ids), list(probe_logprobs))
    return ReferenceAnswers(Canary("t", list(tokens), 0.1, list(argmax)), (((136, 2), probe),))


def test_the_plan_asks_the_restores_probes_first_then_its_own_of_other_lengths():
    plan = reference_plan(PROBES)
    assert plan[:len(PROBES)] == PROBES
    assert [length for length, _ in plan] == [136, 600, 8, 40, 100, 183, 287]
    assert reference_plan(((8, 2),))[0] == (8, 2) and [length for length, _ in reference_plan(((8, 2),))].count(8) == 1


def test_the_checks_own_probes_can_be_chosen(monkeypatch):
    monkeypatch.setenv("COLDSNAP_REFERENCE_PROBES", "8:4,136:9,50:2")
    assert reference_plan(PROBES) == (*PROBES, (8, 4), (50, 2))  # (136 is the restore's already)
    monkeypatch.setenv("COLDSNAP_REFERENCE_PROBES", "8")
    with pytest.raises(ValueError, match="is not LEN:TOKENS"):
        reference_plan(PROBES)


def test_the_mode_is_plain_for_engines_none_for_the_reference_workload_unless_told(monkeypatch):
    monkeypatch.delenv(REFERENCE_ENV, raising=False)
    assert (reference_mode("vllm"), reference_mode("sglang"), reference_mode("torch-lm")) == ("plain", "plain", "none")
    monkeypatch.setenv(REFERENCE_ENV, "none")
    assert reference_mode("vllm") == "none"
    monkeypatch.setenv(REFERENCE_ENV, "plain")
    assert reference_mode("torch-lm") == "plain"
    monkeypatch.setenv(REFERENCE_ENV, "always")
    with pytest.raises(ValueError, match="'always' is not a reference mode"):
        reference_mode("vllm")


def test_equal_answers_have_no_difference_and_one_digest():
    assert _answers().difference(_answers(), "a", "b") is None
    assert _answers().sha256() == _answers().sha256() != _answers(probe_logprobs=(-0.5, -1.0)).sha256()


@pytest.mark.parametrize("other, words", [
    (dict(tokens=(5, 8, 7)), "the canary prompt's token 1: b generated [8], a [6]"),
    (dict(tokens=(5, 6)), "the canary prompt's token 2: b generated [], a [7]"),
    (dict(argmax=(1, 3)), "the canary prompt's prefill at position 2: b predicted [3], a [2]"),
    (dict(probe_ids=(9, 11)), "probe of 136 prompt tokens (2 generated): b's token 1 is 11, a 10"),
    (dict(probe_logprobs=(-0.5, -1.0)), "probe of 136 prompt tokens (2 generated): b's token 1's logprob is -1.0, a -1.25"),
    (dict(refused=True), "probe of 136 prompt tokens (2 generated): b refused it or gave no token ids and logprobs"),
])
def test_a_difference_names_the_request_and_the_token(other, words):
    difference = _answers().difference(_answers(**other), "a", "b")
    assert difference is not None and difference.startswith(words), difference

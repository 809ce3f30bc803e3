"""The canary's probes: prompts of exact lengths whose token ids and logprobs a restore must reproduce.

One short text prompt proves little: a restored vLLM once gave the captured canary's tokens while it
answered 4 of 8 other prompts differently. The probes cover what the text canary does not: a prompt of
:data:`PROBES`' lengths each (a short prefill that runs inside a CUDA graph, a long one past the largest
graph size that vLLM and SGLang capture by default), a few decode steps after each (the decode graph,
the KV cache read back), and every generated token's logprob, not only its argmax, so a difference in
the last bits of the arithmetic fails the check even where it does not flip a token yet.

The prompts are token ids (exact lengths, no tokenizer needed here), drawn from ids 3–499: clear of the
usual special tokens 0–2, and ordinary tokens in every vocabulary of 500 or more. Asked through the
engine's OpenAI ``/v1/completions`` (``return_token_ids``, ``logprobs: 0``), one at a time and after the
text canary, in the same order at capture and at restore, so each runs alone in the same batch shape;
an engine that answers without ids or logprobs, or refuses a prompt (longer than its context), records
no probe of that length: the restore then checks what was recorded.
"""

from __future__ import annotations

import random
import struct
import urllib.error
from dataclasses import dataclass

from coldsnap.activation.engine_process import post_json
from coldsnap.settings import SETTINGS

__all__ = ["PROBES", "PROBES_ENV", "ProbeAnswer", "ask_probe", "bits_of", "first_difference", "float_of", "parse_probes",
           "probe_plan", "probe_prompt"]

PROBES = ((136, 4), (600, 2))
"""(prompt tokens, generated tokens) of each probe: 136 tokens run in one of vLLM's prefill graphs (a
capture size) and fill a KV block of every usual size (vLLM 16 on GPUs, 128 on CPUs; SGLang's pages are
tokens), so a prefix cache that outlived the KV cache is read back; 600 run past vLLM's largest graph size
(512) and SGLang's; the decode steps replay the batch-1 decode graph. (The H200 runs of 2026-12-03 used a
24-token short probe.)"""
PROBE_SEED = 20261203
PROBES_ENV = "COLDSNAP_CANARY_PROBES"
"""``LEN:TOKENS[,LEN:TOKENS...]``: the probes a capture records instead of :data:`PROBES` (``coldsnap capture
--canary-probes``). More probes check more of the engine's CUDA graph sizes and decode steps at every restore,
each costing one more request there."""
MOST_PROBES = 32
MOST_PROBE_PROMPT = 32768
MOST_PROBE_TOKENS = 1024


def parse_probes(text: str) -> tuple[tuple[int, int], ...]:
    """``LEN:TOKENS[,LEN:TOKENS...]`` → ((prompt tokens, generated tokens), ...) in the order given;
    :class:`ValueError` saying what is wrong (a malformed pair, a number out of range, a length twice)."""
    probes: list[tuple[int, int]] = []
    for item in text.split(","):
        length_text, colon, tokens_text = item.strip().partition(":")
        try:
            length, tokens = int(length_text), int(tokens_text)
        except ValueError:
            raise ValueError(f"{item.strip()!r} is not LEN:TOKENS (two whole numbers, e.g. 136:4)") from None
        if not colon or not 1 <= length <= MOST_PROBE_PROMPT or not 1 <= tokens <= MOST_PROBE_TOKENS:
            raise ValueError(f"{item.strip()!r}: a probe is LEN:TOKENS with 1 ≤ LEN ≤ {MOST_PROBE_PROMPT} prompt tokens "
                             f"and 1 ≤ TOKENS ≤ {MOST_PROBE_TOKENS} generated tokens")
        if any(length == seen for seen, _ in probes):
            raise ValueError(f"prompt length {length} is given twice (a length names one prompt)")
        probes.append((length, tokens))
    if len(probes) > MOST_PROBES:
        raise ValueError(f"{len(probes)} probes; at most {MOST_PROBES}")
    return tuple(probes)


def probe_plan() -> tuple[tuple[int, int], ...]:
    """The probes a capture records: :data:`PROBES_ENV`'s, else :data:`PROBES` (ValueError: malformed)."""
    text = SETTINGS.text(PROBES_ENV)
    return parse_probes(text) if text else PROBES


@dataclass(frozen=True)
class ProbeAnswer:
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]


def bits_of(value: float) -> int:
    """The IEEE-754 double's bits as a signed 64-bit integer (how a contract keeps a float exactly)."""
    return int(struct.unpack("<q", struct.pack("<d", value))[0])


def float_of(bits: int) -> float:
    return float(struct.unpack("<d", struct.pack("<q", bits))[0])


def probe_prompt(length: int, seed: int = PROBE_SEED) -> list[int]:
    """The probe prompt of ``length`` token ids (the same for a seed on every host)."""
    rng = random.Random(seed + length)
    return [rng.randrange(3, 500) for _ in range(length)]


def ask_probe(port: int, prompt_ids: list[int], max_tokens: int, timeout: float = 120.0) -> ProbeAnswer | None:
    """Greedy ``max_tokens`` tokens after ``prompt_ids`` (EOS ignored) with each token's logprob; None when
    the engine refuses the prompt (HTTP 4xx: e.g. longer than its context) or answers without token ids or
    logprobs. Other failures raise (:class:`OSError`): the server did not answer."""
    body = {"prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "logprobs": 0,
            "return_token_ids": True}
    try:
        document = post_json(port, "/v1/completions", body, timeout)
    except urllib.error.HTTPError as exc:
        if 400 <= exc.code < 500:
            return None
        raise
    try:
        choice = document["choices"][0]
        ids = [int(t) for t in choice["token_ids"]]
        logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
    except (KeyError, IndexError, TypeError, ValueError):
        return None
    if len(ids) != max_tokens or len(logprobs) != len(ids):
        return None
    return ProbeAnswer(list(prompt_ids), ids, logprobs)


def first_difference(expected_ids: list[int], expected_logprobs: list[float], answer: ProbeAnswer,
                     expected: str = "captured") -> str | None:
    """Where ``answer`` departs from what was recorded (``expected`` names who gave that), in words; None when
    ids and logprobs are all equal."""
    for index, (want, got) in enumerate(zip(expected_ids, answer.token_ids)):
        if want != got:
            return f"token {index} is {got}, {expected} {want}"
        if expected_logprobs[index] != answer.logprobs[index]:
            return (f"token {index}'s logprob is {answer.logprobs[index]!r}, {expected} {expected_logprobs[index]!r} "
                    f"(difference {answer.logprobs[index] - expected_logprobs[index]:.3g})")
    if len(expected_ids) != len(answer.token_ids):
        return f"{len(answer.token_ids)} tokens, {expected} {len(expected_ids)}"
    return None

"""The reference check of a capture: the captured engine must answer as a plain start of the same command does.

A restore reproduces the captured process bit for bit (CRIU + the CUDA checkpoint), and its canary proves
that it did, against answers the captured process itself gave. Neither can tell when the captured process
was already unlike every plain start of its command: vLLM 8B on H100 hosts was seen to answer differently
from every plain start, before its snapshot, when the capture was the host's first vLLM start, and every
restore of it inherited that. So a capture first starts the command *plainly* (same command, same
environment, no ``COLDSNAP_CONTROL``: coldsnap's plugin loads as in any start, its agent does not), asks it
the canary and a wide set of probes, stops it, and only then starts the engine it captures: that engine
is never the host's first start (the reference filled the compile caches), and its answers to the same
requests, in the same order, must equal the reference's — token ids and every logprob's bits.

On a mismatch the check tries once more, with one plain start and one capture start: a second plain start
that agrees with neither earlier answer means plain starts of the command disagree on this host (nothing
can be proved, and the capture fails saying so); otherwise the new capture start must answer as the second
plain start did. Nothing is committed on a failure (``capture.reference``).

What a restore checks stays cheap (:data:`coldsnap.activation.canary_probes.PROBES`, a few tokens each):
it proves the restore faithful to the captured process; this check proves that process right, once.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal, Sequence

from coldsnap.activation.canary_probes import ProbeAnswer, ask_probe, bits_of, first_difference, parse_probes, probe_prompt
from coldsnap.activation.canary import Canary, ask_canary
from coldsnap.contracts.canonical import canonical_json
from coldsnap.settings import SETTINGS

__all__ = ["REFERENCE_ENV", "REFERENCE_MODES", "REFERENCE_PROBES", "REFERENCE_PROBES_ENV", "ReferenceAnswers",
           "ReferenceMode", "ask_probes", "ask_reference", "reference_mode", "reference_plan"]

ReferenceMode = Literal["plain", "none"]
REFERENCE_MODES: tuple[ReferenceMode, ...] = ("plain", "none")
REFERENCE_ENV = "COLDSNAP_CAPTURE_REFERENCE"
"""``plain`` or ``none`` (``coldsnap capture --reference``); unset: ``plain`` for an engine (vLLM, SGLang),
``none`` for coldsnap's own reference workload (a deterministic model with no compiler and no CUDA graphs)."""

REFERENCE_PROBES = "8:32,40:32,100:32,183:32,287:32"
"""Asked of the reference start and of the captured engine after the restore's own probes (prompt lengths must
differ from those): prefills that vLLM runs through its piecewise CUDA graphs of several sizes (8, 40, 100 and
the 183 and 287 tokens where a deviant H100 capture parted at its first token), each followed by 32 decode
steps (the batch-1 decode graph over a growing KV cache); the restore's 600-token probe covers a prefill past
the largest graph size. Decode graphs of batch sizes above one need concurrent requests, whose batching
depends on timing: not asked."""

REFERENCE_PROBES_ENV = "COLDSNAP_REFERENCE_PROBES"
"""``LEN:TOKENS[,LEN:TOKENS...]``: the check's own probes instead of :data:`REFERENCE_PROBES` (``coldsnap capture
--reference-probes``), e.g. fewer decode steps where decoding is slow (a CPU engine)."""

ENGINES_CHECKED_BY_DEFAULT = ("vllm", "sglang")


def reference_mode(engine: str) -> ReferenceMode:
    """The capture's reference mode: :data:`REFERENCE_ENV`'s, else by engine (ValueError: not a mode)."""
    text = SETTINGS.text(REFERENCE_ENV)
    if not text:
        return "plain" if engine in ENGINES_CHECKED_BY_DEFAULT else "none"
    if text not in REFERENCE_MODES:
        raise ValueError(f"{text!r} is not a reference mode (one of: {', '.join(REFERENCE_MODES)})")
    return text


def reference_plan(restore_plan: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Every probe the check asks: the restore's (in its order), then the check's own (:data:`REFERENCE_PROBES_ENV`'s,
    else :data:`REFERENCE_PROBES`) of lengths the restore's do not already have (ValueError: malformed)."""
    lengths = {length for length, _ in restore_plan}
    own = parse_probes(SETTINGS.text(REFERENCE_PROBES_ENV) or REFERENCE_PROBES)
    return (*restore_plan, *(p for p in own if p[0] not in lengths))


@dataclass(frozen=True)
class ReferenceAnswers:
    """What one server answered to the check's requests, asked in this order: the canary prompt (its
    tokens and the prefill's top-1 prediction at every prompt position), then each probe of the plan
    (None where the server refused it or gave no ids and logprobs)."""

    canary: Canary
    probes: tuple[tuple[tuple[int, int], ProbeAnswer | None], ...]

    def difference(self, other: "ReferenceAnswers", mine: str, theirs: str) -> str | None:
        """Where ``other`` departs from these answers, in words naming the request and token; None when equal."""
        if other.canary.token_ids != self.canary.token_ids:
            index = _first_unequal(self.canary.token_ids, other.canary.token_ids)
            return (f"the canary prompt's token {index}: {theirs} generated {other.canary.token_ids[index:index + 1]}, "
                    f"{mine} {self.canary.token_ids[index:index + 1]}")
        if other.canary.prompt_argmax != self.canary.prompt_argmax:
            mine_top, their_top = self.canary.prompt_argmax or [], other.canary.prompt_argmax or []
            index = _first_unequal(mine_top, their_top)
            return (f"the canary prompt's prefill at position {index + 1}: {theirs} predicted "
                    f"{their_top[index:index + 1]}, {mine} {mine_top[index:index + 1]}")
        for ((length, tokens), answer), (_, other_answer) in zip(self.probes, other.probes):
            where = f"probe of {length} prompt tokens ({tokens} generated)"
            if (answer is None) != (other_answer is None):
                refused = theirs if other_answer is None else mine
                return f"{where}: {refused} refused it or gave no token ids and logprobs"
            if answer is not None and other_answer is not None:
                difference = first_difference(answer.token_ids, answer.logprobs, other_answer, expected=mine)
                if difference is not None:
                    return f"{where}: {theirs}'s {difference}"
        return None

    def answered(self) -> list[ProbeAnswer]:
        return [answer for _, answer in self.probes if answer is not None]

    def sha256(self) -> str:
        """One digest of every answer, ids and logprob bits (the receipt's ``answers_sha256``)."""
        document = {"canary": {"token_ids": self.canary.token_ids, "prompt_argmax": self.canary.prompt_argmax},
                    "probes": [None if a is None else {"length": length, "token_ids": a.token_ids,
                                                       "logprob_bits": [bits_of(x) for x in a.logprobs]}
                               for (length, _), a in self.probes]}
        return hashlib.sha256(canonical_json(document)).hexdigest()


def _first_unequal(a: Sequence[int], b: Sequence[int]) -> int:
    """The first index where ``a`` and ``b`` differ (the shorter one's length when one is the other's start)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def ask_probes(port: int, plan: Sequence[tuple[int, int]]) -> tuple[tuple[tuple[int, int], ProbeAnswer | None], ...]:
    """Every probe of ``plan``, one at a time, in order. OSError: the server did not answer."""
    return tuple(((length, tokens), ask_probe(port, probe_prompt(length), tokens)) for length, tokens in plan)


def ask_reference(port: int, prompt: str, max_tokens: int, plan: Sequence[tuple[int, int]]) -> ReferenceAnswers:
    """The check's requests, one at a time, in order: the canary (with the prefill's predictions), then
    every probe of ``plan``. OSError: the server did not answer."""
    return ReferenceAnswers(ask_canary(port, prompt, max_tokens, prompt_argmax=True), ask_probes(port, plan))

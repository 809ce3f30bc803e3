"""The canary: a greedy completion asked of a served engine through its OpenAI ``/v1/completions``, whose
tokens (and, at capture, the prefill's top-1 prediction at every prompt position) a restore must give back
exactly. Its probes of exact prompt lengths are :mod:`coldsnap.activation.canary_probes`."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from coldsnap.activation.engine_process import post_json

__all__ = ["Canary", "ask_canary"]


@dataclass(frozen=True)
class Canary:
    text: str
    token_ids: list[int]
    seconds: float
    prompt_argmax: list[int] | None = None
    """The top-1 next token the prefill predicted at each prompt position but the first (None: not asked,
    or the engine gave no prompt logprobs)."""


def ask_canary(port: int, prompt: str, max_tokens: int, timeout: float = 120.0, prompt_argmax: bool = False) -> Canary:
    """Greedy completion through the engine's own OpenAI-compatible ``POST /v1/completions``; with
    ``prompt_argmax``, also the prefill's top-1 prediction at every prompt position (vLLM's
    ``prompt_logprobs``: one forward pass checks the model at every position)."""
    request: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}
    if prompt_argmax:
        request["prompt_logprobs"] = 1
    started = time.perf_counter()
    choice = post_json(port, "/v1/completions", request, timeout)["choices"][0]
    predicted = _top_ones(choice.get("prompt_logprobs")) if prompt_argmax else None
    return Canary(choice["text"], list(choice.get("token_ids") or []), time.perf_counter() - started, predicted)


def _top_ones(prompt_logprobs: Any) -> list[int] | None:
    """The rank-1 token at each prompt position after the first, from an OpenAI-style ``prompt_logprobs``
    list (``[None, {"<token id>": {"logprob": ..., "rank": ...}, ...}, ...]``); None when it is not that."""
    if not isinstance(prompt_logprobs, list) or len(prompt_logprobs) < 2:
        return None
    top = []
    for entry in prompt_logprobs[1:]:
        ranked = [int(token) for token, info in (entry or {}).items() if isinstance(info, dict) and info.get("rank") == 1]
        if len(ranked) != 1:
            return None
        top.append(ranked[0])
    return top

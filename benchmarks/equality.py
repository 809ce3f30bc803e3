"""Does a restored server compute what a cold start computes? Many prompts, greedy, token ids and logprobs.

The prompt set is token ids drawn from a seeded generator (lengths 8 to 1500, log-uniform, so short and
long prefills and prompts that cross every CUDA-graph size are all there), so it needs no tokenizer and
gives the same requests on every run. Each prompt is asked greedily for ``max_tokens`` tokens with the
chosen token's logprob at every step, one request at a time (the server sees each alone: batch shapes
are the same in both servers) and again at a concurrency (the batches then depend on timing; the same
server's two concurrent passes give the spread that timing alone causes).

    from benchmarks.equality import equality_prompts, ask_all, compare
    cold = ask_all(port, equality_prompts(256), 64, concurrency=1)
    ...
    print(compare(cold, restored))

Engines: ``vllm`` asks the OpenAI ``/v1/completions`` (``return_token_ids``, ``logprobs``), ``sglang``
its native ``/generate`` (``return_logprob``): both give ids and logprobs without a tokenizer round trip.
"""

from __future__ import annotations

import math
import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from coldsnap.activation.engine_process import post_json

__all__ = ["Answer", "CONCURRENCY", "EQUALITY_PROMPTS", "EQUALITY_TOKENS", "answers_from_json", "answers_json", "ask",
           "ask_all", "compare", "equality_answers", "equality_prompts", "equality_summary", "render_summary"]

EQUALITY_PROMPTS = 256
EQUALITY_TOKENS = 64
TRAINED_VOCAB = 512
"""The test models' tokenizer (coldsnap.workloads.tiny_llama) has 512 trained tokens; ids above stay
within it, so a prompt is also text a tokenizer could have made."""


@dataclass(frozen=True)
class Answer:
    ids: list[int]
    logprobs: list[float]  # the chosen token's, per generated token


def equality_prompts(count: int = EQUALITY_PROMPTS, *, seed: int = 0, shortest: int = 8, longest: int = 1500,
                     vocab: int = TRAINED_VOCAB) -> list[list[int]]:
    """``count`` prompts of token ids (3 … ``vocab``-1: clear of the special tokens 0–2), lengths
    log-uniform in [``shortest``, ``longest``], the first the shortest and the last the longest."""
    rng = random.Random(seed)
    prompts = []
    for index in range(count):
        if count > 1 and index in (0, count - 1):
            length = shortest if index == 0 else longest
        else:
            length = int(round(math.exp(rng.uniform(math.log(shortest), math.log(longest)))))
        prompts.append([rng.randrange(3, vocab) for _ in range(length)])
    return prompts


def ask(port: int, prompt: Sequence[int] | str, max_tokens: int, engine: str = "vllm", timeout: float = 300.0) -> Answer:
    """One greedy completion of ``prompt`` (token ids, or text) with the chosen tokens' logprobs; EOS ignored,
    so every answer has ``max_tokens`` tokens."""
    wire = prompt if isinstance(prompt, str) else list(prompt)
    if engine == "sglang":
        document = post_json(port, "/generate", {"text" if isinstance(wire, str) else "input_ids": wire,
                                             "return_logprob": True, "sampling_params": {
            "temperature": 0, "max_new_tokens": max_tokens, "ignore_eos": True}}, timeout)
        entries = document["meta_info"]["output_token_logprobs"]  # [logprob, token id, text]
        return Answer([int(e[1]) for e in entries], [float(e[0]) for e in entries])
    document = post_json(port, "/v1/completions", {"prompt": wire, "max_tokens": max_tokens, "temperature": 0,
                                               "ignore_eos": True, "logprobs": 0, "return_token_ids": True}, timeout)
    choice = document["choices"][0]
    return Answer(list(choice["token_ids"]), [float(x) for x in choice["logprobs"]["token_logprobs"]])


def ask_all(port: int, prompts: Sequence[Sequence[int]], max_tokens: int = EQUALITY_TOKENS, *, concurrency: int = 1,
            engine: str = "vllm") -> list[Answer]:
    """Every prompt's answer, in prompt order; ``concurrency`` requests in flight at once."""
    if concurrency <= 1:
        return [ask(port, p, max_tokens, engine) for p in prompts]
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda p: ask(port, p, max_tokens, engine), prompts))


def compare(reference: Sequence[Answer], other: Sequence[Answer]) -> dict[str, Any]:
    """How ``other`` differs from ``reference``: prompts whose token ids differ, each one's first differing
    position, and the largest |logprob difference| over the positions where both chose the same tokens
    so far (after a divergence the two answers continue different texts and their logprobs are not
    comparable)."""
    if len(reference) != len(other):
        raise ValueError(f"{len(reference)} answers against {len(other)}")
    differing: list[dict[str, int]] = []
    largest = 0.0
    for index, (a, b) in enumerate(zip(reference, other)):
        same = 0
        while same < min(len(a.ids), len(b.ids)) and a.ids[same] == b.ids[same]:
            same += 1
        if same < max(len(a.ids), len(b.ids)):
            differing.append({"prompt": index, "first_differing_token": same})
        # the logprob at the first differing position is still of the same context: include it
        for x, y in zip(a.logprobs[:same + 1], b.logprobs[:same + 1]):
            largest = max(largest, abs(x - y))
    return {"prompts": len(reference), "differing": len(differing), "largest_logprob_difference": largest,
            "differing_prompts": differing[:32]}


CONCURRENCY = 32


def flush_prefix_cache(port: int, engine: str) -> None:
    """Empty SGLang's radix cache before a pass: it matches prefixes token by token, so a prompt that shares
    its first token with whatever the server was asked before (a restore's canary probes, the previous
    pass) would be served partly from the cache in one server and not in the other. vLLM's prefix cache
    matches whole 16-token blocks, which random prompts do not share: nothing to do."""
    if engine != "sglang":
        return
    import time
    import urllib.error
    import urllib.request

    for attempt in range(10):  # SGLang refuses (400) while a request is still running or waiting
        try:
            with urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/flush_cache", method="POST"),
                                        timeout=60) as response:
                response.read()
                return
        except urllib.error.HTTPError as exc:
            if exc.code != 400 or attempt == 9:
                raise
            time.sleep(1)


def equality_answers(port: int, *, prompts: int = EQUALITY_PROMPTS, tokens: int = EQUALITY_TOKENS,
                     concurrent_passes: int = 1, engine: str = "vllm", longest: int = 1500) -> dict[str, Any]:
    """The answers of the server on ``port`` to the prompt set, one at a time and ``concurrent_passes``
    times at :data:`CONCURRENCY` (as JSON values; seconds of the one-at-a-time pass); SGLang's prefix
    cache emptied before each pass (:func:`flush_prefix_cache`)."""
    import time

    prompt_set = equality_prompts(prompts, longest=longest)
    flush_prefix_cache(port, engine)
    started = time.perf_counter()
    answers: dict[str, Any] = {"one_at_a_time": answers_json(ask_all(port, prompt_set, tokens, engine=engine))}
    answers["one_at_a_time_s"] = round(time.perf_counter() - started, 1)
    for index in range(concurrent_passes):
        flush_prefix_cache(port, engine)
        answers[f"concurrent_{index}"] = answers_json(ask_all(port, prompt_set, tokens, concurrency=CONCURRENCY,
                                                              engine=engine))
    return answers


def equality_summary(cold: dict[str, Any], restored: dict[str, Any]) -> dict[str, Any]:
    """Restored against cold, one at a time and concurrently; with a cold server's second concurrent pass,
    the spread that batching alone causes (engines are not batch-invariant by default)."""
    load = answers_from_json
    summary = {"one at a time: restored vs cold": compare(load(cold["one_at_a_time"]), load(restored["one_at_a_time"]))}
    if "concurrent_0" in cold and "concurrent_0" in restored:
        summary[f"concurrency {CONCURRENCY}: restored vs cold"] = compare(load(cold["concurrent_0"]),
                                                                         load(restored["concurrent_0"]))
    if "concurrent_1" in cold:
        summary[f"concurrency {CONCURRENCY}: cold vs cold (same server, second pass)"] = compare(
            load(cold["concurrent_0"]), load(cold["concurrent_1"]))
    return summary


def render_summary(summary: dict[str, Any]) -> str:
    return "\n".join(f"{name}: {value['differing']}/{value['prompts']} prompts differ, largest |logprob difference| "
                     f"{value['largest_logprob_difference']:.3g}" for name, value in summary.items())


def answers_json(answers: Sequence[Answer]) -> list[dict[str, Any]]:
    return [asdict(a) for a in answers]


def answers_from_json(document: Sequence[dict[str, Any]]) -> list[Answer]:
    return [Answer(list(d["ids"]), list(d["logprobs"])) for d in document]

"""Reference workload: a Llama-shaped causal LM with seeded random weights, served over HTTP.

    python -m coldsnap.workloads.torch_lm --size tiny|1b|8b --device cpu|cuda --port P [--tp N]
    python -m coldsnap.workloads.torch_lm --size tiny --write-safetensors DIR

It qualifies a host without an engine installed and is what the snapshot tests and benchmarks run.
It uses coldsnap the way an engine plugin does: weights live in the ``weights`` stable region, a
static KV cache in the ``kv_cache`` region, and when ``COLDSNAP_CONTROL`` is set an in-process agent
lets the launcher release and restore both around a snapshot.

``--tp N`` runs N rank processes under a small supervisor (no torch in it), one GPU each
(``cuda:rank``) or all on the CPU: rank 0 serves HTTP and forwards every request to the other ranks,
which follow it step by step; their all-reduces go through NCCL (GPU) or loopback TCP (CPU), both
torn down before a snapshot and rebuilt after it through the activation's coordinator.

``POST /v1/completions`` takes ``prompt``, ``max_tokens`` and ``temperature`` (only 0, greedy) and
answers with the text and the token ids. The model itself is :mod:`.model` (imported lazily here, so
the supervisor never loads torch).
"""

from __future__ import annotations

from typing import Any

__all__ = ["LmShape", "SIZES", "TorchLM", "encode", "decode", "parameter_shapes"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from coldsnap.workloads.torch_lm import model

        return getattr(model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""vLLM's own ``--api-key`` check around a restored server's app, with the key given at restore
(:mod:`coldsnap.agent.api_key` says why the key is never captured and how it arrives)."""

from __future__ import annotations

from typing import Any

__all__ = ["vllm_key_guard"]


def vllm_key_guard(app: Any, stack: Any, key: str) -> Any:
    """vLLM's ``AuthenticationMiddleware`` around ``stack``, as ``vllm serve --api-key KEY`` adds it: requests
    to ``/v1``, ``/v2``, ``/inference`` (and from 0.32 ``/cohere``) need ``Authorization: Bearer KEY``; every
    other path (``/health``, ``/metrics``, the dev-mode routes) stays open, as in vLLM."""
    from coldsnap_vllm import compat

    for symbol in compat.AUTHENTICATION_MIDDLEWARES:
        try:
            middleware = compat.lookup(symbol)
        except LookupError:
            continue
        return middleware(stack, tokens=[key])
    raise LookupError(f"vLLM {compat.vllm_version()} has no AuthenticationMiddleware where coldsnap looks "
                      f"({', '.join(compat.AUTHENTICATION_MIDDLEWARES)})")

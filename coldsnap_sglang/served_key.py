"""SGLang's own ``--api-key`` check around a restored server's app, with the key given at restore
(:mod:`coldsnap.agent.api_key` says why the key is never captured and how it arrives)."""

from __future__ import annotations

from typing import Any

__all__ = ["sglang_key_guard"]


class _MiddlewareOf:
    """Stands in for the app in ``add_api_key_middleware(app, ...)``, which only calls ``app.add_middleware(cls,
    **options)``: the class SGLang defines there (a local one) and its options, kept."""

    def add_middleware(self, cls: Any, **options: Any) -> None:
        self.cls, self.options = cls, options


def sglang_key_guard(app: Any, stack: Any, key: str) -> Any:
    """SGLang's API-key middleware around ``stack``, as ``--api-key KEY`` adds it
    (``sglang.srt.utils.auth.add_api_key_middleware``): every path but OPTIONS, ``/health*``, ``/metrics*`` (and
    from 0.5.23 ``/ready*``) needs ``Authorization: Bearer KEY``; the routes' own auth levels hold."""
    from sglang.srt.utils.auth import add_api_key_middleware

    captured = _MiddlewareOf()
    add_api_key_middleware(captured, api_key=key, admin_api_key=None)
    return captured.cls(stack, **{**captured.options, "fastapi_app": app})

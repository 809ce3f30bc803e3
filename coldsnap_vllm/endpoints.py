"""``/sleep`` and ``/wake_up`` with coldsnap's exact-response canary, as a vLLM endpoint plugin.

    VLLM_PLUGINS=coldsnap VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --load-format coldsnap \\
        --enable-sleep-mode --sleep-mode-backend coldsnap

(``--sleep-mode-backend`` exists from vLLM 0.33; before it, ``COLDSNAP_VLLM_SLEEP_BACKEND=coldsnap``.)

vLLM's ``/sleep`` and ``/wake_up`` (dev mode only) are replaced by the same routes with one addition:
before the first sleep the server answers the canary (``Reply with exactly: coldsnap-cuda-snapshot-ok``,
greedy) and remembers the tokens; a ``/wake_up`` that leaves the engine fully awake asks again, and
if the tokens differ the engine is put back to sleep and the route answers 503 saying why — the
server never takes traffic with weights or KV that did not come back right. Partial wakes (``tags``)
answer as vLLM does. Endpoint plugins load only when named in ``VLLM_PLUGINS``, and these routes are
attached only in vLLM's dev mode, like vLLM's own.
"""

from __future__ import annotations

import uuid
from typing import Any, Awaitable, Callable

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.responses import JSONResponse

from coldsnap_vllm.canary import CANARY_PROMPT, CANARY_TOKENS, CanaryGate, CanaryMismatch

__all__ = ["ColdsnapEndpoints", "vllm_canary", "replace_routes"]

def vllm_canary(engine: Any) -> Callable[[], Awaitable[list[int]]]:
    async def ask() -> list[int]:
        from vllm import SamplingParams

        final = None
        params = SamplingParams(temperature=0.0, max_tokens=CANARY_TOKENS)
        async for output in engine.generate(CANARY_PROMPT, params, f"coldsnap-canary-{uuid.uuid4().hex}"):
            final = output
        if final is None or not final.outputs:
            raise CanaryMismatch("the canary got no answer")
        return list(final.outputs[0].token_ids)

    return ask


router = APIRouter()


def _gate(request: Request) -> CanaryGate:
    return request.app.state.coldsnap_canary


@router.post("/sleep")
async def sleep(raw_request: Request, level: int = Query(1, ge=0, le=2), mode: str = Query("abort")) -> JSONResponse:
    await _gate(raw_request).sleep(level, mode)
    return JSONResponse(content={"status": "sleeping", "level": level})


@router.post("/wake_up")
async def wake_up(raw_request: Request) -> JSONResponse:
    tags = raw_request.query_params.getlist("tags") or None
    try:
        return JSONResponse(content=await _gate(raw_request).wake_up(tags))
    except CanaryMismatch as exc:
        return JSONResponse(status_code=503, content={"status": "sleeping", "error": str(exc)})


def replace_routes(app: FastAPI, replacement: APIRouter) -> None:
    """Attach ``replacement``'s routes in place of the app's routes of the same path and method.
    vLLM 0.33 removes them itself; 0.26 only appends the plugin's, and Starlette serves the first
    match, so vLLM's own ``/sleep`` would keep answering."""
    ours = {(route.path, method) for route in replacement.routes for method in getattr(route, "methods", None) or ()}
    app.router.routes[:] = [route for route in app.router.routes
                            if not any((getattr(route, "path", None), m) in ours for m in getattr(route, "methods", None) or ())]
    app.include_router(replacement)


class ColdsnapEndpoints:
    """The ``vllm.endpoint_plugins`` entry point (a zero-argument factory)."""

    name = "coldsnap"
    required_tasks = ("generate",)

    def attach_router(self, app: FastAPI) -> None:
        import vllm.envs as envs

        if envs.VLLM_SERVER_DEV_MODE:  # vLLM exposes sleep/wake only in dev mode; so do we
            replace_routes(app, router)

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        if engine_client is not None:
            state.coldsnap_canary = CanaryGate(engine_client, vllm_canary(engine_client))

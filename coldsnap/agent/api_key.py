"""The served API key of a restored server, supplied at restore and never captured.

A capsule is a memory dump published to a registry: a server started with ``--api-key`` would carry its key in
every page image. So the captured command runs without one, and in its HTTP process (the one that builds the
FastAPI app: vLLM's API server, SGLang's launching process) the engine plugin installs a *key gate*: an ASGI
wrapper of the app's middleware stack that passes everything through until a key is given, then hands every
request to the engine's own authentication middleware built around the same stack (vLLM's
``AuthenticationMiddleware``, SGLang's ``add_api_key_middleware`` class), so the engine's rules (which paths are
guarded, the ``Bearer`` check) are the ones that hold. The gate listens on an abstract unix socket named after
the agent's control (:func:`coldsnap.agent.addresses.key_gate_control`): restored by CRIU with the process,
renamed with the agents' for a replica; ``coldsnap restore --api-key-file F`` sends the key there before the
canary, which then asks with it.

CRIU lets the restored tree's sockets take connections before its ranks resume and the key arrives, so the
capture *holds* the gate just before its snapshot: the engine's guard with a random key nobody knows (its guarded
paths answer 401, ``/health`` stays open). Every restore then either gives the key or opens the gate (no key: the
server as captured), after the ranks resumed. An n580 engine starts anew at each restore: its placement's
``COLDSNAP_KEY_GATE_HELD=1`` builds its gate held when a key is to come.

Starlette builds an app's middleware stack once, at its first ASGI call (uvicorn's lifespan startup), and
reads ``app.middleware_stack`` on every request: the gate wraps what ``build_middleware_stack`` returns, for
every app the process builds while ``COLDSNAP_CONTROL`` is set. Standard library only; it imports no engine.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import struct
import threading
from typing import Any, Callable

from coldsnap.agent.addresses import MOST_GATES, address, key_gate_control
from coldsnap.settings import SETTINGS

__all__ = ["KeyGate", "Guard", "install_key_gates", "gates"]

logger = logging.getLogger(__name__)

Guard = Callable[[Any, Any, str], Any]
"""(the FastAPI app, the stack to guard, the key) → the engine's authentication middleware around the stack."""

_gates: list["KeyGate"] = []
_lock = threading.Lock()
_key: str | None = None  # the key (or the hold's) given before an app was built: a gate built later takes it
_listening = False


class KeyGate:
    """An ASGI app in front of one FastAPI app's middleware stack: the stack itself until :meth:`install`, then
    the engine's authentication middleware around it."""

    def __init__(self, app: Any, stack: Any, guard: Guard):
        self.app, self.stack, self.guard = app, stack, guard
        self.current = stack

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.current(scope, receive, send)

    def install(self, key: str | None) -> None:
        """The engine's guard with ``key``; None: the stack as it is (open). One store: a request in flight keeps
        the stack it started on."""
        self.current = self.stack if key is None else self.guard(self.app, self.stack, key)


def gates() -> list[KeyGate]:
    with _lock:
        return list(_gates)


def install_key_gates(guard: Guard) -> bool:
    """Wrap every FastAPI app's middleware stack this process builds from now on in a :class:`KeyGate` (one
    listener per process); False, and nothing done, when the process runs without coldsnap (no
    ``COLDSNAP_CONTROL``). Idempotent; an engine's plugin calls it at registration, before its app exists."""
    global _key
    control = SETTINGS.text("COLDSNAP_CONTROL")
    if not control:
        return False
    if SETTINGS.flag("COLDSNAP_KEY_GATE_HELD"):
        with _lock:
            _key = _key or secrets.token_urlsafe(32)
    from fastapi import FastAPI

    original = FastAPI.build_middleware_stack
    if getattr(original, "__coldsnap_key_gate__", False):
        return True

    def build_middleware_stack(self: Any) -> Any:
        gate = KeyGate(self, original(self), guard)
        with _lock:
            _gates.append(gate)
            if _key is not None:
                gate.install(_key)
        _listen(control)
        return gate

    build_middleware_stack.__coldsnap_key_gate__ = True  # type: ignore[attr-defined]
    FastAPI.build_middleware_stack = build_middleware_stack
    return True


def _listen(control: str) -> None:
    """One listener per process, at the first free of the control's gate names: a vLLM with several API server
    processes (``--api-server-count``) has one gate each, and the launcher tells every one."""
    global _listening
    with _lock:
        if _listening:
            return
        _listening = True
    for index in range(MOST_GATES):
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(address(key_gate_control(control, index)))
            listener.listen(4)
        except OSError:  # taken by another HTTP process of this engine
            listener.close()
            continue
        threading.Thread(target=_serve, args=(listener,), name="coldsnap-key-gate", daemon=True).start()
        return
    logger.warning("coldsnap: no key gate listener in pid %d (%d gate names taken): --api-key-file cannot reach "
                   "this process", os.getpid(), MOST_GATES)


def _peer_allowed(connection: socket.socket) -> bool:
    """An abstract socket has no file permissions: only root or this process's user may set the key."""
    credentials = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", credentials)
    return uid in (0, os.getuid())


def _serve(listener: socket.socket) -> None:
    while True:
        try:
            connection, _ = listener.accept()
        except OSError:
            continue
        with connection:
            try:
                connection.settimeout(10)
                reply = _answer(connection)
            except Exception as exc:  # noqa: BLE001 - one bad request must not end the listener
                reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            try:
                connection.sendall(json.dumps(reply).encode() + b"\n")
            except OSError:
                pass


def _answer(connection: socket.socket) -> dict[str, Any]:
    global _key
    if not _peer_allowed(connection):
        return {"ok": False, "error": "only root or the server's own user may set its API key"}
    data = b""
    while not data.endswith(b"\n") and len(data) < 65536:
        chunk = connection.recv(4096)
        if not chunk:
            break
        data += chunk
    message = json.loads(data)
    if "api_key" in message:
        key = message["api_key"]
        if not isinstance(key, str) or not key:
            return {"ok": False, "error": "api_key must be a non-empty string"}
    elif message.get("hold") is True:
        key = secrets.token_urlsafe(32)  # nobody's: the guarded paths answer 401 until a restore says otherwise
    elif message.get("open") is True:
        key = None
    else:
        return {"ok": False, "error": "want {\"api_key\": KEY}, {\"hold\": true} or {\"open\": true}"}
    with _lock:
        _key = key
        for gate in _gates:
            gate.install(key)
        count = len(_gates)
    return {"ok": True, "gates": count, "pid": os.getpid()}

"""coldsnap's side of the host-provider protocol (:mod:`coldsnap.provider.messages`): one connection to the
manager's socket for the operation, requests multiplexed over it by id.

    provider = HostProvider.from_settings()          # None: no provider was given (COLDSNAP_HOST_PROVIDER_SOCKET)
    result = provider.exec("node1", ["coldsnap", "restore", ...], timeout_s=600)
    running = provider.start_exec("node1", argv, on_output=print)   # a unit's launcher: waited for, or cancelled
    provider.put("node1", "/var/lib/coldsnap/token", b"...", mode=0o600)

A failure the provider reports is a :class:`ProviderError` with its code; a provider that goes away fails every
request under way with ``provider.lost``, at once.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import socket
import threading
from dataclasses import dataclass
from typing import Any, Callable

from coldsnap import __version__
from coldsnap.contracts.capabilities import HostProviderStatus
from coldsnap.provider.messages import (CHUNK_BYTES, PROVIDER_FORMAT, Cancel, Done, Exec, Exited, Failure, FileData, Get,
                                        Hello, Output, Probe, ProtocolError, Put, Welcome, Whoami, WhoamiReply,
                                        data_of, decode_to_client, encoded, receive_message, send_message)
from coldsnap.settings import SETTINGS

__all__ = ["ExecResult", "HostProvider", "ProviderError", "RunningExec", "SOCKET_ENV", "TOKEN_ENV", "provider_status"]

SOCKET_ENV = "COLDSNAP_HOST_PROVIDER_SOCKET"
TOKEN_ENV = "COLDSNAP_HOST_PROVIDER_TOKEN"
CONNECT_TIMEOUT_S = 10.0


class ProviderError(Exception):
    """The provider refused or failed a request (``code``: one of the protocol's, or ``provider.lost`` when the
    connection went away, ``provider.connect`` when it could not be opened)."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True)
class ExecResult:
    status: int | None
    """The exit status (None: a signal ended it)."""
    signal: int | None
    stdout: bytes
    stderr: bytes


class RunningExec:
    """An exec under way: :meth:`wait` for its end, :meth:`cancel` to have its process group killed."""

    def __init__(self, provider: "HostProvider", request_id: int, replies: "queue.Queue[Any]",
                 on_output: Callable[[str, bytes], None] | None):
        self._provider, self.id, self._replies, self._on_output = provider, request_id, replies, on_output
        self._stdout: list[bytes] = []
        self._stderr: list[bytes] = []

    def wait(self, timeout: float | None = None) -> ExecResult:
        """Its end (:class:`ProviderError` when the provider failed it; ``TimeoutError`` past ``timeout``)."""
        while True:
            try:
                reply = self._replies.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"request {self.id} still running after {timeout} s") from None
            if isinstance(reply, Output):
                data = data_of(reply.data)
                (self._stdout if reply.stream == "stdout" else self._stderr).append(data)
                if self._on_output is not None:
                    self._on_output(reply.stream, data)
                continue
            self._provider._forget(self.id)
            if isinstance(reply, Exited):
                stdout = data_of(reply.stdout) if reply.stdout is not None else b"".join(self._stdout)
                stderr = data_of(reply.stderr) if reply.stderr is not None else b"".join(self._stderr)
                return ExecResult(reply.status, reply.signal, stdout, stderr)
            raise _error_of(reply)

    def cancel(self) -> None:
        self._provider._send(Cancel(id=self.id))


def _error_of(reply: Any) -> ProviderError:
    if isinstance(reply, Failure):
        return ProviderError(reply.code, reply.message)
    if isinstance(reply, ProviderError):
        return reply
    return ProviderError("provider.message", f"an unexpected {type(reply).__name__}")


class HostProvider:
    """One connection to a manager's host provider, welcomed (:attr:`welcome`: its operations and hosts)."""

    def __init__(self, path: str, token: str, connect_timeout_s: float = CONNECT_TIMEOUT_S):
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(connect_timeout_s)
        address = "\0" + path[1:] if path.startswith("@") else path
        try:
            self._sock.connect(address)
        except OSError as exc:
            self._sock.close()
            raise ProviderError("provider.connect", f"{path}: {exc.strerror or exc}") from None
        unsent: OSError | None = None
        try:
            send_message(self._sock, Hello(format=PROVIDER_FORMAT, token=token, client=f"coldsnap {__version__}"))
        except OSError as exc:  # (the provider may have refused us already: its reason is there to read)
            unsent = exc
        try:
            body = receive_message(self._sock)
            first = decode_to_client(body) if body is not None else None
        except (OSError, ProtocolError) as exc:
            self._sock.close()
            raise ProviderError("provider.connect", f"{path}: {unsent or exc}") from None
        if not isinstance(first, Welcome):
            self._sock.close()
            if isinstance(first, Failure):
                raise ProviderError(first.code, first.message)
            raise ProviderError("provider.connect", f"{path}: the provider closed the connection without a welcome")
        self.welcome = first
        self._sock.settimeout(None)
        self._ids = itertools.count(1)
        self._pending: dict[int, queue.Queue[Any]] = {}
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._lost: ProviderError | None = None
        self._reader = threading.Thread(target=self._read, name="coldsnap-provider-client", daemon=True)
        self._reader.start()

    @classmethod
    def from_settings(cls) -> "HostProvider | None":
        """The provider ``COLDSNAP_HOST_PROVIDER_SOCKET`` names, opened with ``COLDSNAP_HOST_PROVIDER_TOKEN``; None
        when no socket is named (:class:`ProviderError` when one is and it cannot be opened)."""
        path = SETTINGS.text(SOCKET_ENV)
        if not path:
            return None
        token = SETTINGS.text(TOKEN_ENV)
        if not token:
            raise ProviderError("provider.connect", f"{SOCKET_ENV} is set but {TOKEN_ENV} is not")
        return cls(path, token)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

    def __enter__(self) -> "HostProvider":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the operations ----

    def start_exec(self, host: str, argv: list[str], env: dict[str, str] | None = None, stdin: bytes | None = None,
                   timeout_s: float | None = None, on_output: Callable[[str, bytes], None] | None = None) -> RunningExec:
        request_id, replies = self._open()
        self._send(Exec(id=request_id, host=host, argv=argv, env=env or {},
                        stdin=encoded(stdin) if stdin is not None else None, timeout_s=timeout_s))
        return RunningExec(self, request_id, replies, on_output)

    def exec(self, host: str, argv: list[str], env: dict[str, str] | None = None, stdin: bytes | None = None,
             timeout_s: float | None = None) -> ExecResult:
        return self.start_exec(host, argv, env, stdin, timeout_s).wait()

    def probe(self, host: str, argv: list[str], timeout_s: float = 10) -> ExecResult:
        request_id, replies = self._open()
        self._send(Probe(id=request_id, host=host, argv=argv, timeout_s=timeout_s))
        return RunningExec(self, request_id, replies, None).wait()

    def put(self, host: str, path: str, data: bytes, mode: int = 0o644) -> Done:
        request_id, replies = self._open()
        offsets = range(0, max(len(data), 1), CHUNK_BYTES)
        for offset in offsets:
            self._send(Put(id=request_id, host=host, path=path, offset=offset, mode=mode,
                           data=encoded(data[offset:offset + CHUNK_BYTES]), last=offset == offsets[-1]))
        return self._done(request_id, replies)

    def get(self, host: str, path: str) -> bytes:
        request_id, replies = self._open()
        self._send(Get(id=request_id, host=host, path=path))
        chunks = []
        while True:
            reply = replies.get()
            if isinstance(reply, FileData):
                chunks.append(data_of(reply.data))
                continue
            self._forget(request_id)
            if isinstance(reply, Done):
                return b"".join(chunks)
            raise _error_of(reply)

    def whoami(self) -> WhoamiReply:
        request_id, replies = self._open()
        self._send(Whoami(id=request_id))
        reply = replies.get()
        self._forget(request_id)
        if isinstance(reply, WhoamiReply):
            return reply
        raise _error_of(reply)

    # ---- the connection ----

    def _done(self, request_id: int, replies: "queue.Queue[Any]") -> Done:
        reply = replies.get()
        self._forget(request_id)
        if isinstance(reply, Done):
            return reply
        raise _error_of(reply)

    def _open(self) -> tuple[int, "queue.Queue[Any]"]:
        with self._lock:
            if self._lost is not None:
                raise self._lost
            request_id = next(self._ids)
            replies: queue.Queue[Any] = queue.Queue()
            self._pending[request_id] = replies
        return request_id, replies

    def _forget(self, request_id: int) -> None:
        with self._lock:
            self._pending.pop(request_id, None)

    def _send(self, message: Any) -> None:
        with self._send_lock:
            try:
                send_message(self._sock, message)
            except OSError as exc:
                # the provider closed the connection: its reason, if it sent one, is on its way to the reader
                self._reader.join(timeout=1)
                self._lose(f"the provider's socket failed: {exc}")
                raise self._lost or ProviderError("provider.lost", str(exc)) from None

    def _read(self) -> None:
        while True:
            try:
                body = receive_message(self._sock)
                if body is None:
                    return self._lose("the provider closed the connection")
                reply = decode_to_client(body)
            except (OSError, ProtocolError) as exc:
                return self._lose(f"{exc}")
            if isinstance(reply, Welcome) or (isinstance(reply, Failure) and reply.id is None):
                return self._lose(f"{reply.code}: {reply.message}" if isinstance(reply, Failure)
                                  else "a second welcome: not the protocol")
            with self._lock:
                replies = self._pending.get(reply.id) if reply.id is not None else None
            if replies is not None:
                replies.put(reply)

    def _lose(self, why: str) -> None:
        """Every request under way fails now: the provider is gone (or broke the protocol)."""
        with self._lock:
            if self._lost is None:
                self._lost = ProviderError("provider.lost", why)
            pending = list(self._pending.values())
        for replies in pending:
            replies.put(self._lost)


def provider_status() -> HostProviderStatus:
    """The manager's provider as this process finds it (``coldsnap capabilities``): named or not, and whether it
    welcomes this build (the connection is closed again)."""
    if not SETTINGS.text(SOCKET_ENV):
        return HostProviderStatus(given=False, connected=False)
    try:
        provider = HostProvider.from_settings()
    except ProviderError as exc:
        return HostProviderStatus(given=True, connected=False, problem=str(exc))
    assert provider is not None
    with provider:
        welcome = provider.welcome
        return HostProviderStatus(given=True, connected=True, provider=welcome.provider,
                                  operations=list(welcome.operations), hosts=list(welcome.hosts))

"""The manager host-provider protocol, format 1: its messages, their framing and its failure codes.

A manager (Sparkrun, a Kubernetes operator, ``coldsnap provider serve``) serves one private Unix socket for one
operation, named to coldsnap by ``COLDSNAP_HOST_PROVIDER_SOCKET`` and opened with ``COLDSNAP_HOST_PROVIDER_TOKEN``.
Through it coldsnap asks for work on a named host — an exact argv run (``exec``), a non-mutating one in the
host's network namespace (``probe``), a file written or read (``put``, ``get``), the manager's own uid and gid
(``whoami``) — while how a host is reached, and every credential, stay the manager's. docs/host-provider.md is
the written protocol; this module is its code.

Framing: every message is a 4-byte big-endian length, then that many bytes of one JSON object (strict: no
duplicate key, no NaN), at most :data:`MAX_MESSAGE_BYTES`. The client speaks first (:class:`Hello`, with the
token); the provider answers :class:`Welcome` or an :class:`Failure` and closes. Then every request carries an
``id`` the client chose, unique on its connection; the provider's answers to it carry the same ``id``, so several
requests may be under way at once. Every message decodes strictly (an unknown field or type is refused) and a
failure crosses the socket as a :class:`Failure` with a code of :data:`FailureCode`, never as text to match.

This module imports only the standard library and pydantic: the launcher's client and the reference provider
both use it.
"""

from __future__ import annotations

import base64
import json
import socket
import struct
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from coldsnap.contracts.capabilities import HOST_PROVIDER_FORMAT

__all__ = ["CHUNK_BYTES", "Cancel", "Done", "Exec", "Exited", "Failure", "FailureCode", "FileData", "Get", "Hello",
           "MAX_MESSAGE_BYTES", "Output", "PROVIDER_FORMAT", "Probe", "ProtocolError", "Put", "Request", "Welcome",
           "Whoami", "WhoamiReply", "decode_to_client", "decode_to_provider", "receive_message", "send_message",
           "OPERATIONS", "data_of", "encoded"]

PROVIDER_FORMAT = HOST_PROVIDER_FORMAT
MAX_MESSAGE_BYTES = 1 << 20
"""The largest message either side sends or takes (a longer one is ``provider.message``, and the connection closes)."""
CHUNK_BYTES = 512 * 1024
"""A file's or a stream's bytes per message (base64 keeps each message under :data:`MAX_MESSAGE_BYTES`)."""
Operation = Literal["exec", "probe", "put", "get", "whoami"]
OPERATIONS: tuple[Operation, ...] = ("exec", "probe", "put", "get", "whoami")
"""What a format-1 provider may offer (its :class:`Welcome` says which it does)."""

FailureCode = Literal[
    "provider.token",  # the token did not match: nothing else is answered on the connection
    "provider.format",  # the client speaks a format the provider does not
    "provider.busy",  # a second client: the provider serves one connection at a time
    "provider.message",  # a message that is not one of the protocol's, too large, or out of order
    "provider.host",  # no such host, or the host could not be reached
    "provider.refused",  # the provider will not do this (an operation it does not offer, a path it does not allow)
    "provider.exec",  # the argv could not be started on the host
    "provider.io",  # a file could not be written or read on the host
    "provider.timeout",  # the request's own timeout passed: what it started was stopped
    "provider.cancelled",  # the client cancelled the request: what it started was stopped
]


class ProtocolError(Exception):
    """A message that is not the protocol's (too large, not JSON, not a known message, or cut short)."""


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


HostName = Annotated[str, Field(min_length=1, max_length=255, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")]
RequestId = Annotated[int, Field(ge=1, le=2**53)]


# ---- client → provider --------------------------------------------------------------------------------------

class Hello(_Message):
    """The client's first message: the protocol's format, the operation's token, what it will ask for."""

    type: Literal["hello"] = "hello"
    format: int
    token: str = Field(min_length=16, max_length=4096)
    client: str = Field(max_length=200)
    """Who asks (``coldsnap <version>``), for the provider's log."""


class Exec(_Message):
    """Run ``argv`` exactly (no shell) on ``host``: its output streamed back (:class:`Output`), then :class:`Exited`."""

    type: Literal["exec"] = "exec"
    id: RequestId
    host: HostName
    argv: list[Annotated[str, Field(max_length=65536)]] = Field(min_length=1, max_length=4096)
    env: dict[str, str] = Field(default_factory=dict)
    """Set on top of the provider's environment for that host (never the client's own)."""
    stdin: str | None = None
    """Base64 bytes written to the process's stdin, which is then closed (None: no stdin)."""
    timeout_s: float | None = Field(default=None, gt=0, le=86400)
    """Past this the process group is killed and the request fails with ``provider.timeout``."""


class Probe(_Message):
    """Run ``argv`` on ``host`` in its network namespace, a command that changes nothing (``ss``, ``ip``, a bind
    test): one :class:`Exited` with the whole output. A provider may allow probes where it allows no exec."""

    type: Literal["probe"] = "probe"
    id: RequestId
    host: HostName
    argv: list[Annotated[str, Field(max_length=65536)]] = Field(min_length=1, max_length=256)
    timeout_s: float = Field(default=10, gt=0, le=600)


class Put(_Message):
    """Bytes of a file on ``host``: chunks in order from offset 0, the last with ``last``; written to a temporary
    name beside ``path`` and renamed into place with ``mode`` after the last chunk (:class:`Done`)."""

    type: Literal["put"] = "put"
    id: RequestId
    host: HostName
    path: str = Field(min_length=1, max_length=4096, pattern=r"^/")
    offset: int = Field(ge=0)
    data: str
    """Base64, at most :data:`CHUNK_BYTES` decoded."""
    last: bool
    mode: int = Field(default=0o644, ge=0, le=0o7777)


class Get(_Message):
    """The bytes of a file on ``host``: :class:`FileData` chunks in order, then :class:`Done`."""

    type: Literal["get"] = "get"
    id: RequestId
    host: HostName
    path: str = Field(min_length=1, max_length=4096, pattern=r"^/")


class Whoami(_Message):
    """Who the manager runs as (for ``--owner``): :class:`WhoamiReply`."""

    type: Literal["whoami"] = "whoami"
    id: RequestId


class Cancel(_Message):
    """Stop request ``id``: what it started is killed, and it fails with ``provider.cancelled``."""

    type: Literal["cancel"] = "cancel"
    id: RequestId


Request = Union[Exec, Probe, Put, Get, Whoami, Cancel]


# ---- provider → client --------------------------------------------------------------------------------------

class Welcome(_Message):
    """The token matched: the provider's format, its name, the operations it offers and its hosts."""

    type: Literal["welcome"] = "welcome"
    format: int
    provider: str = Field(max_length=200)
    operations: list[Operation]
    hosts: list[HostName]


class Output(_Message):
    """Some of an exec's output, in order per stream."""

    type: Literal["output"] = "output"
    id: RequestId
    stream: Literal["stdout", "stderr"]
    data: str
    """Base64."""


class Exited(_Message):
    """An exec or probe ended: its status (None when a signal ended it), the signal, and for a probe its output."""

    type: Literal["exited"] = "exited"
    id: RequestId
    status: int | None
    signal: int | None = None
    stdout: str | None = None
    """A probe's whole stdout, base64 (None for an exec: streamed as :class:`Output`)."""
    stderr: str | None = None


class FileData(_Message):
    """A chunk of a :class:`Get`'s file."""

    type: Literal["file-data"] = "file-data"
    id: RequestId
    offset: int = Field(ge=0)
    data: str


class Done(_Message):
    """A put or get finished: the file's size and SHA-256."""

    type: Literal["done"] = "done"
    id: RequestId
    size: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class WhoamiReply(_Message):
    type: Literal["whoami-reply"] = "whoami-reply"
    id: RequestId
    uid: int = Field(ge=0)
    gid: int = Field(ge=0)
    user: str = Field(max_length=256)


class Failure(_Message):
    """A request failed (``id``), or the connection did (``id`` None: the provider closes it after this)."""

    type: Literal["failure"] = "failure"
    id: RequestId | None = None
    code: FailureCode
    message: str = Field(max_length=65536)


ToProvider = Annotated[Union[Hello, Exec, Probe, Put, Get, Whoami, Cancel], Field(discriminator="type")]
ToClient = Annotated[Union[Welcome, Output, Exited, FileData, Done, WhoamiReply, Failure], Field(discriminator="type")]
_TO_PROVIDER: TypeAdapter[Any] = TypeAdapter(ToProvider)
_TO_CLIENT: TypeAdapter[Any] = TypeAdapter(ToClient)


def _strict_object(body: bytes) -> dict[str, Any]:
    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [key for key, _ in pairs]
        if len(set(keys)) != len(keys):
            raise ProtocolError("a message with a duplicate key")
        return dict(pairs)

    def no_constant(name: str) -> Any:
        raise ProtocolError(f"a message with {name}")

    try:
        document = json.loads(body, object_pairs_hook=no_duplicates, parse_constant=no_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"a message that is not JSON ({exc})") from None
    if not isinstance(document, dict):
        raise ProtocolError("a message that is not a JSON object")
    return document


def _decode(adapter: TypeAdapter[Any], body: bytes) -> Any:
    try:
        return adapter.validate_python(_strict_object(body))
    except ValidationError as exc:
        problem = exc.errors()[0]
        where = ".".join(str(part) for part in problem["loc"])
        raise ProtocolError(f"not a message of the protocol: {where}: {problem['msg']}") from None


def decode_to_provider(body: bytes) -> Hello | Request:
    return _decode(_TO_PROVIDER, body)


def decode_to_client(body: bytes) -> Welcome | Output | Exited | FileData | Done | WhoamiReply | Failure:
    return _decode(_TO_CLIENT, body)


def encoded(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def data_of(text: str) -> bytes:
    """Base64 ``text`` as bytes (:class:`ProtocolError` when it is not base64)."""
    try:
        return base64.b64decode(text, validate=True)
    except ValueError:
        raise ProtocolError("data that is not base64") from None


def send_message(sock: socket.socket, message: _Message) -> None:
    body = message.model_dump_json().encode()
    if len(body) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"a message of {len(body)} bytes (at most {MAX_MESSAGE_BYTES})")
    sock.sendall(struct.pack(">I", len(body)) + body)


def _exactly(sock: socket.socket, size: int) -> bytes | None:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 16))
        if not chunk:
            if left == size:
                return None
            raise ProtocolError("the connection closed inside a message")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def receive_message(sock: socket.socket) -> bytes | None:
    """The next message's body (None: the other side closed the connection between messages)."""
    head = _exactly(sock, 4)
    if head is None:
        return None
    (size,) = struct.unpack(">I", head)
    if size > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"a message of {size} bytes (at most {MAX_MESSAGE_BYTES})")
    body = _exactly(sock, size)
    if body is None:
        raise ProtocolError("the connection closed inside a message")
    return body

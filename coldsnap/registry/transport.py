"""HTTP to one registry for :class:`~coldsnap.registry.client.RegistryClient`: a connection per thread (TLS with
the CAs podman and docker read for that registry, or plain HTTP), requests retried once on a dropped
connection, files sent with ``sendfile``, and the registry's ``WWW-Authenticate`` challenge answered: HTTP
Basic, or a Bearer token from its token service (``repository:<name>:pull[,push]``). No header, token or
password is ever logged or kept in an error."""

from __future__ import annotations

import base64
import http.client
import json
import os
import re
import ssl
import threading
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from coldsnap.registry.credentials import Credentials
from coldsnap.registry.errors import RegistryAuthError, RegistryNotFound, RegistryProtocolError, RegistryUnreachable

__all__ = ["BUFFER_BYTES", "RegistryTransport"]

BUFFER_BYTES = 8 << 20
_CHALLENGE = re.compile(r'(\w+)="([^"]*)"')


@dataclass
class _Auth:
    header: str | None = None


class RegistryTransport:
    """The HTTP side of one repository of one registry. Thread-safe: each thread keeps its own connection."""

    def __init__(self, registry: str, repository: str, *, credentials: Credentials | None = None,
                 plain_http: bool = False, push: bool = False, timeout: float = 120.0):
        self.registry = registry
        self.repository = repository
        self.credentials = credentials
        self.plain_http = plain_http
        self.timeout = timeout
        self._actions = "pull,push" if push else "pull"
        self._auth = _Auth()
        self._auth_lock = threading.Lock()
        self._local = threading.local()
        self._tls = None if plain_http else self._tls_context(registry)

    @staticmethod
    def _tls_context(registry: str) -> ssl.SSLContext:
        """The system's trust (``SSL_CERT_FILE`` honoured) plus the CAs podman and docker read for this
        registry: ``/etc/containers/certs.d/<registry>/*.crt`` and ``/etc/docker/certs.d/<registry>/*.crt``."""
        context = ssl.create_default_context()
        for root in (Path("/etc/containers/certs.d"), Path("/etc/docker/certs.d")):
            for ca in sorted((root / registry).glob("*.crt")) if (root / registry).is_dir() else []:
                context.load_verify_locations(cafile=str(ca))
        return context

    def _new_connection(self, host: str, https: bool) -> http.client.HTTPConnection:
        if https:
            return http.client.HTTPSConnection(host, timeout=self.timeout, context=self._tls or ssl.create_default_context(),
                                               blocksize=BUFFER_BYTES)
        return http.client.HTTPConnection(host, timeout=self.timeout, blocksize=BUFFER_BYTES)

    def _connection(self) -> http.client.HTTPConnection:
        connection = getattr(self._local, "connection", None)
        if connection is None:
            connection = self._local.connection = self._new_connection(self.registry, not self.plain_http)
        return connection

    def _drop_connection(self) -> None:
        connection = getattr(self._local, "connection", None)
        if connection is not None:
            connection.close()
            self._local.connection = None

    def _url(self, path: str) -> str:
        return f"{'http' if self.plain_http else 'https'}://{self.registry}{path}"

    def _exchange(self, method: str, target: str, headers: dict[str, str], body: bytes | None = None,
                  send_file: tuple[int, int, int] | None = None) -> http.client.HTTPResponse:
        """One request on this thread's connection (reconnecting once if the kept-alive one was closed);
        ``send_file`` = (fd, offset, count) streams the body from a file."""
        for attempt in (0, 1):
            connection = self._connection()
            try:
                connection.putrequest(method, target, skip_accept_encoding=True)
                for name, value in headers.items():
                    connection.putheader(name, value)
                if body is not None:
                    connection.putheader("Content-Length", str(len(body)))
                elif send_file is not None:
                    connection.putheader("Content-Length", str(send_file[2]))
                connection.endheaders(body)
                if send_file is not None:
                    self._send_file(connection, *send_file)
                return connection.getresponse()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError) as exc:
                self._drop_connection()
                if attempt or send_file is not None and send_file[2] > BUFFER_BYTES:
                    raise RegistryUnreachable(f"{self.registry} closed the connection ({exc.__class__.__name__})") from None
            except ssl.SSLCertVerificationError as exc:
                self._drop_connection()
                raise RegistryUnreachable(
                    f"{self.registry}: its TLS certificate is not trusted here ({exc.verify_message}); put its CA in "
                    f"/etc/containers/certs.d/{self.registry}/ca.crt") from None
            except (OSError, http.client.HTTPException) as exc:
                self._drop_connection()
                raise RegistryUnreachable(f"{self.registry}: {getattr(exc, 'strerror', None) or exc}") from None
        raise AssertionError("unreachable")

    @staticmethod
    def _send_file(connection: http.client.HTTPConnection, fd: int, offset: int, count: int) -> None:
        sock = connection.sock
        assert sock is not None
        if not isinstance(sock, ssl.SSLSocket):
            with os.fdopen(os.dup(fd), "rb") as handle:
                sock.sendfile(handle, offset, count)
            return
        buffer = bytearray(min(BUFFER_BYTES, max(count, 1)))
        view = memoryview(buffer)
        while count:
            n = os.preadv(fd, [view[:min(count, len(buffer))]], offset)
            if n <= 0:
                raise OSError("the file got shorter while it was sent")
            sock.sendall(view[:n])
            offset += n
            count -= n

    def _authorize(self, response: http.client.HTTPResponse) -> None:
        """Answer a 401's challenge: Basic with the credentials, or a Bearer token for this repository."""
        challenge = response.getheader("WWW-Authenticate") or ""
        scheme = challenge.split(" ", 1)[0].lower()
        if self.credentials is None and scheme == "basic":
            raise RegistryAuthError(f"{self.registry} wants a login and no credentials for it were found "
                                    "(REGISTRY_AUTH_FILE, `podman login` or `docker login`)")
        if scheme == "basic":
            assert self.credentials is not None
            pair = f"{self.credentials.username}:{self.credentials.secret}".encode()
            self._auth.header = "Basic " + base64.b64encode(pair).decode()
            return
        if scheme != "bearer":
            raise RegistryAuthError(f"{self.registry} asks for authentication coldsnap does not speak ({scheme or 'none'})")
        fields = dict(_CHALLENGE.findall(challenge))
        realm = fields.get("realm")
        if not realm:
            raise RegistryProtocolError(f"{self.registry}: a Bearer challenge without a realm")
        query = {"service": fields.get("service", self.registry),
                 "scope": fields.get("scope") or f"repository:{self.repository}:{self._actions}"}
        url = urllib.parse.urlsplit(realm)
        target = f"{url.path or '/'}?{urllib.parse.urlencode(query)}"
        headers = {}
        if self.credentials is not None:
            pair = f"{self.credentials.username}:{self.credentials.secret}".encode()
            headers["Authorization"] = "Basic " + base64.b64encode(pair).decode()
        connection = self._new_connection(url.netloc, url.scheme == "https")
        try:
            connection.request("GET", target, headers=headers)
            answer = connection.getresponse()
            data = answer.read()
        except (OSError, http.client.HTTPException) as exc:
            raise RegistryUnreachable(f"{self.registry}'s token service {url.netloc}: {exc}") from None
        finally:
            connection.close()
        if answer.status in (401, 403):
            raise RegistryAuthError(f"{self.registry} refused the credentials from {self._source()}")
        try:
            token = json.loads(data).get("token") or json.loads(data).get("access_token")
        except ValueError:
            token = None
        if answer.status != 200 or not token:
            raise RegistryProtocolError(f"{self.registry}'s token service answered {answer.status} without a token")
        self._auth.header = f"Bearer {token}"

    def _source(self) -> str:
        return self.credentials.source if self.credentials else "nowhere (anonymous)"

    def _request(self, method: str, path: str, headers: dict[str, str] | None = None, body: bytes | None = None,
                 send_file: tuple[int, int, int] | None = None, expect: Iterable[int] = (200,),
                 what: str = "") -> http.client.HTTPResponse:
        """A request with authentication (one retry after a 401); the response body is left to the caller
        on an expected status and read (for the message) otherwise."""
        expected = tuple(expect)
        for attempt in (0, 1):
            sent = dict(headers or {})
            if self._auth.header:
                sent["Authorization"] = self._auth.header
            response = self._exchange(method, path, sent, body, send_file)
            if response.status == 401 and attempt == 0:
                response.read()
                with self._auth_lock:
                    if self._auth.header == sent.get("Authorization"):  # another thread may have renewed it
                        self._authorize(response)
                continue
            if response.status in expected:
                return response
            detail = self._error_detail(response.read())
            if response.status == 401:
                raise RegistryAuthError(f"{self.registry} refused {what or path}: not authorized with the "
                                        f"credentials from {self._source()}{detail}")
            if response.status == 403:
                raise RegistryAuthError(f"{self.registry} forbids {what or path} for these credentials{detail}")
            if response.status == 404:
                raise RegistryNotFound(f"{self.registry}/{self.repository}: {what or path} not found{detail}")
            raise RegistryProtocolError(f"{self.registry}: {method} {what or path} answered {response.status}{detail}")
        raise AssertionError("unreachable")

    @staticmethod
    def _error_detail(data: bytes) -> str:
        try:
            errors = json.loads(data).get("errors") or []
            return "".join(f" ({e.get('code')}: {e.get('message')})" for e in errors[:2])
        except (ValueError, AttributeError):
            return ""

    def _path(self, kind: str, reference: str) -> str:
        return f"/v2/{self.repository}/{kind}/{reference}"

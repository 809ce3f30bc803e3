"""A small client of the OCI distribution API (v2): blobs and manifests of one repository.

Standard library only, so it runs in any serving image. Every blob streams between disk and socket
through one reused buffer while it is hashed: a push sends a file with ``sendfile`` over plain HTTP; a
pull of a large blob fetches byte ranges in parallel into the file while one thread hashes the
finished prefix in order, so the SHA-256 is known the moment the last range lands. The HTTP beneath
(connections, TLS, the registry's authentication challenge, with the credentials of
:mod:`coldsnap.registry.credentials`) is :mod:`coldsnap.registry.transport`; the errors,
:mod:`coldsnap.registry.errors`.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import mmap
import os
import threading
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from coldsnap.atomic import write_atomic
from coldsnap.registry.credentials import find_credentials
from coldsnap.registry.errors import DigestMismatch, RegistryProtocolError, RegistryUnreachable
from coldsnap.registry.reference import Reference
from coldsnap.registry.transport import BUFFER_BYTES, RegistryTransport
from coldsnap.settings import SETTINGS

__all__ = [
    "PLAIN_HTTP_ENV",
    "RegistryClient",
    "client_for",
    "sha256_digest",
]

RANGE_BYTES = 128 << 20
"""A blob larger than this is fetched as parallel ranges of this size."""
OnBytes = Callable[[int], None]
PLAIN_HTTP_ENV = "COLDSNAP_PLAIN_HTTP_REGISTRIES"
"""Comma-separated ``host:port`` of registries spoken to over plain HTTP (a registry on the node itself, a
test); every other registry is HTTPS with the certificate verified."""


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class RegistryClient(RegistryTransport):
    """Blobs and manifests of one repository of one registry. Thread-safe: each thread keeps its own connection."""

    def check(self) -> None:
        """``GET /v2/``: the registry answers and the credentials are accepted."""
        self._request("GET", "/v2/", what="the API check").read()

    def blob_exists(self, digest: str) -> bool:
        response = self._request("HEAD", self._path("blobs", digest), expect=(200, 404), what=f"blob {digest}")
        response.read()
        return response.status == 200

    def manifest_exists(self, digest: str) -> bool:
        response = self._request("HEAD", self._path("manifests", digest), expect=(200, 404),
                                 headers={"Accept": _ACCEPT}, what=f"manifest {digest}")
        response.read()
        return response.status == 200

    def push_blob(self, digest: str, *, data: bytes | None = None, path: Path | None = None, size: int = 0,
                  offset: int = 0, on_bytes: OnBytes | None = None) -> None:
        """Upload one blob, monolithically (POST then PUT with the digest): the registry checks the digest.
        From a file: its ``size`` bytes at ``offset`` (a chunk of a pack)."""
        start = self._request("POST", f"/v2/{self.repository}/blobs/uploads/", expect=(202,), body=b"",
                              what="a blob upload")
        start.read()
        location = start.getheader("Location")
        if not location:
            raise RegistryProtocolError(f"{self.registry}: an upload without a Location")
        url = urllib.parse.urlsplit(location)
        if url.netloc and url.netloc != self.registry:
            raise RegistryProtocolError(f"{self.registry}: uploads to another host ({url.netloc}) are not supported")
        query = url.query + ("&" if url.query else "") + urllib.parse.urlencode({"digest": digest})
        target = f"{url.path}?{query}"
        headers = {"Content-Type": "application/octet-stream"}
        if data is not None:
            self._request("PUT", target, headers=headers, body=data, expect=(201,), what=f"blob {digest}").read()
        else:
            assert path is not None
            fd = os.open(path, os.O_RDONLY)
            try:
                self._request("PUT", target, headers=headers, send_file=(fd, offset, size), expect=(201,),
                              what=f"blob {digest}").read()
            finally:
                os.close(fd)
        if on_bytes:
            on_bytes(size if data is None else len(data))

    def put_manifest(self, reference: str, data: bytes, media_type: str) -> str:
        digest = sha256_digest(data)
        response = self._request("PUT", self._path("manifests", reference), headers={"Content-Type": media_type},
                                 body=data, expect=(201,), what=f"manifest {reference}")
        response.read()
        answered = response.getheader("Docker-Content-Digest")
        if answered and answered != digest:
            raise DigestMismatch(f"{self.registry} stored manifest {reference} as {answered}, not {digest}")
        return digest

    def get_manifest(self, reference: str) -> tuple[bytes, str, str]:
        """(bytes, media type, digest); a manifest asked by digest is checked against it."""
        response = self._request("GET", self._path("manifests", reference), headers={"Accept": _ACCEPT},
                                 what=f"manifest {reference}")
        data = response.read()
        digest = sha256_digest(data)
        if reference.startswith("sha256:") and digest != reference:
            raise DigestMismatch(f"{self.registry}/{self.repository}: manifest {reference} came back as {digest}")
        return data, response.getheader("Content-Type") or "", digest

    def fetch_bytes(self, digest: str, limit: int = 64 << 20) -> bytes:
        response = self._blob_response(digest, {})
        data = response.read(limit + 1)
        if len(data) > limit:
            raise RegistryProtocolError(f"{self.registry}: blob {digest} is larger than {limit} bytes")
        if sha256_digest(data) != digest:
            raise DigestMismatch(f"{self.registry}/{self.repository}: blob {digest} does not match its digest")
        return data

    def _blob_response(self, digest: str, headers: dict[str, str]) -> http.client.HTTPResponse:
        """GET a blob, following a redirect to the registry's storage (without our Authorization there)."""
        response = self._request("GET", self._path("blobs", digest), headers=headers,
                                 expect=(200, 206, 307, 302, 303), what=f"blob {digest}")
        if response.status not in (302, 303, 307):
            return response
        response.read()
        url = urllib.parse.urlsplit(response.getheader("Location") or "")
        if not url.netloc:
            return self._request("GET", url.path + (f"?{url.query}" if url.query else ""), headers=headers,
                                 expect=(200, 206), what=f"blob {digest}")
        connection = self._new_connection(url.netloc, url.scheme == "https")
        connection.request("GET", url.path + (f"?{url.query}" if url.query else ""), headers=headers)
        redirected = connection.getresponse()
        if redirected.status not in (200, 206):
            raise RegistryProtocolError(f"{self.registry}: blob {digest}'s storage answered {redirected.status}")
        return redirected

    def fetch_blob(self, digest: str, size: int, destination: Path, *, on_bytes: OnBytes | None = None,
                   parallel: int = min(4, os.cpu_count() or 1)) -> None:
        """Stream blob ``digest`` (``size`` bytes) into ``destination`` and check its SHA-256 as it lands.

        Large blobs are fetched as parallel ranges (one stream per CPU, up to 4: on 2 CPUs a third stream only
        adds contention, measured); ranges already fetched by an interrupted earlier
        pull (``<destination>.ranges``) are not fetched again — the hash still reads them, so a
        damaged leftover is caught. Raises :class:`DigestMismatch` (and removes the file) on a mismatch."""
        expected = digest.removeprefix("sha256:")
        if size <= RANGE_BYTES or parallel <= 1:
            self._fetch_stream(digest, size, destination, expected, on_bytes)
        else:
            self._fetch_ranges(digest, size, destination, expected, on_bytes, parallel)

    def fetch_chunk(self, digest: str, size: int, fd: int, offset: int, *, direct_fd: int | None = None,
                    on_bytes: OnBytes | None = None) -> None:
        """Stream blob ``digest`` (``size`` bytes) into the open file ``fd`` at ``offset``, hashing it on this
        thread as it lands (many chunks at once hash on as many cores). Raises :class:`DigestMismatch`
        when the bytes are not the digest's; what was written is then the caller's to discard.

        ``direct_fd``: the same file opened with O_DIRECT (``offset`` a multiple of 4 KiB): whole 4 KiB blocks
        go to the disk from a page-aligned buffer, past the page cache, and only a chunk's unaligned tail (the
        pack's last bytes) through ``fd``."""
        response = self._blob_response(digest, {})
        hasher = hashlib.sha256()
        length = min(BUFFER_BYTES, max(size, 1))
        buffer = mmap.mmap(-1, length) if direct_fd is not None else bytearray(length)  # (mmap: page-aligned)
        view = memoryview(buffer)
        got = filled = 0  # bytes of the chunk received; of them, in the buffer and not yet written

        def flush(final: bool) -> None:
            nonlocal filled
            aligned = filled if direct_fd is None else filled - filled % _BLOCK
            at = offset + got - filled
            if aligned:
                _write_all(direct_fd if direct_fd is not None else fd, view[:aligned], at)
            if final and filled > aligned:
                _write_all(fd, view[aligned:filled], at + aligned)
                aligned = filled
            view[:filled - aligned] = view[aligned:filled]  # (an unaligned rest moves to the buffer's start)
            filled -= aligned

        try:
            while got < size:
                n = response.readinto(view[filled:min(length, filled + size - got)])
                if not n:
                    break
                hasher.update(view[filled:filled + n])
                got += n
                filled += n
                if filled == length or got == size:
                    flush(final=got == size)
                if on_bytes:
                    on_bytes(n)
            extra = response.read(1)
            response.read()
        finally:
            view.release()
            if direct_fd is not None:
                buffer.close()  # type: ignore[union-attr]
        actual = hasher.hexdigest()
        if got != size or extra or actual != digest.removeprefix("sha256:"):
            raise DigestMismatch(f"{self.registry}/{self.repository}: blob {digest} arrived as "
                                 f"{got + len(extra)}{'+' if extra else ''} bytes with SHA-256 {actual[:16]}…, "
                                 f"expected {size} bytes")

    def _fetch_stream(self, digest: str, size: int, destination: Path, expected: str, on_bytes: OnBytes | None) -> None:
        response = self._blob_response(digest, {})
        hasher = hashlib.sha256()
        buffer = bytearray(min(BUFFER_BYTES, max(size, 1)))
        view = memoryview(buffer)
        got = 0
        with open(destination, "wb") as handle:
            while True:
                n = response.readinto(view)
                if not n:
                    break
                hasher.update(view[:n])
                handle.write(view[:n])
                got += n
                if on_bytes:
                    on_bytes(n)
        self._check(digest, destination, got, size, hasher.hexdigest(), expected)

    def _check(self, digest: str, destination: Path, got: int, size: int, actual: str, expected: str) -> None:
        if got != size or actual != expected:
            destination.unlink(missing_ok=True)
            raise DigestMismatch(f"{self.registry}/{self.repository}: blob {digest} arrived as {got} bytes with "
                                 f"SHA-256 {actual[:16]}…, expected {size} bytes and {expected[:16]}…")

    def _fetch_ranges(self, digest: str, size: int, destination: Path, expected: str, on_bytes: OnBytes | None,
                      parallel: int) -> None:
        ranges = [(offset, min(RANGE_BYTES, size - offset)) for offset in range(0, size, RANGE_BYTES)]
        progress = destination.with_name(destination.name + ".ranges")
        done = _load_done_ranges(progress, digest, size)
        finished = [threading.Event() for _ in ranges]
        for index in done:
            finished[index].set()
        failures: list[BaseException] = []
        lock = threading.Lock()
        fd = os.open(destination, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            os.ftruncate(fd, size)

            def fetch(index: int) -> None:
                offset, length = ranges[index]
                try:
                    if failures:
                        return
                    response = self._blob_response(digest, {"Range": f"bytes={offset}-{offset + length - 1}"})
                    if response.status != 206:
                        raise RegistryProtocolError(f"{self.registry} does not serve byte ranges of blobs")
                    buffer = bytearray(min(BUFFER_BYTES, length))
                    view = memoryview(buffer)
                    position, left = offset, length
                    while left:
                        n = response.readinto(view[:min(left, len(buffer))])
                        if not n:
                            raise RegistryUnreachable(f"{self.registry}: blob {digest} ended early")
                        os.pwrite(fd, view[:n], position)
                        position += n
                        left -= n
                        if on_bytes:
                            on_bytes(n)
                    response.read()
                    with lock:
                        done.add(index)
                        write_atomic(progress, json.dumps({"digest": digest, "size": size, "range_bytes": RANGE_BYTES,
                                                           "done": sorted(done)}).encode())
                except BaseException as exc:  # handed to the hashing thread, which raises it
                    failures.append(exc)
                finally:
                    finished[index].set()

            if on_bytes and done:
                on_bytes(sum(ranges[i][1] for i in done))
            hasher = hashlib.sha256()
            buffer = bytearray(BUFFER_BYTES)
            view = memoryview(buffer)
            with ThreadPoolExecutor(parallel, thread_name_prefix="coldsnap-pull") as pool:
                for index in range(len(ranges)):
                    if index not in done:
                        pool.submit(fetch, index)
                for index, (offset, length) in enumerate(ranges):  # hash the finished prefix, in order
                    finished[index].wait()
                    if failures:
                        break
                    position, left = offset, length
                    while left:
                        n = os.preadv(fd, [view[:min(left, len(buffer))]], position)
                        hasher.update(view[:n])
                        position += n
                        left -= n
                if failures:
                    pool.shutdown(cancel_futures=True)
            if failures:
                raise failures[0]
            os.fsync(fd)
        finally:
            os.close(fd)
        progress.unlink(missing_ok=True)
        self._check(digest, destination, size, size, hasher.hexdigest(), expected)


_BLOCK = 4096
"""O_DIRECT's unit here: offsets, lengths and buffer addresses in whole blocks (4 KiB covers 512-byte disks)."""


def _write_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def _load_done_ranges(progress: Path, digest: str, size: int) -> set[int]:
    try:
        state = json.loads(progress.read_text())
        if state["digest"] == digest and state["size"] == size and state["range_bytes"] == RANGE_BYTES:
            return {int(i) for i in state["done"]}
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return set()


_ACCEPT = ", ".join([
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.oci.image.manifest.v1+json",
])


def client_for(reference: Reference, push: bool = False) -> RegistryClient:
    """A client of ``reference``'s repository with the credentials the container auth files hold for it."""
    plain = reference.registry in {r.strip() for r in (SETTINGS.text(PLAIN_HTTP_ENV) or "").split(",") if r.strip()}
    return RegistryClient(reference.registry, reference.repository, credentials=find_credentials(reference.registry),
                          plain_http=plain, push=push)

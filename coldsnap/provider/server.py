"""The reference host provider: the manager side of the protocol (:mod:`coldsnap.provider.messages`) for a user
with no manager of their own — ``coldsnap provider serve --hosts hosts.toml -- coldsnap restore ...``.

It serves one Unix socket (mode 0600, in a directory of its own) for one operation, one client at a time (a
second gets ``provider.busy``), checks the token in constant time, and runs each request on a thread of its own:
an ``exec`` or ``probe`` as a process group of this machine that reaches the host by its transport
(:mod:`coldsnap.provider.hosts`), a ``put`` or ``get`` as ``cat`` on the host through the same transport. When
its client goes away, or a request is cancelled or times out, the process groups it started are killed: nothing
a client asked for outlives the client's connection.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import pwd
import signal
import socket
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Literal

from coldsnap.provider.hosts import Host
from coldsnap.provider.messages import (CHUNK_BYTES, OPERATIONS, PROVIDER_FORMAT, Cancel, Done, Exec, Exited, Failure,
                                        FailureCode, FileData, Get, Hello, Output, Probe, ProtocolError, Put, Welcome,
                                        Whoami, WhoamiReply, data_of, decode_to_provider, encoded, receive_message,
                                        send_message)

__all__ = ["ProviderServer"]

HELLO_TIMEOUT_S = 10.0
"""How long a new connection may take to say hello."""
BUSY_WAIT_S = 0.5
"""How long a new connection waits for the one before it to finish closing before it is told ``provider.busy``."""


class _Failed(Exception):
    def __init__(self, code: FailureCode, message: str):
        super().__init__(message)
        self.code = code


class _Connection:
    """One client: its socket (sends serialized), its requests under way and what each started."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.send_lock = threading.Lock()
        self.processes: dict[int, subprocess.Popen[bytes]] = {}
        self.cancelled: set[int] = set()
        self.uploads: dict[int, tuple[Any, int]] = {}  # put id → (its temporary file, the next offset)
        self.lock = threading.Lock()
        self.closed = False

    def send(self, message: Any) -> None:
        with self.send_lock:
            if self.closed:
                return
            try:
                send_message(self.sock, message)
            except OSError:
                self.closed = True

    def kill_all(self) -> None:
        with self.lock:
            processes = list(self.processes.values())
        for process in processes:
            _kill_group(process)


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


class ProviderServer:
    """Serves ``path`` with ``token`` for ``hosts`` until :meth:`close`."""

    def __init__(self, path: Path, token: str, hosts: dict[str, Host], name: str = "coldsnap provider serve"):
        self.path, self.token, self.hosts, self.name = path, token, hosts, name
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            self._listener.bind(str(path))
        finally:
            os.umask(old)
        self._listener.listen(4)
        self._busy = threading.Lock()
        self._thread = threading.Thread(target=self._accept, name="coldsnap-provider", daemon=True)
        self._connections: list[_Connection] = []
        self._stopping = False

    def start(self) -> "ProviderServer":
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving: every connection closed, every process group a client started killed."""
        self._stopping = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for connection in list(self._connections):
            connection.kill_all()
            with contextlib.suppress(OSError):
                connection.sock.shutdown(socket.SHUT_RDWR)
        self.path.unlink(missing_ok=True)

    def _accept(self) -> None:
        while not self._stopping:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(sock,), name="coldsnap-provider-client", daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        # one client at a time; one that comes as the last goes (its connection still closing) is not refused
        if not self._busy.acquire(timeout=BUSY_WAIT_S):
            with contextlib.suppress(OSError):
                send_message(sock, Failure(code="provider.busy", message="the provider serves one client at a "
                                           "time, and has one"))
            sock.close()
            return
        connection = _Connection(sock)
        self._connections.append(connection)
        try:
            if self._welcomed(connection):
                self._requests(connection)
        finally:
            connection.kill_all()
            connection.closed = True
            with contextlib.suppress(OSError):
                sock.close()
            for upload, _ in connection.uploads.values():
                upload.close()
            self._connections.remove(connection)
            self._busy.release()

    def _welcomed(self, connection: _Connection) -> bool:
        connection.sock.settimeout(HELLO_TIMEOUT_S)
        try:
            body = receive_message(connection.sock)
            hello = decode_to_provider(body) if body is not None else None
        except (ProtocolError, OSError) as exc:
            connection.send(Failure(code="provider.message", message=f"the first message must be hello: {exc}"))
            return False
        if not isinstance(hello, Hello):
            connection.send(Failure(code="provider.message", message="the first message must be hello"))
            return False
        if not hmac.compare_digest(hello.token.encode(), self.token.encode()):
            connection.send(Failure(code="provider.token", message="the token does not match this operation's"))
            return False
        if hello.format != PROVIDER_FORMAT:
            connection.send(Failure(code="provider.format", message=f"this provider speaks format {PROVIDER_FORMAT}, "
                                    f"not {hello.format}"))
            return False
        connection.sock.settimeout(None)
        connection.send(Welcome(format=PROVIDER_FORMAT, provider=self.name, operations=list(OPERATIONS),
                                hosts=sorted(self.hosts)))
        return True

    def _requests(self, connection: _Connection) -> None:
        while True:
            try:
                body = receive_message(connection.sock)
                if body is None:
                    return
                request = decode_to_provider(body)
            except (ProtocolError, OSError) as exc:
                connection.send(Failure(code="provider.message", message=str(exc)))
                return
            if isinstance(request, Hello):
                connection.send(Failure(code="provider.message", message="hello twice"))
                return
            if isinstance(request, Cancel):
                self._cancel(connection, request.id)
                continue
            if isinstance(request, Put) and not request.last:  # (a file's chunks in order: taken here, in turn)
                self._answer(connection, self._put, request)
                continue
            handlers: dict[type, Callable[[_Connection, Any], None]] = {
                Exec: self._exec, Probe: self._probe, Put: self._put, Get: self._get, Whoami: self._whoami}
            handler = handlers[type(request)]
            threading.Thread(target=self._answer, args=(connection, handler, request), daemon=True,
                             name=f"coldsnap-provider-{request.type}").start()

    def _answer(self, connection: _Connection, handler: Callable[[_Connection, Any], None], request: Any) -> None:
        try:
            handler(connection, request)
        except _Failed as failed:
            connection.send(Failure(id=request.id, code=failed.code, message=str(failed)))
        except OSError as exc:
            connection.send(Failure(id=request.id, code="provider.io", message=f"{type(exc).__name__}: {exc}"))

    def _host(self, name: str) -> Host:
        host = self.hosts.get(name)
        if host is None:
            raise _Failed("provider.host", f"no host {name!r} (this provider's hosts: {', '.join(sorted(self.hosts))})")
        return host

    def _cancel(self, connection: _Connection, request_id: int) -> None:
        with connection.lock:
            connection.cancelled.add(request_id)
            process = connection.processes.get(request_id)
        if process is not None:
            _kill_group(process)

    def _start(self, connection: _Connection, request_id: int, argv: list[str], stdin: bool) -> subprocess.Popen[bytes]:
        try:
            process = subprocess.Popen(argv, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        except OSError as exc:
            raise _Failed("provider.exec", f"{argv[0]}: {exc.strerror or exc}") from None
        with connection.lock:
            connection.processes[request_id] = process
            if request_id in connection.cancelled:
                _kill_group(process)
        return process

    def _finish(self, connection: _Connection, request_id: int, process: subprocess.Popen[bytes],
                timeout_s: float | None) -> tuple[int | None, int | None]:
        """Wait for ``process`` (killing its group past ``timeout_s``): its status and signal; a cancelled or
        timed-out request fails instead."""
        try:
            returncode = process.wait(timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            _kill_group(process)
            returncode, timed_out = process.wait(), True
        _kill_group(process)  # (what it left behind in its group goes with it)
        with connection.lock:
            connection.processes.pop(request_id, None)
            cancelled = request_id in connection.cancelled
        if cancelled:
            raise _Failed("provider.cancelled", "cancelled by the client: its process group was killed")
        if timed_out:
            raise _Failed("provider.timeout", f"still running after {timeout_s} s: its process group was killed")
        return (returncode, None) if returncode >= 0 else (None, -returncode)

    def _exec(self, connection: _Connection, request: Exec) -> None:
        host = self._host(request.host)
        stdin = data_of(request.stdin) if request.stdin is not None else None
        process = self._start(connection, request.id, host.command(request.argv, request.env), stdin is not None)

        def pump(stream: Any, name: Literal["stdout", "stderr"]) -> None:
            for chunk in iter(lambda: stream.read1(CHUNK_BYTES), b""):
                connection.send(Output(id=request.id, stream=name, data=encoded(chunk)))

        pumps = [threading.Thread(target=pump, args=(process.stdout, "stdout"), daemon=True),
                 threading.Thread(target=pump, args=(process.stderr, "stderr"), daemon=True)]
        for thread in pumps:
            thread.start()
        if stdin is not None:
            assert process.stdin is not None
            with contextlib.suppress(BrokenPipeError):  # (a process that reads none of its stdin)
                process.stdin.write(stdin)
                process.stdin.close()
        status, signal_number = self._finish(connection, request.id, process, request.timeout_s)
        for thread in pumps:
            thread.join()
        connection.send(Exited(id=request.id, status=status, signal=signal_number))

    def _probe(self, connection: _Connection, request: Probe) -> None:
        host = self._host(request.host)
        process = self._start(connection, request.id, host.command(request.argv, network_only=True), False)
        outputs: dict[str, bytes] = {}

        def read(stream: Any, name: str) -> None:
            outputs[name] = stream.read(CHUNK_BYTES)  # (a probe's answer is short: more is cut)
            stream.read()

        readers = [threading.Thread(target=read, args=(process.stdout, "stdout"), daemon=True),
                   threading.Thread(target=read, args=(process.stderr, "stderr"), daemon=True)]
        for thread in readers:
            thread.start()
        status, signal_number = self._finish(connection, request.id, process, request.timeout_s)
        for thread in readers:
            thread.join()
        connection.send(Exited(id=request.id, status=status, signal=signal_number,
                               stdout=encoded(outputs.get("stdout", b"")), stderr=encoded(outputs.get("stderr", b""))))

    def _put(self, connection: _Connection, request: Put) -> None:
        host = self._host(request.host)
        data = data_of(request.data)
        if len(data) > CHUNK_BYTES:
            raise _Failed("provider.message", f"a put chunk of {len(data)} bytes (at most {CHUNK_BYTES})")
        upload, expected = connection.uploads.get(request.id, (None, 0))
        if upload is None:
            upload = tempfile.TemporaryFile(prefix="coldsnap-provider-put-")
        if request.offset != expected:
            upload.close()
            connection.uploads.pop(request.id, None)
            raise _Failed("provider.message", f"put chunk at offset {request.offset}, expected {expected}")
        upload.write(data)
        connection.uploads[request.id] = (upload, expected + len(data))
        if not request.last:
            return
        connection.uploads.pop(request.id)
        upload.seek(0)
        content = upload.read()
        upload.close()
        # written beside the target and renamed into place: a reader on the host never sees half a file
        # (named by the writing shell's pid: two puts of one path, from two hosts sharing a filesystem, do not meet)
        script = ('umask 077 && t="$1.coldsnap-put.$$" && cat > "$t" && chmod "$2" "$t" && mv -f "$t" "$1" '
                  '|| { rm -f "$t"; exit 1; }')
        argv = ["sh", "-c", script, "put", request.path, format(request.mode, "o")]
        process = self._start(connection, request.id, host.command(argv), True)
        assert process.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            process.stdin.write(content)
            process.stdin.close()
        error = process.stderr.read() if process.stderr is not None else b""
        status, _ = self._finish(connection, request.id, process, 600)
        if status != 0:
            raise _Failed("provider.io", f"{request.host}:{request.path}: {error.decode(errors='replace').strip()}")
        connection.send(Done(id=request.id, size=len(content), sha256=hashlib.sha256(content).hexdigest()))

    def _get(self, connection: _Connection, request: Get) -> None:
        host = self._host(request.host)
        process = self._start(connection, request.id, host.command(["cat", "--", request.path]), False)
        assert process.stdout is not None and process.stderr is not None
        digest, size = hashlib.sha256(), 0
        for chunk in iter(lambda: process.stdout.read(CHUNK_BYTES), b""):  # type: ignore[union-attr]
            connection.send(FileData(id=request.id, offset=size, data=encoded(chunk)))
            digest.update(chunk)
            size += len(chunk)
        error = process.stderr.read()
        status, _ = self._finish(connection, request.id, process, 600)
        if status != 0:
            raise _Failed("provider.io", f"{request.host}:{request.path}: {error.decode(errors='replace').strip()}")
        connection.send(Done(id=request.id, size=size, sha256=digest.hexdigest()))

    def _whoami(self, connection: _Connection, request: Whoami) -> None:
        # the manager's own identity: under sudo, the user who ran it (who should own what it asks for)
        uid = int(os.environ.get("SUDO_UID") or os.getuid())
        gid = int(os.environ.get("SUDO_GID") or os.getgid())
        try:
            user = pwd.getpwuid(uid).pw_name
        except KeyError:
            user = str(uid)
        connection.send(WhoamiReply(id=request.id, uid=uid, gid=gid, user=user))

"""A slow link in front of a plain-HTTP registry: the responses to chosen blob requests trickle through, so a
test sees what a restore does while a pack is still arriving from far away.

    with throttled_link("127.0.0.1:PORT", slow={digest, ...}, seconds_per_response=0.4) as address:
        ...  # pull through address: every GET of a blob in `slow` takes at least that long

A real TCP relay (a thread per direction): it reads each request line the client sends, and holds back the
answer to a slow one. Nothing is faked: the bytes are the registry's.
"""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import time
from typing import Iterator

__all__ = ["throttled_link"]

_REQUEST = re.compile(rb"(?:GET|HEAD) (\S+) HTTP/1\.[01]\r\n")


@contextlib.contextmanager
def throttled_link(upstream: str, slow: set[str], seconds_per_response: float) -> Iterator[str]:
    host, port = upstream.rsplit(":", 1)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    stopped = threading.Event()
    sockets: list[socket.socket] = [listener]

    def relay(client: socket.socket) -> None:
        server = socket.create_connection((host, int(port)))
        sockets.append(server)
        pending: list[float] = []  # for each slow request in flight: when its answer may begin

        def up() -> None:
            with contextlib.suppress(OSError):
                while data := client.recv(1 << 16):
                    for match in _REQUEST.finditer(data):
                        if any(digest in match.group(1).decode() for digest in slow):
                            pending.append(time.monotonic() + seconds_per_response)
                    server.sendall(data)
            with contextlib.suppress(OSError):
                server.shutdown(socket.SHUT_WR)

        def down() -> None:
            with contextlib.suppress(OSError):
                while data := server.recv(1 << 16):
                    if pending:  # the answer to a slow request: not before its time
                        time.sleep(max(0.0, pending.pop(0) - time.monotonic()))
                    client.sendall(data)
            with contextlib.suppress(OSError):
                client.shutdown(socket.SHUT_WR)

        threads = [threading.Thread(target=up, daemon=True), threading.Thread(target=down, daemon=True)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        client.close()
        server.close()

    def accept() -> None:
        while not stopped.is_set():
            try:
                client, _ = listener.accept()
            except OSError:
                return
            sockets.append(client)
            threading.Thread(target=relay, args=(client,), daemon=True).start()

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stopped.set()
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        acceptor.join(timeout=5)

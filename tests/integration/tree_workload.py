"""A small server process tree with what real serving trees hold, for CRIU tests.

    python -m tests.integration.tree_workload PORT STATE_DIR [--no-internal-tcp]

The parent listens on 127.0.0.1:PORT. A child keeps an established TCP connection to the parent and a
unix socketpair with it. Shared state lives in a 2 MiB /dev/shm file that is unlinked once both have it
open; a second /dev/shm file stays linked; every request is appended to STATE_DIR/server.log.
Request ``inc`` increments the counter and asks the child over both channels; the answer is
``count N tcp-ok unix-ok`` (``tcp-none`` without the internal TCP link).
"""

import mmap
import os
import socket
import sys


def child(port: int | None, unix: socket.socket) -> None:
    tcp = None
    if port is not None:
        tcp = socket.create_connection(("127.0.0.1", port))
        tcp.sendall(b"child\n")
    while True:  # answer on both channels
        if tcp is not None:
            if not tcp.recv(64):
                return
            tcp.sendall(b"tcp-ok\n")
        if not unix.recv(64):
            return
        unix.sendall(b"unix-ok\n")


def main() -> None:
    port, state_dir = int(sys.argv[1]), sys.argv[2]
    internal_tcp = "--no-internal-tcp" not in sys.argv[3:]
    shm_name = f"/dev/shm/coldsnap-tree-{os.getpid()}"
    fd = os.open(shm_name, os.O_RDWR | os.O_CREAT, 0o600)
    # 2 MiB of real bytes: past CRIU's default 1 MiB limit for unlinked ("ghost") files.
    os.write(fd, b"\0" * 8 + b"\x01" * ((2 << 20) - 8))
    # A second one stays linked, as POSIX shared memory of a running server does; a restore needs it back.
    named = os.open(f"/dev/shm/coldsnap-tree-named-{os.getpid()}", os.O_RDWR | os.O_CREAT, 0o600)
    os.write(named, b"named")
    counter = mmap.mmap(fd, 4096)
    # The child's link comes first, on a private port: the public one only listens once it is up.
    private = socket.socket()
    private.bind(("127.0.0.1", 0))
    private.listen(1)
    parent_unix, child_unix = socket.socketpair()
    if os.fork() == 0:
        parent_unix.close()
        child(private.getsockname()[1] if internal_tcp else None, child_unix)
        os._exit(0)
    child_unix.close()
    link = None
    if internal_tcp:
        link, _ = private.accept()
        assert link.recv(64) == b"child\n"
    private.close()
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(8)
    os.unlink(shm_name)  # still open and mapped: CRIU must link-remap it
    log = open(os.path.join(state_dir, "server.log"), "a", buffering=1)
    log.write("ready\n")
    while True:
        conn, _ = listener.accept()
        try:
            with conn:
                serve(conn, counter, link, parent_unix, log)
        except OSError:
            continue  # a client connection that broke (e.g. closed across a snapshot) ends alone


def serve(conn, counter, link, parent_unix, log) -> None:
    request = conn.recv(64).strip()
    if request != b"inc":
        conn.sendall(b"?\n")
        return
    value = int.from_bytes(counter[:8], "little") + 1
    counter[:8] = value.to_bytes(8, "little")
    tcp_answer = "tcp-none"
    if link is not None:
        link.sendall(b"ping")
        tcp_answer = link.recv(64).strip().decode()
    parent_unix.sendall(b"ping")
    unix_answer = parent_unix.recv(64).strip().decode()
    log.write(f"inc {value}\n")
    conn.sendall(f"count {value} {tcp_answer} {unix_answer}\n".encode())

if __name__ == "__main__":
    main()

"""A parent and a child sharing memory copy-on-write, with zero and non-zero pages, for the CRIU zero-page tests.

    python -m tests.integration.zero_pages_workload PORT

The parent maps 16 MiB of private anonymous memory and a 1 MiB heap-like one, fills them with runs of
zero pages (long and short) between written pages, then forks: the child keeps the mapping
copy-on-write and changes it — zeros over the parent's written pages, bytes over the parent's zero
pages. Both also write a file-backed private mapping (a page of zeros over the file's bytes: that one
must come back as zeros, not as the file). On 127.0.0.1:PORT the parent answers ``digest`` with
``<parent sha256> <child sha256>`` over all three mappings of each process.
"""

import hashlib
import mmap
import os
import socket
import sys
import tempfile

PAGE = 4096


def fill(memory: mmap.mmap, pattern: list[tuple[int, int, int]]) -> None:
    """(first page, pages, byte) runs: byte 0 writes zeros over the page (a written page of zeros)."""
    for first, count, value in pattern:
        memory[first * PAGE:(first + count) * PAGE] = bytes([value]) * (count * PAGE)


def digest(*memories: mmap.mmap) -> str:
    hasher = hashlib.sha256()
    for memory in memories:
        hasher.update(memory[:])
    return hasher.hexdigest()


def main() -> None:
    port = int(sys.argv[1])
    big = mmap.mmap(-1, 16 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    small = mmap.mmap(-1, 1 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    fill(big, [(0, 8, 0xA1), (8, 64, 0), (72, 1, 0xB2), (73, 1, 0), (74, 3, 0), (77, 2, 0xC3), (79, 900, 0),
               (979, 100, 0xD4), (1079, 2000, 0), (3079, 1, 0xE5)])
    fill(small, [(0, 1, 0), (1, 1, 0x11), (2, 40, 0), (42, 2, 0x22)])
    with tempfile.TemporaryFile() as backing:  # a file-backed private mapping, its bytes not zero
        backing.write(b"\x7f" * (64 * PAGE))
        backing.flush()
        filed = mmap.mmap(backing.fileno(), 64 * PAGE, flags=mmap.MAP_PRIVATE)
    fill(filed, [(0, 16, 0), (16, 1, 0x33)])  # zeros written over the file's bytes: must stay zeros
    from_parent, to_child = os.pipe()
    from_child, to_parent = os.pipe()
    if os.fork() == 0:
        fill(big, [(0, 8, 0), (8, 4, 0x5A), (979, 50, 0), (1500, 8, 0x6B)])  # zeros over the parent's bytes...
        fill(small, [(1, 1, 0), (10, 1, 0x77)])
        fill(filed, [(16, 1, 0), (20, 8, 0)])
        while os.read(from_parent, 1):
            os.write(to_parent, digest(big, small, filed).encode())
        os._exit(0)
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(4)
    while True:
        connection, _ = listener.accept()
        with connection:
            if connection.recv(64).strip() == b"digest":
                os.write(to_child, b"d")
                child = os.read(from_child, 64).decode()
                connection.sendall(f"{digest(big, small, filed)} {child}\n".encode())


if __name__ == "__main__":
    main()

"""A process with one big private anonymous mapping (no madvise), for the CRIU huge-page fill test.

    python -m tests.integration.thp_fill_workload PORT

It maps 32 MiB, writes every 4 KiB page (its index, then bytes that are not zero) and answers
``digest`` on 127.0.0.1:PORT with ``<sha256 of the mapping> <its start address in hex>``.
"""

import ctypes
import hashlib
import mmap
import socket
import sys

PAGE = 4096
SIZE = 32 << 20


def main() -> None:
    port = int(sys.argv[1])
    memory = mmap.mmap(-1, SIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for page in range(SIZE // PAGE):
        memory[page * PAGE:(page + 1) * PAGE] = page.to_bytes(4, "little") + bytes([page % 251 + 1]) * (PAGE - 4)
    start = ctypes.addressof(ctypes.c_char.from_buffer(memory))
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(4)
    while True:
        connection, _ = listener.accept()
        with connection:
            if connection.recv(64).strip() == b"digest":
                connection.sendall(f"{hashlib.sha256(memory[:]).hexdigest()} {start:x}\n".encode())


if __name__ == "__main__":
    main()

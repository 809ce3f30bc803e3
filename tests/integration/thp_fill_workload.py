"""A process with one big private anonymous mapping (no madvise), for the CRIU huge-page fill test.

    python -m tests.integration.thp_fill_workload PORT [MIB [THREADS]]

It starts THREADS idle threads (default none), maps MIB MiB (default 32), writes every 4 KiB page of the first half (its index, then bytes that are
not zero) and zeros over the second half (pages a compacted image leaves out), and answers on
127.0.0.1:PORT: ``digest`` with ``<sha256 of the mapping> <its start address in hex>``, ``read`` with the
seconds one pass reading a byte of every page takes (``benchmarks/criu_fill.py`` times it after a
restore: the first reads of pages the image left out are what the CUDA driver's restore does).
"""

import ctypes
import hashlib
import mmap
import socket
import sys
import threading
import time

PAGE = 4096


def main() -> None:
    port = int(sys.argv[1])
    size = (int(sys.argv[2]) if len(sys.argv) > 2 else 32) << 20
    idle = threading.Event()
    for _ in range(int(sys.argv[3]) if len(sys.argv) > 3 else 0):
        threading.Thread(target=idle.wait, daemon=True).start()
    memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for page in range(size // PAGE // 2):
        memory[page * PAGE:(page + 1) * PAGE] = page.to_bytes(4, "little") + bytes([page % 251 + 1]) * (PAGE - 4)
    memory[size // 2:] = bytes(size // 2)
    start = ctypes.addressof(ctypes.c_char.from_buffer(memory))
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(4)
    while True:
        connection, _ = listener.accept()
        with connection:
            command = connection.recv(64).strip()
            if command == b"digest":
                connection.sendall(f"{hashlib.sha256(memory[:]).hexdigest()} {start:x}\n".encode())
            elif command == b"read":
                started = time.perf_counter()
                sum(memory[offset] for offset in range(0, size, PAGE))
                connection.sendall(f"{time.perf_counter() - started:.6f}\n".encode())


if __name__ == "__main__":
    main()

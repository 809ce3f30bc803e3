#!/usr/bin/env python3
"""Fill-benchmark workload for CRIU restore.

bench.py OUTDIR [SIZE_GIB] [--fork]

mmaps SIZE_GIB (default 4) GiB of private anonymous memory (no madvise),
writes non-zero data to every page (a repeating 1 MiB random block, with the
first 8 bytes of each 4 KiB page replaced by the page index so misplaced pages
are detected), writes OUTDIR/sum.start with its sha256 and OUTDIR/ready, then
sleeps. On SIGUSR1 it recomputes the checksum and writes OUTDIR/sum.<n>
(<n> = 1, 2, ... per signal) with "sha256 addr len". Nothing is written to
stdout/stderr after start (their files must keep their size for restore).

--fork: fork a child after the fill, so that the big VMA is COW-shared in
the dumped tree and CRIU has to premap it (criu/mem.c path).
"""
import hashlib
import mmap
import os
import signal
import struct
import sys
import time

outdir = sys.argv[1]
size = int(float(sys.argv[2]) * (1 << 30)) if len(sys.argv) > 2 and not sys.argv[2].startswith("-") else 4 << 30
do_fork = "--fork" in sys.argv
PAGE = 4096
BLK = 1 << 20

m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
              prot=mmap.PROT_READ | mmap.PROT_WRITE)
block = bytearray(os.urandom(BLK))
for i in range(len(block)):  # no zero bytes at all
    if block[i] == 0:
        block[i] = 0xA5
for off in range(0, size, BLK):
    m[off:off + BLK] = block
pack = struct.Struct("<Q").pack
for pg in range(size // PAGE):
    m[pg * PAGE:pg * PAGE + 8] = pack(pg + 1)

# address of the mapping, for the smaps lookup
import ctypes
addr = ctypes.addressof(ctypes.c_char.from_buffer(m))


def digest():
    h = hashlib.sha256()
    mv = memoryview(m)
    for off in range(0, size, 64 << 20):
        h.update(mv[off:off + (64 << 20)])
    mv.release()
    return h.hexdigest()


def write(name, text):
    tmp = os.path.join(outdir, name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
    os.rename(tmp, os.path.join(outdir, name))


nsig = [0]


def on_usr1(signum, frame):
    nsig[0] += 1
    t = time.monotonic()
    d = digest()
    write("sum.%d" % nsig[0], "%s %#x %d %.2f\n" % (d, addr, size, time.monotonic() - t))


signal.signal(signal.SIGUSR1, on_usr1)
write("sum.start", "%s %#x %d\n" % (digest(), addr, size))
if do_fork:
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
        while True:
            signal.pause()
    write("child", "%d\n" % pid)
write("ready", "%d\n" % os.getpid())
while True:
    signal.pause()

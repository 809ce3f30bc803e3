#!/usr/bin/env python3
"""CRIU-independent fill microbenchmark: mmap N GiB private anon, optionally
madvise(MADV_HUGEPAGE), then os.preadv() the pages image into it (1 MiB iovecs,
like the restorer's preadv into the VMA), in the order MODES (default 4k,thp), ROUNDS times.
Usage: fillmicro.py IMAGE ROUNDS [MODES e.g. thp,thp,4k]
Prints fill seconds and AnonHugePages of this process after each fill."""
import mmap, os, sys, time
img, rounds = sys.argv[1], int(sys.argv[2])
modes = sys.argv[3].split(",") if len(sys.argv) > 3 else ["4k", "thp"]
size = os.path.getsize(img) // (1 << 21) * (1 << 21)
fd = os.open(img, os.O_RDONLY)
def ahp():
    for l in open("/proc/self/smaps_rollup"):
        if l.startswith("AnonHugePages:"):
            return int(l.split()[1])
for r in range(rounds):
    for mode in modes:
        m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if mode == "thp":
            m.madvise(mmap.MADV_HUGEPAGE)
        mv = memoryview(m)
        t = time.perf_counter()
        off = 0
        step = 64 << 20
        while off < size:
            iovs = [mv[o:o + (1 << 20)] for o in range(off, min(off + step, size), 1 << 20)]
            n = os.preadv(fd, iovs, off)
            off += n
        dt = time.perf_counter() - t
        print("round %d %-3s fill %.3f s  %.2f GiB/s  AnonHugePages %d kB" % (r + 1, mode, dt, size / dt / (1 << 30), ahp()), flush=True)
        for v in iovs: v.release()
        mv.release(); m.close()

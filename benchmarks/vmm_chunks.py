"""What a restore's KV-cache map costs by chunk size: coldsnap's region mapped, zeroed and unmapped on one GPU.

    python -m benchmarks.vmm_chunks [--gib 48] [--chunks-mib 64,256,1024,2048] [--repeat 3] [--out vmm.json]

A restore maps the KV cache's region again (``cuMemCreate`` + ``cuMemMap`` per chunk, one ``cuMemSetAccess``)
and zeroes it before the engine resumes; vLLM 8B on an H100 spent 64–67 ms mapping its KV cache in the
resume (64 MiB chunks, the region default). This measures the same calls (:func:`coldsnap.memory.reserve`,
``map``, ``zero``, ``unmap``) over ``--gib`` GiB for each chunk size, each size in a process of its own (a fresh
CUDA context), ``--repeat`` rounds each: the map (wall clock of the call), the zero until the GPU is done
(``cuMemsetD8`` returns before the memset ends; the engine's first kernel waits for it), the unmap. Writes
``--out`` (JSON) and prints a table. Needs a GPU, torch and coldsnap's native extension.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

GiB = 1 << 30
MiB = 1 << 20


def child(gib: int, chunk_mib: int, repeat: int) -> dict:
    import torch

    from coldsnap.memory import reserve

    torch.cuda.init()
    region = reserve("kv_cache", gib * GiB, backend="cuda", chunk_bytes=chunk_mib * MiB)
    rounds = []
    for _ in range(repeat):
        started = time.perf_counter()
        region.map()  # the first round maps the whole region, later ones what the last unmap left (a restore's remap)
        mapped = time.perf_counter()
        region.zero()
        zero_returned = time.perf_counter()
        torch.cuda.synchronize()
        zeroed = time.perf_counter()
        region.unmap()
        unmapped = time.perf_counter()
        rounds.append({"map_s": mapped - started, "zero_call_s": zero_returned - mapped, "zero_s": zeroed - mapped,
                       "unmap_s": unmapped - zeroed})
    return {"chunk_mib": chunk_mib, "chunks": region.size // (chunk_mib * MiB), "rounds": rounds}


def measure(gib: int, chunk_sizes: list[int], repeat: int) -> dict:
    results = []
    for chunk_mib in chunk_sizes:
        done = subprocess.run([sys.executable, "-m", "benchmarks.vmm_chunks", "--child", str(chunk_mib), "--gib", str(gib),
                               "--repeat", str(repeat)], capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise SystemExit(f"chunks of {chunk_mib} MiB: exit {done.returncode}: {done.stderr[-1500:]}")
        result = json.loads(done.stdout.strip().splitlines()[-1])
        for key in ("map_s", "zero_s", "unmap_s"):
            result[f"median_{key}"] = round(statistics.median(r[key] for r in result["rounds"]), 4)
        results.append(result)
    return {"benchmark": "vmm_chunks", "gib": gib, "repeat": repeat, "results": results}


def table(measured: dict) -> str:
    lines = [f"KV region of {measured['gib']} GiB, medians of {measured['repeat']} rounds (seconds)",
             "| chunk | chunks | map | zero (until done) | unmap |", "|---:|---:|---:|---:|---:|"]
    for r in measured["results"]:
        lines.append(f"| {r['chunk_mib']} MiB | {r['chunks']} | {r['median_map_s']:.4f} | {r['median_zero_s']:.4f} | "
                     f"{r['median_unmap_s']:.4f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=int, default=48, help="region size in GiB (default 48: an 8B's KV cache on an H100)")
    parser.add_argument("--chunks-mib", default="64,256,1024,2048", help="chunk sizes to compare, MiB, comma-separated")
    parser.add_argument("--repeat", type=int, default=3, help="map/zero/unmap rounds per chunk size (default 3)")
    parser.add_argument("--out", help="write the JSON result here")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)  # one chunk size, in its own process
    args = parser.parse_args()
    if args.gib < 1 or args.repeat < 1:
        parser.error("--gib and --repeat must be at least 1")
    if args.child is not None:
        print(json.dumps(child(args.gib, args.child, args.repeat)))
        return 0
    try:
        chunk_sizes = [int(c) for c in args.chunks_mib.split(",") if c.strip()]
    except ValueError:
        parser.error(f"--chunks-mib takes whole MiB numbers, comma-separated, not {args.chunks_mib!r}")
    if not chunk_sizes or any(c < 2 or c % 2 for c in chunk_sizes):
        parser.error("each chunk size must be a positive multiple of 2 MiB (the GPU's mapping granularity)")
    measured = measure(args.gib, chunk_sizes, args.repeat)
    if args.out:
        with open(args.out, "w") as out:
            json.dump(measured, out, indent=2)
            out.write("\n")
    print(table(measured))
    return 0


if __name__ == "__main__":
    sys.exit(main())

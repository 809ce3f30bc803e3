"""Hydration benchmark: the same bytes to the GPU by coldsnap and by the usual loaders, side by side.

    python -m benchmarks.hydrate --sizes 4,16 --threads 1,2,4,8,16 --dir /tmp/bench --out hydrate.json

For each size it fills a CUDA stable region with random bf16 tensors of 1 GiB, writes them as a
safetensors file and as a coldsnap native pack (from the live region), then measures, page cache warm
and (after dropping the caches) cold:

- coldsnap: native pack -> CUDA region, for every thread count; cold also the raw O_DIRECT read of
  the same file by the same engine (the disk's ceiling);
- ``safetensors.torch.load_file(device="cuda")``, a plain Python read + copy loop, and fastsafetensors
  / instanttensor when they import;
- host target: pack -> host region vs a plain memcpy of the same bytes from the page cache.

Every GPU result is checked against a checksum of the original bytes. JSON goes to --out, a table to
stdout. Needs a GPU, torch and safetensors; dropping caches needs root (else cold rows are skipped).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import struct
import sys
import time
from pathlib import Path

import numpy as np
import torch

from coldsnap.contracts.layout import MemoryLayout
from coldsnap.hydrate import DEFAULT_CHUNK_BYTES, DEFAULT_RING_BYTES, DEFAULT_THREADS, CopyItem, hydrate_items, hydrate_pack, prefetch_file, read_file, write_pack_from_regions
from coldsnap.memory import reserve
from coldsnap.payload import NativePack, verify_file

GiB = 1 << 30
TENSOR_SHAPE = (16384, 32768)  # bf16: 1 GiB per tensor


def log(message: str) -> None:
    print(f"[hydrate-bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def drop_caches() -> bool:
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as handle:
            handle.write("3\n")
        return True
    except OSError:
        return False


def checksum(t: torch.Tensor) -> int:
    """Order-sensitive enough to catch misplaced or missing chunks, cheap on the GPU."""
    words = t.reshape(-1).view(torch.int32).to(torch.int64)
    weights = torch.arange(1, 1 + min(words.numel(), 1 << 20), device=words.device, dtype=torch.int64)
    head = int((words[: weights.numel()] * weights).sum())
    return head ^ int(words.sum()) ^ (int(words[-4096:].sum()) << 1)


def same(loaded: dict[str, torch.Tensor], views: dict[str, torch.Tensor], names: list[str]) -> bool:
    # Compare bits: random bf16 patterns include NaNs, which never equal themselves.
    return all(torch.equal(loaded[n].view(torch.int16), views[n].view(torch.int16)) for n in names)


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    header, offset = {}, 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {"dtype": "BF16", "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(encoded)) + encoded)
        for t in tensors.values():
            handle.write(t.view(torch.uint8).cpu().numpy().tobytes())


def python_loop(path: Path, tensors: dict[str, torch.Tensor], data_start: int, offsets: dict[str, int]) -> None:
    """The plain way: read into one pinned buffer, copy to the GPU, repeat."""
    chunk = 64 << 20
    pinned = torch.empty(chunk, dtype=torch.uint8, pin_memory=True)
    view = memoryview(pinned.numpy())
    with open(path, "rb", buffering=0) as handle:
        for name, dst in tensors.items():
            flat = dst.view(torch.uint8).reshape(-1)
            handle.seek(data_start + offsets[name])
            done = 0
            while done < flat.numel():
                n = handle.readinto(view[: min(chunk, flat.numel() - done)])
                flat[done:done + n].copy_(pinned[:n])
                done += n
    torch.cuda.synchronize()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="4,16", help="GiB per run, comma-separated (default 4,16)")
    parser.add_argument("--threads", default="1,2,4,8,12,16", help="coldsnap thread counts (default 1,2,4,8,12,16)")
    parser.add_argument("--dir", default="/tmp/coldsnap-bench", help="scratch directory for the files")
    parser.add_argument("--out", default="hydrate.json", help="JSON results path")
    parser.add_argument("--comparators-max-gib", type=int, default=16, help="largest size that also runs the other loaders")
    parser.add_argument("--no-cold", action="store_true", help="skip the cold (caches dropped) runs")
    parser.add_argument("--no-verify", action="store_true", help="skip timing the pack verification")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    thread_counts = [int(t) for t in args.threads.split(",")]
    scratch = Path(args.dir)
    scratch.mkdir(parents=True, exist_ok=True)

    optional = {}
    for module in ("fastsafetensors", "instanttensor", "safetensors.torch"):
        try:
            optional[module] = __import__(module, fromlist=["_"])
        except Exception as exc:  # report why a comparator is absent rather than fail
            optional[module] = f"{type(exc).__name__}: {exc}"
    props = torch.cuda.get_device_properties(0)
    results: list[dict] = []
    meta = {
        "gpu": props.name,
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "comparators": {k: (v if isinstance(v, str) else getattr(v, "__version__", "imported")) for k, v in optional.items()},
        "ring_bytes_limit": DEFAULT_RING_BYTES,
        "default_threads": DEFAULT_THREADS,
        "default_chunk_bytes": DEFAULT_CHUNK_BYTES,
    }

    def record(size: int, method: str, cache: str, seconds: float, nbytes: int, ok: bool | None, **extra) -> None:
        row = {"size_gib": size, "method": method, "cache": cache, "seconds": round(seconds, 4),
               "gb_per_s": round(nbytes / seconds / 1e9, 2) if seconds > 0 else None, "ok": ok, **extra}
        results.append(row)
        log(f"{size:>3} GiB {cache:<5} {method:<34} {row['gb_per_s']!s:>7} GB/s  ok={ok} {extra or ''}")

    max_size = max(sizes)
    weights = reserve("weights", max_size * GiB, backend="cuda", chunk_bytes=512 << 20)
    host = reserve("runtime", max_size * GiB, backend="host", chunk_bytes=512 << 20)

    for size in sizes:
        nbytes = size * GiB
        weights.unmap()
        weights.map(nbytes)
        names = [f"layers.{i}.weight" for i in range(size)]
        layout = MemoryLayout.model_validate({"format": 1, "regions": [{"tag": "weights", "size_bytes": weights.size, "tensors": [
            {"name": n, "dtype": "bfloat16", "shape": list(TENSOR_SHAPE), "offset": i * GiB, "length": GiB} for i, n in enumerate(names)
        ]}]})
        views = {n: weights.tensor(torch.bfloat16, TENSOR_SHAPE, offset=i * GiB) for i, n in enumerate(names)}
        generator = torch.Generator(device="cuda").manual_seed(size)
        for t in views.values():
            t.view(torch.int16).random_(-32768, 32767, generator=generator)
        flat = weights.tensor(torch.uint8, (nbytes,))
        expected = checksum(flat)

        def region_ok() -> bool:
            torch.cuda.synchronize()
            return checksum(flat) == expected

        log(f"size {size} GiB: writing the native pack from the live region")
        t0 = time.perf_counter()
        written = write_pack_from_regions(scratch, layout, {"weights": weights})
        record(size, "pack write (GPU -> file, hashed)", "-", time.perf_counter() - t0, nbytes, None)
        if not args.no_verify:
            verify_twice(size, written.path, record)

        comparators = size <= args.comparators_max_gib

        st_path = scratch / f"bench-{size}.safetensors"
        if comparators:
            log(f"size {size} GiB: writing safetensors")
            write_safetensors(st_path, views)
            with open(st_path, "rb") as handle:
                (header_length,) = struct.unpack("<Q", handle.read(8))
                st_header = json.loads(handle.read(header_length))
            st_offsets = {n: st_header[n]["data_offsets"][0] for n in names}
            st_start = 8 + header_length

        def coldsnap_run(cache: str, threads: int, direct: bool | None = None) -> None:
            weights.zero(0, nbytes)
            stats = hydrate_pack(written.path, {"weights": weights}, layout_digest=layout.digest(), threads=threads, direct=direct)
            mode = {None: "auto", True: "O_DIRECT", False: "buffered"}[direct]
            record(size, f"coldsnap pack -> gpu ({threads} thr, {mode})", cache, stats.seconds, stats.bytes, region_ok(),
                   threads=threads, pinned_bytes=stats.pinned_bytes, direct=stats.direct, cached=round(stats.cached_fraction, 3))

        def loader_runs(cache: str) -> None:
            if not comparators:
                return
            def load_all(method: str, load) -> None:
                """Time one loader that returns every tensor of the file on the GPU."""
                if cache == "cold":
                    drop_caches()
                try:
                    t0 = time.perf_counter()
                    got = load()
                    torch.cuda.synchronize()
                    seconds = time.perf_counter() - t0
                    ok = same(got, views, names)
                    del got
                    record(size, method, cache, seconds, nbytes, ok)
                except Exception as exc:  # a comparator's failure is a result, not the end of the run
                    results.append({"size_gib": size, "method": method, "cache": cache, "error": repr(exc)})
                    log(f"{method} failed: {exc!r}")

            def fastsafetensors_load(module):
                with module.fastsafe_open(filenames=[str(st_path)], nogds=True, device="cuda:0") as f:
                    return {k: f.get_tensor(k) for k in f.keys()}

            def instanttensor_load(module):
                with module.safe_open(str(st_path), framework="pt", device=0) as f:
                    return dict(f.tensors())

            loaders = {
                "safetensors.load_file(cuda)": ("safetensors.torch", lambda m: m.load_file(str(st_path), device="cuda:0")),
                "fastsafetensors (nogds)": ("fastsafetensors", fastsafetensors_load),
                "instanttensor": ("instanttensor", instanttensor_load),
            }
            for method, (module_name, load) in loaders.items():
                module = optional[module_name]
                if not isinstance(module, str):
                    load_all(method, lambda: load(module))
            if cache == "cold":
                drop_caches()
            weights.zero(0, nbytes)
            t0 = time.perf_counter()
            python_loop(st_path, views, st_start, st_offsets)
            record(size, "python read + copy loop", cache, time.perf_counter() - t0, nbytes, region_ok())
            torch.cuda.empty_cache()

        # ---- warm: everything in the page cache
        prefetch_file(written.path, threads=16)
        read_file(written.path, threads=16, direct=False)
        if comparators:
            read_file(st_path, threads=16, direct=False)
        for threads in thread_counts:
            coldsnap_run("warm", threads)
        for threads in (DEFAULT_THREADS, max(thread_counts)):
            raw = read_file(written.path, threads=threads, direct=False)
            record(size, f"page cache read only ({threads} thr)", "warm", raw.seconds, raw.bytes, None, threads=threads)
        loader_runs("warm")

        # host target vs a plain memcpy of the same (cached) bytes
        host.unmap()
        host.map(nbytes)
        host.zero(0, nbytes)  # fault the pages in, as the memcpy destination below is
        pack = NativePack.open(written.path)
        data_offset = pack.extents[0].file_offset
        for threads in (1, DEFAULT_THREADS, max(thread_counts)):
            # One extent of the whole data area: the host target reads straight into place.
            stats = hydrate_items(written.path, [CopyItem(data_offset, nbytes, host.base)], [host], threads=threads)
            ok = bytes(host.host_view(0, 4096)) == pack.read_extent(pack.extents[0])[:4096]
            record(size, f"coldsnap pack -> host ({threads} thr)", "warm", stats.seconds, stats.bytes, ok, threads=threads)
        destination = np.empty(nbytes, dtype=np.uint8)
        destination.fill(0)
        with open(written.path, "rb") as handle:
            mapped = mmap.mmap(handle.fileno(), 0, prot=mmap.PROT_READ)
            t0 = time.perf_counter()
            np.copyto(destination, np.frombuffer(mapped, dtype=np.uint8, count=nbytes, offset=data_offset))
            record(size, "memcpy from page cache (numpy, 1 thr)", "warm", time.perf_counter() - t0, nbytes, True)
            del mapped
        del destination

        # ---- cold: caches dropped before each run
        if not args.no_cold:
            if not drop_caches():
                log("cannot drop caches (not root?): cold runs skipped")
            else:
                raw = read_file(written.path, threads=max(thread_counts), direct=True)
                record(size, f"raw read O_DIRECT ({raw.threads} thr)", "cold", raw.seconds, raw.bytes, None, threads=raw.threads)
                drop_caches()
                buffered = read_file(written.path, threads=max(thread_counts), direct=False)
                record(size, f"raw read buffered ({buffered.threads} thr)", "cold", buffered.seconds, buffered.bytes, None)
                for threads, direct in ((DEFAULT_THREADS, None), (max(thread_counts), None), (DEFAULT_THREADS, False)):
                    drop_caches()
                    coldsnap_run("cold", threads, direct)
                loader_runs("cold")

        written.path.unlink()
        (scratch / ".coldsnap-validation.json").unlink(missing_ok=True)
        if comparators:
            st_path.unlink()

    document = {"benchmark": "hydrate", "meta": meta, "results": results, "goals": goals(results)}
    Path(args.out).write_text(json.dumps(document, indent=2) + "\n")
    print(table(results))
    print()
    for line in document["goals"]:
        print(line)
    return 0


def verify_twice(size: int, path: Path, record) -> None:
    """The first verification hashes in full; the second trusts the stat-bound record."""
    for _ in range(2):
        t0 = time.perf_counter()
        result = verify_file(path)
        record(size, f"pack verify ({result.method})", "-", time.perf_counter() - t0, result.size_bytes, True)


def best(results: list[dict], size: int, cache: str, prefix: str) -> dict | None:
    rows = [r for r in results if r.get("size_gib") == size and r.get("cache") == cache
            and r.get("method", "").startswith(prefix) and r.get("gb_per_s")]
    return max(rows, key=lambda r: r["gb_per_s"]) if rows else None


def goals(results: list[dict]) -> list[str]:
    lines = []
    for size in sorted({r["size_gib"] for r in results}):
        warm = best(results, size, "warm", "coldsnap pack -> gpu")
        if warm:
            lines.append(f"{size} GiB page cache -> GPU: {warm['gb_per_s']} GB/s ({warm['method']}); goal >= 50 GB/s at 16 GB")
        cold, raw = best(results, size, "cold", "coldsnap pack -> gpu"), best(results, size, "cold", "raw read O_DIRECT")
        if cold and raw:
            lines.append(f"{size} GiB cold file -> GPU: {cold['gb_per_s']} GB/s = {cold['gb_per_s'] / raw['gb_per_s']:.2f} x raw O_DIRECT "
                         f"{raw['gb_per_s']} GB/s; goal >= 0.95 x")
        host, memcpy = best(results, size, "warm", "coldsnap pack -> host"), best(results, size, "warm", "memcpy")
        if host and memcpy:
            lines.append(f"{size} GiB host target: {host['gb_per_s']} GB/s = {host['gb_per_s'] / memcpy['gb_per_s']:.2f} x memcpy "
                         f"{memcpy['gb_per_s']} GB/s; goal >= 0.8 x")
        pinned = [r.get("pinned_bytes", 0) for r in results if r.get("size_gib") == size and "pinned_bytes" in r]
        if pinned:
            lines.append(f"{size} GiB pinned ring: at most {max(pinned) / GiB:.2f} GiB (bounds: COLDSNAP_HYDRATE_RING_BYTES, 96 MiB, for cached reads; COLDSNAP_HYDRATE_DIRECT_RING_BYTES, 512 MiB, for O_DIRECT)")
    return lines


def table(results: list[dict]) -> str:
    header = f"{'GiB':>4}  {'cache':<5}  {'method':<40}  {'GB/s':>7}  {'s':>8}  ok"
    lines = [header, "-" * len(header)]
    for r in results:
        if "error" in r:
            lines.append(f"{r['size_gib']:>4}  {r['cache']:<5}  {r['method']:<40}  error: {r['error'][:60]}")
            continue
        lines.append(f"{r['size_gib']:>4}  {r['cache']:<5}  {r['method']:<40}  {r['gb_per_s']!s:>7}  {r['seconds']:>8.3f}  {r['ok']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

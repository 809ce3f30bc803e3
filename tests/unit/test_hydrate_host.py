"""The hydration engine with a host target, on real files: exact bytes, bounds, failures."""

import json
import os
import struct

import numpy as np
import pytest

from coldsnap.contracts.layout import MemoryLayout
from coldsnap.hydrate import CopyItem, HydrationError, hydrate_items, prefetch_file, read_file, replay_safetensors
from coldsnap.memory import reserve


pytestmark = pytest.mark.usefixtures("fresh_regions")


@pytest.fixture
def source(tmp_path):
    data = os.urandom((9 << 20) + 123)
    path = tmp_path / "source.bin"
    path.write_bytes(data)
    return path, data


@pytest.mark.parametrize("threads, direct", [(1, False), (4, True), (16, True)])
def test_bit_exact_with_odd_extents(source, threads, direct):
    path, data = source
    region = reserve("weights", 16 << 20, backend="host")
    region.map()
    items = [
        CopyItem(0, 4 << 20, region.base),  # aligned
        CopyItem(4097, 1, region.base + (5 << 20)),  # one byte, unaligned
        CopyItem(123, (3 << 20) + 7, region.base + (6 << 20) + 13),  # unaligned both sides
        CopyItem(len(data) - 4000, 4000, region.base + (12 << 20)),  # the file's tail
    ]
    seen = []
    stats = hydrate_items(path, items, [region], threads=threads, chunk_bytes=1 << 20, direct=direct,
                          progress=lambda done, total: seen.append((done, total)))
    assert stats.bytes == sum(i.length for i in items)
    for item in items:
        assert bytes(region.host_view(item.dst - region.base, item.length)) == data[item.file_offset:item.file_offset + item.length]
    assert seen[-1] == (stats.bytes, stats.bytes)


def test_never_writes_outside_its_region(source):
    path, _ = source
    region = reserve("weights", 4 << 20, backend="host", chunk_bytes=2 << 20)
    region.map(2 << 20)  # only the first half is mapped; the second half is the guard
    guard = reserve("kv_cache", 2 << 20, backend="host")
    guard.map()
    guard.host_view()[:] = b"\x5a" * guard.mapped_bytes
    for bad in (
        CopyItem(0, 4096, region.base + (2 << 20)),  # mapped? no: past mapped bytes
        CopyItem(0, (2 << 20) + 1, region.base),  # spills by one byte
        CopyItem(0, 16, guard.base),  # another region that is not a target
        CopyItem(0, 16, region.base - 16),
    ):
        with pytest.raises(HydrationError, match="outside every mapped region"):
            hydrate_items(path, [CopyItem(0, 4096, region.base), bad], [region])
    assert bytes(region.host_view(0, 4096)) == b"\0" * 4096  # the good item was not written either
    assert bytes(guard.host_view()) == b"\x5a" * guard.mapped_bytes


def test_truncated_file_is_refused_before_reading(source):
    path, data = source
    region = reserve("weights", 16 << 20, backend="host")
    region.map()
    with pytest.raises(HydrationError, match="past the end"):
        hydrate_items(path, [CopyItem(len(data) - 10, 11, region.base)], [region])
    with pytest.raises(HydrationError, match="cannot open"):
        hydrate_items(path.parent / "missing", [CopyItem(0, 1, region.base)], [region])


def test_progress_callback_can_cancel_and_its_exception_surfaces(source):
    path, data = source
    region = reserve("weights", 16 << 20, backend="host")
    region.map()
    items = [CopyItem(0, len(data), region.base)]

    class Boom(Exception):
        pass

    def explode(done, total):
        raise Boom("stop here")

    with pytest.raises(Boom, match="stop here"):
        hydrate_items(path, items, [region], threads=1, chunk_bytes=256 << 10, progress=explode)
    with pytest.raises(HydrationError, match="cancelled"):
        hydrate_items(path, items, [region], threads=1, chunk_bytes=256 << 10, progress=lambda d, t: False)


def test_read_and_prefetch_modes(source):
    path, data = source
    assert read_file(path, threads=3, chunk_bytes=1 << 20).bytes == len(data)
    assert prefetch_file(path, threads=2, chunk_bytes=1 << 20).bytes == len(data)


def _write_safetensors(path, tensors: dict):
    header, blobs, offset = {}, [], 0
    codes = {"float32": "F32", "int16": "I16", "uint8": "U8"}
    for name, array in tensors.items():
        raw = array.tobytes()
        header[name] = {"dtype": codes[str(array.dtype)], "shape": list(array.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + b"".join(blobs))


def test_recovery_replay_places_tensors_at_captured_offsets(tmp_path):
    rng = np.random.default_rng(7)
    a = rng.standard_normal((64, 33)).astype(np.float32)
    b = rng.integers(-100, 100, (1000,)).astype(np.int16)
    c = rng.integers(0, 255, (7,)).astype(np.uint8)
    _write_safetensors(tmp_path / "model-1.safetensors", {"a": a, "c": c})
    _write_safetensors(tmp_path / "model-2.safetensors", {"b": b})
    layout = MemoryLayout.model_validate({"format": 1, "regions": [{"tag": "weights", "size_bytes": 1 << 20, "tensors": [
        {"name": "a", "dtype": "float32", "shape": [64, 33], "offset": 0, "length": a.nbytes},
        {"name": "b", "dtype": "int16", "shape": [1000], "offset": 16384, "length": b.nbytes},
        {"name": "c", "dtype": "uint8", "shape": [7], "offset": 20001, "length": 7},
    ]}]})
    region = reserve("weights", 1 << 20, backend="host")
    region.map()
    files = sorted(tmp_path.glob("*.safetensors"))
    stats = replay_safetensors(files, layout, {"weights": region}, threads=2)
    assert sum(s.bytes for s in stats) == a.nbytes + b.nbytes + 7
    assert bytes(region.host_view(0, a.nbytes)) == a.tobytes()
    assert bytes(region.host_view(16384, b.nbytes)) == b.tobytes()
    assert bytes(region.host_view(20001, 7)) == c.tobytes()

    wrong = MemoryLayout.model_validate({"format": 1, "regions": [{"tag": "weights", "size_bytes": 1 << 20, "tensors": [
        {"name": "a", "dtype": "bfloat16", "shape": [64, 66], "offset": 0, "length": a.nbytes},
        {"name": "missing", "dtype": "uint8", "shape": [1], "offset": 900000, "length": 1},
    ]}]})
    region.zero()
    with pytest.raises(HydrationError) as caught:
        replay_safetensors(files, wrong, {"weights": region})
    assert "captured bfloat16[64, 66]" in str(caught.value) and "'missing' is in no safetensors file" in str(caught.value)
    assert bytes(region.host_view(0, 64)) == b"\0" * 64  # refused as a whole: nothing written


EXIT_DURING_HYDRATION = """
import os, sys, threading
from coldsnap.hydrate import CopyItem, hydrate_items
from coldsnap.memory import reserve

path = sys.argv[1]
size = os.stat(path).st_size
region = reserve("weights", size, backend="host")
region.map(size)
polled = threading.Event()

def keep_going(done, total):
    polled.set()
    return True

def hydrate():
    hydrate_items(path, [CopyItem(0, size, region.base)], [region], threads=1, chunk_bytes=256 << 10, direct=False,
                  progress=keep_going)

threading.Thread(target=hydrate, daemon=True).start()
assert polled.wait(30), "the hydration never reported progress"
print("exiting while hydrating", flush=True)
sys.exit(0)
"""


def test_the_process_exits_cleanly_while_a_daemon_thread_hydrates(tmp_path):
    """A launcher that fails and exits while its staging thread still hydrates (a daemon thread whose
    progress callback then wants the GIL) exits normally; it used to die in std::terminate (exit 134)."""
    import subprocess
    import sys

    source = tmp_path / "sparse.bin"
    with open(source, "wb") as f:
        f.truncate(1 << 30)  # sparse: read at memory speed, ~0.2 s or more on one thread
    script = tmp_path / "exit_during_hydration.py"
    script.write_text(EXIT_DURING_HYDRATION)
    result = subprocess.run([sys.executable, str(script), str(source)], capture_output=True, text=True, timeout=120)
    assert "exiting while hydrating" in result.stdout, result.stderr
    assert result.returncode == 0 and "terminate called" not in result.stderr, result.stderr

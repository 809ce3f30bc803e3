"""Native pack ⇄ host regions: written from live regions, hydrated back bit-exact, covered by the residual."""

import os

import pytest

from coldsnap.contracts.layout import MemoryLayout
from coldsnap.hydrate import (HydrationError, hydrate_pack, hydrate_pack_as_it_arrives, payload_extents,
                              write_pack_from_regions)
from coldsnap.memory import reserve
from coldsnap.payload import NativePack, PackKind, check_cover, plan_residual, verify_file


pytestmark = pytest.mark.usefixtures("fresh_regions")


def _layout(size: int) -> MemoryLayout:
    return MemoryLayout.model_validate({"format": 1, "regions": [
        {"tag": "weights", "size_bytes": size, "tensors": [
            {"name": "embed", "dtype": "bfloat16", "shape": [1000, 513], "offset": 0, "length": 1026000},
            {"name": "norm", "dtype": "float32", "shape": [513], "offset": 1026000, "length": 2052},
            {"name": "head", "dtype": "bfloat16", "shape": [77, 1000], "offset": 2 << 20, "length": 154000},
        ]},
        {"tag": "kv_cache", "size_bytes": 1 << 20, "tensors": []},
    ]})


def test_pack_from_live_host_region_round_trips(tmp_path):
    weights = reserve("weights", 4 << 20, backend="host")
    weights.map()
    live = os.urandom(weights.mapped_bytes)
    weights.host_view()[:] = live
    layout = _layout(weights.size)
    assert [(e.region_offset, e.length, len(e.tensors)) for e in payload_extents(layout)] == [
        (0, 1028052, 2),  # embed + norm touch: one extent
        (2 << 20, 154000, 1),
    ]
    written = write_pack_from_regions(tmp_path, layout, {"weights": weights})
    assert written.path.name == f"{written.sha256}.pack"
    # the writer's own single-pass hash is recorded: the first restore does not hash it again
    assert verify_file(written.path).method == "record"
    os.utime(written.path, ns=(1, 1))  # ...until its identity changes
    assert verify_file(written.path).method == "full-hash"

    weights.unmap()  # what prepare does before the snapshot
    weights.map()
    assert bytes(weights.host_view(0, 16)) == b"\0" * 16
    stats = hydrate_pack(written.path, {"weights": weights}, layout_digest=layout.digest(), threads=4)
    assert stats.bytes == 1028052 + 154000
    assert bytes(weights.host_view(0, 1028052)) == live[:1028052]
    assert bytes(weights.host_view(2 << 20, 154000)) == live[2 << 20:(2 << 20) + 154000]
    assert bytes(weights.host_view(1028052, 4096)) == b"\0" * 4096  # not in the pack: untouched


def test_pack_plus_residual_cover_the_allocations(tmp_path):
    weights = reserve("weights", 4 << 20, backend="host")
    weights.allocate(3 << 20)  # what the engine's allocator holds
    weights.host_view()[:] = os.urandom(weights.mapped_bytes)
    layout = _layout(weights.size)
    payload = write_pack_from_regions(tmp_path, layout, {"weights": weights})
    allocations = {"weights": weights.allocations()}
    residual_plan = plan_residual(allocations, payload.table)
    residual = write_pack_from_regions(tmp_path, layout, {"weights": weights}, kind=PackKind.RESIDUAL, extents=residual_plan)
    check_cover(allocations, payload.table, residual.table)
    assert NativePack.open(residual.path).kind is PackKind.RESIDUAL


def test_hydrate_pack_refuses_wrong_layout_and_small_regions(tmp_path):
    weights = reserve("weights", 4 << 20, backend="host")
    weights.map()
    layout = _layout(weights.size)
    written = write_pack_from_regions(tmp_path, layout, {"weights": weights})
    with pytest.raises(HydrationError, match="layout"):
        hydrate_pack(written.path, {"weights": weights}, layout_digest="0" * 64)
    weights.unmap()
    weights.map(2 << 20)  # the head tensor at 2 MiB no longer fits
    with pytest.raises(HydrationError):
        hydrate_pack(written.path, {"weights": weights})
    with pytest.raises(HydrationError, match="not mapped"):
        hydrate_pack(written.path, {})


def test_a_pack_still_arriving_is_hydrated_chunk_by_chunk_and_never_before_its_chunk(tmp_path):
    """``restore oci://`` on a host with no copy: the copy follows the pull; a byte is read only after its chunk
    arrived (verified), and a pull that fails stops the copy with its reason."""
    import threading
    import time

    from coldsnap.payload.arrival import PackArrival

    weights = reserve("weights", 4 << 20, backend="host")
    weights.map()
    live = os.urandom(weights.mapped_bytes)
    weights.host_view()[:] = live
    layout = _layout(weights.size)
    written = write_pack_from_regions(tmp_path, layout, {"weights": weights})
    size = written.path.stat().st_size
    whole = written.path.read_bytes()
    arriving = tmp_path / "arriving.pack"
    arriving.write_bytes(b"\0" * size)  # preallocated, as a pull leaves it: nothing in place yet
    chunk = 256 << 10
    arrival = PackArrival(arriving, list(range(0, size, chunk)), size)
    weights.unmap()
    weights.map()

    def pull() -> None:  # each chunk written, then marked: what the pull does once its digest matched
        with open(arriving, "r+b") as handle:
            for index, offset in enumerate(arrival.offsets):
                handle.seek(offset)
                handle.write(whole[offset:offset + chunk])
                handle.flush()
                arrival.arrived(index)
                time.sleep(0.01)

    puller = threading.Thread(target=pull)
    puller.start()
    stats = hydrate_pack_as_it_arrives(arriving, {"weights": weights}, arrival, layout_digest=layout.digest(), threads=2)
    puller.join()
    assert stats.bytes == 1028052 + 154000 and not stats.direct
    assert bytes(weights.host_view(0, 1028052)) == live[:1028052]
    assert bytes(weights.host_view(2 << 20, 154000)) == live[2 << 20:(2 << 20) + 154000]

    failing = PackArrival(written.path, list(range(0, size, chunk)), size)
    failing.arrived(0)
    failing.fail("the registry went away (test)")
    with pytest.raises(HydrationError, match="the registry went away"):
        hydrate_pack_as_it_arrives(written.path, {"weights": weights}, failing, layout_digest=layout.digest())

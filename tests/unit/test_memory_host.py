"""Host-backend stable regions: a real mmap reservation, not a mock (CPU engines use it)."""

import ctypes
import mmap

import pytest

from coldsnap.memory import RegionError, StableRegion, release_all, reserve
from coldsnap.native import native


pytestmark = pytest.mark.usefixtures("fresh_regions")


def _resident_pages(region: StableRegion) -> int:
    """Pages of the region the kernel holds (mincore): what CRIU would have to dump."""
    libc = ctypes.CDLL(None, use_errno=True)
    pages = region.size // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * pages)()
    rc = libc.mincore(ctypes.c_void_p(region.base), ctypes.c_size_t(region.size), vec)
    if rc != 0:  # ENOMEM: parts of the range are PROT_NONE-unmapped; count mapped chunks only
        return -1
    return sum(b & 1 for b in vec)


def test_map_unmap_keeps_the_address_and_drops_the_bytes():
    region = reserve("weights", 6 << 20, backend="host", chunk_bytes=2 << 20)
    base = region.base
    assert region.mapped_bytes == 0 and region.size == 6 << 20
    region.map()
    assert region.mapped_bytes == 6 << 20
    view = region.host_view()
    view[:] = b"\xab" * len(view)
    assert _resident_pages(region) == region.size // mmap.PAGESIZE
    region.unmap()
    assert region.base == base and region.mapped_bytes == 0
    with pytest.raises(RegionError):
        region.host_view(0, 1)
    region.map()
    assert region.base == base
    assert _resident_pages(region) == 0  # mapped but never touched: nothing for CRIU to dump
    assert bytes(region.host_view(0, 4096)) == b"\0" * 4096  # fresh pages, old bytes gone


def test_zero_and_fixed_address():
    first = reserve("kv_cache", 4 << 20, backend="host")
    first.map()
    first.host_view()[:] = b"\x01" * first.mapped_bytes
    first.zero(4096, 8192)
    data = bytes(first.host_view())
    assert data[:4096] == b"\x01" * 4096 and data[4096:12288] == b"\0" * 8192 and data[12288:13000] == b"\x01" * 712
    address = first.base
    release_all()
    again = reserve("kv_cache", 4 << 20, backend="host", fixed_address=address)
    assert again.base == address
    with pytest.raises(RegionError, match="taken"):
        reserve("runtime", 4 << 20, backend="host", fixed_address=address)


def test_sub_allocation_maps_on_demand_and_coalesces():
    region = reserve("runtime", 8 << 20, backend="host", chunk_bytes=2 << 20)
    a = region.allocate(1 << 20)
    b = region.allocate(3 << 20)
    assert (a, b) == (0, 1 << 20) and region.mapped_bytes == 4 << 20
    region.deallocate(a)
    region.deallocate(b)
    assert region.allocations() == []
    assert region.allocate(8 << 20) == 0  # the holes merged back into one
    with pytest.raises(RegionError, match="exhausted"):
        region.allocate(1)


def test_reserve_once_and_bad_input():
    region = reserve("weights", 4 << 20, backend="host")
    assert reserve("weights", 2 << 20, backend="host") is region
    with pytest.raises(RegionError, match="already reserved"):
        reserve("weights", 64 << 20, backend="host")
    with pytest.raises(RegionError, match="unknown region tag"):
        reserve("scratch", 1 << 20, backend="host")
    with pytest.raises(RegionError, match="backend"):
        reserve("runtime", 1 << 20, backend="tpu")
    with pytest.raises(RegionError, match="zero range"):
        region.map(1 << 20)
        region.zero(0, region.mapped_bytes + 1)


def test_cuda_backend_without_driver_is_a_clear_error():
    if native().cuda_probe()["available"]:
        pytest.skip("this host has a GPU")
    with pytest.raises(RegionError, match="libcuda.so.1"):
        reserve("weights", 1 << 20, backend="cuda")


def test_tensor_view_of_host_region():
    torch = pytest.importorskip("torch")
    region = reserve("weights", 2 << 20, backend="host")
    region.map()
    t = region.tensor(torch.float32, (4, 4), offset=4096)
    t.fill_(2.5)
    assert bytes(region.host_view(4096, 4)) == bytes(torch.tensor([2.5]).numpy().tobytes())


def test_host_zero_drops_whole_pages_and_writes_the_edges():
    region = reserve("kv_cache", 8 << 20, backend="host")
    region.map()
    view = region.host_view()
    view[:] = b"\xab" * len(view)
    region.zero(4095, (5 << 20) + 2)  # unaligned at both ends
    assert bytes(view[4094:4095]) == b"\xab" and bytes(view[4095 + (5 << 20) + 2:][:1]) == b"\xab"
    assert bytes(view[4095:4095 + (5 << 20) + 2]) == b"\0" * ((5 << 20) + 2)


def test_a_region_dropped_without_release_leaves_the_allocator_hooks():
    # ~StableRegion unregisters itself: the hooks' table must never hold a pointer to a destroyed region.
    C = native()
    handle = C.StableRegion("weights", "host", 0, 2 << 20, 2 << 20, 0)
    region_id = C.register_region(handle)
    C.set_active_region(region_id)
    assert C.active_region() == region_id
    C.set_active_region(-1)
    del handle  # dropped without release(): the destructor releases and unregisters
    import gc

    gc.collect()
    with pytest.raises(C.RegionError, match="no registered region"):
        C.set_active_region(region_id)

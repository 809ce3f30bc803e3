"""ModelMemory over real host regions: release writes payload + residual and unmaps, restore brings the
exact bytes back at the same addresses and zeroes the discarded tags, bad requests are refused."""

import hashlib
import os

import pytest

from coldsnap.agent.memory import ModelMemory, ModelMemoryError
from coldsnap.contracts.layout import MemoryLayout
from coldsnap.memory import reserve
from coldsnap.payload import NativePack, PackKind, check_cover

pytestmark = pytest.mark.usefixtures("fresh_regions")

MiB = 1 << 20
EMBED = (0, MiB)  # (offset, length) of the layout's tensors in the weights region
HEAD = (2 * MiB, 256 << 10)
ALLOCATED = 3 * MiB  # what the engine's allocator holds: the tensors plus bytes no tensor names


def _layout(weights_size: int, kv_size: int) -> MemoryLayout:
    return MemoryLayout.model_validate({"format": 1, "regions": [
        {"tag": "weights", "size_bytes": weights_size, "tensors": [
            {"name": "embed", "dtype": "bfloat16", "shape": [512, 1024], "offset": EMBED[0], "length": EMBED[1]},
            {"name": "head", "dtype": "float32", "shape": [256, 256], "offset": HEAD[0], "length": HEAD[1]},
        ]},
        {"tag": "kv_cache", "size_bytes": kv_size, "tensors": []},
    ]})


def live_memory() -> tuple[ModelMemory, bytes]:
    """A served model's memory: weights allocated and written (random bytes), a dirty KV cache."""
    weights = reserve("weights", 4 * MiB, backend="host", chunk_bytes=2 * MiB)
    assert weights.allocate(ALLOCATED) == 0
    live = os.urandom(weights.mapped_bytes)
    weights.host_view()[:] = live
    kv = reserve("kv_cache", 2 * MiB, backend="host", chunk_bytes=2 * MiB)
    kv.map()
    kv.host_view()[:] = b"\xab" * kv.mapped_bytes
    return ModelMemory(_layout(weights.size, kv.size), {"weights": weights, "kv_cache": kv}), live


def _sha256(path: str) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _released(memory: ModelMemory, pack_dir) -> dict:
    return memory.release({}, pack_dir)


def test_release_writes_payload_and_residual_and_unmaps_every_region(tmp_path):
    memory, _ = live_memory()
    bases = {tag: r.base for tag, r in memory.regions.items()}
    assert memory.allocations() == {"weights": [(0, ALLOCATED)]}  # the KV cache preserves nothing
    seen_mapped = []
    seconds: dict[str, float] = {}

    def before_unmap() -> None:
        seen_mapped.append({t: r.mapped_bytes for t, r in memory.regions.items()})

    packs = memory.release(seconds, tmp_path / "packs", before_unmap=before_unmap)

    assert set(packs) == {"payload", "residual"}
    for kind, ref in packs.items():
        assert os.path.dirname(ref["path"]) == str(tmp_path / "packs")
        assert ref["sha256"] == _sha256(ref["path"]) and ref["size_bytes"] == os.path.getsize(ref["path"])
    payload, residual = NativePack.open(packs["payload"]["path"]), NativePack.open(packs["residual"]["path"])
    assert (payload.kind, residual.kind) == (PackKind.PAYLOAD, PackKind.RESIDUAL)
    assert payload.layout_digest == residual.layout_digest == memory.layout.digest()
    assert [(e.region, e.region_offset, e.length) for e in payload.extents] == [("weights", *EMBED), ("weights", *HEAD)]
    assert [(e.region, e.region_offset, e.length) for e in residual.extents] == [
        ("weights", EMBED[1], HEAD[0] - EMBED[1]), ("weights", sum(HEAD), ALLOCATED - sum(HEAD))]
    check_cover({"weights": [(0, ALLOCATED)]}, payload.table, residual.table)  # every allocated byte exactly once

    assert seen_mapped == [{"weights": 4 * MiB, "kv_cache": 2 * MiB}]  # the hook ran before the unmap
    for tag, region in memory.regions.items():
        assert region.mapped_bytes == 0 and region.base == bases[tag]
    assert (memory.regions["weights"].high_water, memory.regions["kv_cache"].high_water) == (4 * MiB, 2 * MiB)
    assert {"payload_write", "residual_write", "unmap_weights", "unmap_kv_cache"} <= set(seconds)


def test_release_without_a_pack_dir_writes_nothing(tmp_path):
    memory, _ = live_memory()
    assert memory.release({}, None) == {}
    assert all(r.mapped_bytes == 0 for r in memory.regions.values())


def test_restore_from_payload_and_residual_is_bit_exact_at_the_same_addresses(tmp_path):
    memory, live = live_memory()
    bases = {tag: r.base for tag, r in memory.regions.items()}
    packs = _released(memory, tmp_path)
    seconds: dict[str, float] = {}
    hydrated = memory.restore(seconds, layout_digest=memory.layout.digest(), payload=packs["payload"]["path"],
                              residual=packs["residual"]["path"])

    assert hydrated["source"] == "native" and hydrated["bytes"] == EMBED[1] + HEAD[1]
    weights, kv = memory.regions["weights"], memory.regions["kv_cache"]
    assert {t: r.base for t, r in memory.regions.items()} == bases
    assert (weights.mapped_bytes, kv.mapped_bytes) == (4 * MiB, 2 * MiB)  # what was mapped before the release
    assert bytes(weights.host_view(0, ALLOCATED)) == live[:ALLOCATED]
    assert bytes(weights.host_view(ALLOCATED)) == bytes(MiB)  # never allocated: not preserved
    assert bytes(kv.host_view()) == bytes(2 * MiB)  # the KV cache is discarded, not restored
    assert {"map_weights", "map_kv_cache", "hydrate", "residual", "zero_kv_cache"} <= set(seconds)


def test_the_payload_alone_restores_only_the_layouts_tensors(tmp_path):
    memory, live = live_memory()
    packs = _released(memory, tmp_path)
    memory.restore({}, payload=packs["payload"]["path"])  # the layout digest defaults to this process's
    weights = memory.regions["weights"]
    for offset, length in (EMBED, HEAD):
        assert bytes(weights.host_view(offset, length)) == live[offset:offset + length]
    # what only the residual holds is lost without it
    assert bytes(weights.host_view(EMBED[1], HEAD[0] - EMBED[1])) == bytes(HEAD[0] - EMBED[1])


def test_restore_zeroes_a_discarded_region_that_is_still_mapped(tmp_path):
    memory, live = live_memory()
    packs = _released(memory, tmp_path)
    memory.restore({}, payload=packs["payload"]["path"], residual=packs["residual"]["path"], tags=["weights"])
    weights, kv = memory.regions["weights"], memory.regions["kv_cache"]
    assert kv.mapped_bytes == 0 and bytes(weights.host_view(0, ALLOCATED)) == live[:ALLOCATED]
    kv.map()
    kv.host_view()[:] = b"\xcd" * kv.mapped_bytes  # serving dirtied it again
    seconds: dict[str, float] = {}
    assert memory.restore(seconds, tags=["kv_cache"]) == {"source": "none", "bytes": 0}
    assert bytes(kv.host_view()) == bytes(2 * MiB) and "zero_kv_cache" in seconds
    assert bytes(weights.host_view(0, ALLOCATED)) == live[:ALLOCATED]  # not selected: untouched


def test_a_wrong_layout_digest_is_refused_before_anything_is_mapped(tmp_path):
    memory, _ = live_memory()
    packs = _released(memory, tmp_path)
    with pytest.raises(ModelMemoryError, match=r"layout digest 000000000000… is not this process's"):
        memory.restore({}, layout_digest="0" * 64, payload=packs["payload"]["path"])
    assert all(r.mapped_bytes == 0 for r in memory.regions.values())


def test_adopted_chunks_that_do_not_match_the_descriptors_are_refused(tmp_path):
    memory, _ = live_memory()
    packs = _released(memory, tmp_path)
    fd = os.open(os.devnull, os.O_RDONLY)  # refused before any descriptor is used
    try:
        for adopted, fds, message in (
            ({"weights": 2}, (), "do not match the 0 descriptors sent"),
            ({"weights": 1}, (fd, fd), "do not match the 2 descriptors sent"),
            ({"runtime": 1}, (fd,), "or this process's regions"),  # no such region here
            ({"kv_cache": 1}, (fd,), "or this process's regions"),  # a region this restore did not select
            ({"weights": 1}, (fd,), f"1 adopted chunks do not cover the {4 * MiB} bytes mapped before the release"),
        ):
            tags = ["weights"] if "kv_cache" in adopted else None
            with pytest.raises(ModelMemoryError, match=message):
                memory.restore({}, payload=packs["payload"]["path"], adopted=adopted, fds=fds, tags=tags)
            assert all(r.mapped_bytes == 0 for r in memory.regions.values()), adopted
    finally:
        os.close(fd)


def test_restore_without_a_source_is_refused_with_a_clear_message(tmp_path):
    memory, _ = live_memory()
    memory.release({}, None)
    with pytest.raises(ModelMemoryError, match="^restoring the weights needs a payload pack or safetensors files$"):
        memory.restore({}, layout_digest=memory.layout.digest())
    with pytest.raises(ModelMemoryError, match="needs a payload pack or safetensors files"):
        memory.restore({}, payload="", safetensors=[])  # empty is no source either
    assert all(region.mapped_bytes == 0 for region in memory.regions.values())  # refused before mapping anything

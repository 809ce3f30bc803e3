"""The residual rule: payload + residual cover the preserved allocations exactly once."""

import hashlib
import random

import pytest

from coldsnap.payload.errors import CoverError
from coldsnap.payload.pack import PackExtent, PackKind, PackTable, align_up
from coldsnap.payload.pack_reader import NativePack
from coldsnap.payload.pack_writer import PlannedExtent, write_pack
from coldsnap.payload.residual import check_cover, plan_residual, residual_extents

LAYOUT = hashlib.sha256(b"layout").hexdigest()


def table(*runs: tuple[str, int, int]) -> PackTable:
    """A pack table holding ``runs`` of ``(tag, region_offset, length)`` in order."""
    extents, cursor = [], 8192
    for tag, offset, length in runs:
        extents.append(PackExtent(region=tag, region_offset=offset, length=length, file_offset=cursor))
        cursor = align_up(cursor + length)
    return PackTable(format=1, extents=extents)


def residual_table(residual: dict) -> PackTable:
    return table(*((tag, offset, length) for tag, ranges in residual.items() for offset, length in ranges))


@pytest.mark.parametrize(
    "allocations, payload, expected",
    [
        # holes between allocations stay holes; the payload's gaps become residual
        ({"weights": [(0, 100), (200, 100)]}, [("weights", 0, 50), ("weights", 220, 30)],
         {"weights": [(50, 50), (200, 20), (250, 50)]}),
        # adjacent allocations merge into one residual run
        ({"weights": [(100, 100), (0, 100)]}, [("weights", 0, 100)], {"weights": [(100, 100)]}),
        # a payload extent spanning two adjacent allocations is inside them
        ({"weights": [(0, 100), (100, 100)]}, [("weights", 50, 100)], {"weights": [(0, 50), (150, 50)]}),
        # adjacent payload extents leave nothing between them
        ({"weights": [(0, 300)]}, [("weights", 0, 100), ("weights", 100, 100)], {"weights": [(200, 100)]}),
        # a region without payload is residual whole; a fully covered one disappears
        ({"weights": [(0, 64)], "runtime": [(4096, 10), (0, 8)]}, [("weights", 0, 64)],
         {"runtime": [(0, 8), (4096, 10)]}),
        # zero-length allocations are nothing
        ({"weights": [(0, 0), (10, 5)], "kv_cache": [(0, 0)]}, [], {"weights": [(10, 5)]}),
        ({}, [], {}),
    ],
)
def test_residual_extents_and_cover(allocations, payload, expected):
    payload_table = table(*payload)
    residual = residual_extents(allocations, payload_table)
    assert residual == expected
    assert [(p.region, p.region_offset, p.length, tuple(p.tensors)) for p in plan_residual(allocations, payload_table)] == [
        (tag, offset, length, ()) for tag, ranges in expected.items() for offset, length in ranges
    ]
    check_cover(allocations, payload_table, residual_table(residual))


@pytest.mark.parametrize(
    "allocations, payload, problem",
    [
        ({"weights": [(0, 100), (150, 100)]}, [("weights", 90, 20)], r"payload bytes weights \[100, 110\) lie outside"),
        ({"weights": [(0, 100)]}, [("weights", 50, 51)], r"\[100, 101\) lie outside"),
        ({"weights": [(0, 100)]}, [("runtime", 0, 1)], r"payload bytes runtime \[0, 1\) lie outside"),
        ({"weights": [(0, 100), (50, 100)]}, [], r"allocation weights \[0, 100\) and \[50, 150\) overlap"),
        ({"weights": [(-1, 10)]}, [], "negative"),
    ],
)
def test_payload_outside_allocations_or_bad_allocations(allocations, payload, problem):
    with pytest.raises(CoverError, match=problem):
        residual_extents(allocations, table(*payload))


ALLOCATIONS = {"weights": [(0, 1000), (1000, 500), (4096, 4096)], "runtime": [(0, 64), (128, 64)]}
PAYLOAD = table(("weights", 100, 1200), ("weights", 4096, 10))  # spans the first two (adjacent) allocations


def test_cover_accepts_the_computed_residual():
    residual = residual_extents(ALLOCATIONS, PAYLOAD)
    assert residual == {"weights": [(0, 100), (1300, 200), (4106, 4086)], "runtime": [(0, 64), (128, 64)]}
    check_cover(ALLOCATIONS, PAYLOAD, residual_table(residual))
    # split differently (adjacent pieces) the residual covers the same bytes: still exact
    check_cover(ALLOCATIONS, PAYLOAD, table(("weights", 0, 50), ("weights", 50, 50), ("weights", 1300, 200),
                                            ("weights", 4106, 4086), ("runtime", 128, 64), ("runtime", 0, 64)))


@pytest.mark.parametrize(
    "residual, problem",
    [
        # one byte short at the end of a run
        ([("weights", 0, 100), ("weights", 1300, 199), ("weights", 4106, 4086), ("runtime", 0, 64), ("runtime", 128, 64)],
         r"allocated bytes weights \[1499, 1500\) are in neither"),
        # a whole allocation forgotten
        ([("weights", 0, 100), ("weights", 1300, 200), ("weights", 4106, 4086), ("runtime", 0, 64)],
         r"allocated bytes runtime \[128, 192\) are in neither"),
        # one byte into the payload
        ([("weights", 0, 101), ("weights", 1300, 200), ("weights", 4106, 4086), ("runtime", 0, 64), ("runtime", 128, 64)],
         r"bytes weights \[100, 101\) are in both"),
        # bridging the hole between two allocations
        ([("weights", 0, 100), ("weights", 1300, 200), ("weights", 4106, 4086), ("runtime", 0, 192)],
         r"residual bytes runtime \[64, 128\) lie outside"),
        # a region that has no allocations at all
        ([("weights", 0, 100), ("weights", 1300, 200), ("weights", 4106, 4086), ("runtime", 0, 64), ("runtime", 128, 64),
          ("kv_cache", 0, 1)], r"residual bytes kv_cache \[0, 1\) lie outside"),
    ],
)
def test_cover_rejects_gaps_overlaps_and_strays(residual, problem):
    with pytest.raises(CoverError, match=problem):
        check_cover(ALLOCATIONS, PAYLOAD, table(*residual))


def test_cover_rejects_a_payload_outside_the_allocations():
    payload = table(("weights", 1400, 200))  # ends 100 bytes past the allocation at [1000, 1500)
    with pytest.raises(CoverError, match=r"payload bytes weights \[1500, 1600\) lie outside"):
        check_cover(ALLOCATIONS, payload, table(("weights", 0, 1400)))


def bitmap(size: int, runs) -> list[bool]:
    bits = [False] * size
    for offset, length in runs:
        for i in range(offset, offset + length):
            assert not bits[i], "runs overlap"
            bits[i] = True
    return bits


def test_randomized_cover_against_a_byte_map():
    rng = random.Random(2024)
    for _ in range(200):
        size = 512
        allocations, payload = {}, []
        for tag in ("weights", "runtime"):
            cuts = sorted(rng.sample(range(size), rng.randrange(0, 12) * 2))
            allocations[tag] = [(a, b - a) for a, b in zip(cuts[::2], cuts[1::2])]
            for offset, length in allocations[tag]:
                if rng.random() < 0.7:  # payload: a random sub-run, sometimes the whole allocation
                    start = rng.randrange(offset, offset + length)
                    payload.append((tag, start, rng.randrange(1, offset + length - start + 1)))
        rng.shuffle(allocations["weights"])
        payload.sort(key=lambda run: (run[0], run[1]))
        residual = residual_extents(allocations, table(*payload))
        check_cover(allocations, table(*payload), residual_table(residual))
        for tag in allocations:
            allocated = bitmap(size, allocations[tag])
            in_payload = bitmap(size, [(o, n) for t, o, n in payload if t == tag])
            in_residual = bitmap(size, residual.get(tag, []))
            assert [p or r for p, r in zip(in_payload, in_residual)] == allocated
            assert not any(p and r for p, r in zip(in_payload, in_residual))
            starts = [o for o, _ in residual.get(tag, [])]
            ends = [o + n for o, n in residual.get(tag, [])]
            assert starts == sorted(starts) and not set(starts) & set(ends)  # sorted, adjacent runs merged


def test_payload_and_residual_packs_hydrate_every_allocated_byte(tmp_path):
    """Write both packs from host regions, replay their hydration plans into blank regions: every
    allocated byte comes back, and nothing outside the allocations is touched."""
    rng = random.Random(5)
    source = {"weights": bytearray(rng.randbytes(64 * 1024)), "runtime": bytearray(rng.randbytes(8192))}
    allocations = {"weights": [(0, 30000), (30000, 5000), (40960, 20000)], "runtime": [(0, 100), (4096, 4000)]}
    payload_plan = [PlannedExtent("weights", 10, 29990), PlannedExtent("weights", 40960, 19999)]

    def read_source(tag, offset, dest):
        dest[:] = source[tag][offset : offset + len(dest)]

    payload = write_pack(tmp_path, PackKind.PAYLOAD, LAYOUT, payload_plan, read_source, chunk_bytes=4096)
    residual = write_pack(tmp_path, PackKind.RESIDUAL, LAYOUT, plan_residual(allocations, payload.table), read_source)
    check_cover(allocations, payload.table, residual.table)

    sizes = {tag: len(data) for tag, data in source.items()}
    bases = {"weights": 1 << 40, "runtime": 2 << 40}
    target = {tag: bytearray(b"\xee" * size) for tag, size in sizes.items()}
    for written in (payload, residual):
        pack = NativePack.open(written.path)
        data = written.path.read_bytes()
        for file_offset, length, address in pack.hydration_plan(bases, sizes):
            tag = next(t for t, base in bases.items() if base <= address < base + sizes[t])
            start = address - bases[tag]
            target[tag][start : start + length] = data[file_offset : file_offset + length]
    for tag, ranges in allocations.items():
        allocated = bitmap(sizes[tag], ranges)
        for i, inside in enumerate(allocated):
            assert target[tag][i] == (source[tag][i] if inside else 0xEE), (tag, i)

"""The native pack: round trip through the writer and reader, and every kind of bad file."""

import hashlib
import json
import os
import random
import struct

import pytest

from coldsnap.contracts.canonical import canonical_json
from coldsnap.contracts.layout import TensorExtent
from coldsnap.payload.errors import (
    ExtentOutOfRegion,
    PackBadMagic,
    PackCorrupt,
    PackError,
    PackLayoutMismatch,
    PackPlanInvalid,
    PackTruncated,
    PackUnreadable,
    PackUnsupportedVersion,
    RegionTooSmall,
)
from coldsnap.payload.pack import (HEADER_BYTES, PACK_MAGIC, SUPPORTED_PACK_VERSIONS, PackHeader, PackKind, align_up,
                                   digest_from_file_name, pack_file_name)
from coldsnap.payload.pack_reader import HydrationCopy, NativePack
from coldsnap.payload.pack_writer import PlannedExtent, write_pack

LAYOUT = hashlib.sha256(b"layout").hexdigest()
MIB = 1024 * 1024
HEADER_FIELDS = struct.Struct("<8sIIQQ32sQQ32s")


def host_regions(seed: int = 7) -> dict[str, bytearray]:
    rng = random.Random(seed)
    return {
        "weights": bytearray(rng.randbytes(4 * MIB)),
        "runtime": bytearray(rng.randbytes(64 * 1024)),
        "cudagraph": bytearray(rng.randbytes(16 * 1024)),
    }


def host_source(regions: dict[str, bytearray], reads: list | None = None):
    """read_source over host memory: the same contract a GPU source implements through a pinned buffer."""

    def read_source(tag: str, offset: int, dest: memoryview) -> None:
        if reads is not None:
            reads.append((tag, offset, len(dest)))
        dest[:] = regions[tag][offset : offset + len(dest)]

    return read_source


def tensor(name: str, offset: int, length: int) -> TensorExtent:
    return TensorExtent(name=name, dtype="bfloat16", shape=[length // 2], offset=offset, length=length)


# Odd lengths on purpose: 1 byte, one short of a block, one past it, and a multi-chunk run.
PLAN = [
    PlannedExtent("weights", 0, 1),
    PlannedExtent("weights", 4096, 4095, [tensor("model.embed.weight", 4096, 4094)]),
    PlannedExtent("runtime", 7, 4097),
    PlannedExtent("weights", 9000, 3 * MIB + 5,
                  [tensor("model.layers.0.w", 9000, 2 * MIB), tensor("model.layers.0.b", 9000 + 2 * MIB, 6)]),
    PlannedExtent("cudagraph", 100, 1),
]


@pytest.fixture
def written(tmp_path):
    regions = host_regions()
    reports = []
    pack = write_pack(tmp_path, PackKind.PAYLOAD, LAYOUT, PLAN, host_source(regions), chunk_bytes=64 * 1024,
                      progress=lambda done, total: reports.append((done, total)))
    return pack, regions, reports


def test_round_trip_bytes_names_and_alignment(written, tmp_path):
    pack, regions, reports = written
    data = pack.path.read_bytes()
    assert pack.path.name == pack_file_name(hashlib.sha256(data).hexdigest(), PackKind.PAYLOAD) == f"{pack.sha256}.pack"
    assert digest_from_file_name(pack.path.name) == pack.sha256 and pack.size_bytes == len(data)
    assert os.listdir(tmp_path) == [pack.path.name]  # no temporary file left behind
    assert os.stat(pack.path).st_mode & 0o777 == 0o644

    opened = NativePack.open(pack.path)
    assert opened.kind is PackKind.PAYLOAD and opened.layout_digest == LAYOUT and opened.table == pack.table
    assert [(e.region, e.region_offset, e.length, e.tensors) for e in opened.extents] == [
        (p.region, p.region_offset, p.length, list(p.tensors)) for p in PLAN
    ]
    cursor = opened.header.data_offset
    for extent in opened.extents:
        assert extent.file_offset % 4096 == 0 and extent.file_offset == cursor
        assert opened.read_extent(extent) == regions[extent.region][extent.region_offset : extent.region_end]
        assert not any(data[extent.file_end : align_up(extent.file_end)])  # zero padding
        cursor = align_up(extent.file_end)
    assert cursor == len(data) and len(data) % 4096 == 0

    total = sum(p.length for p in PLAN)
    assert reports[-1] == (total, total) and all(a[0] < b[0] for a, b in zip(reports, reports[1:]))
    assert len(reports) > 3 * MIB // (64 * 1024)  # chunked, not one read per extent


def test_header_fields_on_disk(written):
    pack, _, _ = written
    data = pack.path.read_bytes()
    fields = HEADER_FIELDS.unpack_from(data)
    magic, version, kind, table_offset, table_length, table_sha, data_offset, data_length, layout = fields
    assert (magic, version, kind, table_offset) == (b"CSNPACK\0", 1, 1, 4096)
    table = data[table_offset : table_offset + table_length]
    assert table_sha == hashlib.sha256(table).digest()
    assert table == canonical_json(json.loads(table)) == pack.table.canonical_json()
    assert data_offset == align_up(4096 + table_length) and data_offset + data_length == len(data)
    assert layout == bytes.fromhex(LAYOUT)
    assert not any(data[HEADER_FIELDS.size : 4096]) and not any(data[4096 + table_length : data_offset])


def test_residual_kind_empty_pack_and_reuse(tmp_path):
    regions = host_regions()
    empty = write_pack(tmp_path, PackKind.RESIDUAL, LAYOUT, [], host_source(regions))
    assert empty.path.name.endswith(".residual") and empty.size_bytes == 8192
    opened = NativePack.open(empty.path)
    assert opened.kind is PackKind.RESIDUAL and opened.extents == [] and opened.header.data_length == 0

    first = write_pack(tmp_path, PackKind.PAYLOAD, LAYOUT, PLAN[:3], host_source(regions))
    inode = os.stat(first.path).st_ino
    again = write_pack(tmp_path, PackKind.PAYLOAD, LAYOUT, PLAN[:3], host_source(regions), chunk_bytes=4096)
    assert (again.path, again.sha256, again.reused, first.reused) == (first.path, first.sha256, True, False)
    assert os.stat(first.path).st_ino == inode  # kept, not replaced: its validation record stays valid
    assert sorted(os.listdir(tmp_path)) == sorted([empty.path.name, first.path.name])


def test_staging_buffer_is_what_the_source_fills(tmp_path):
    regions = host_regions()
    staging = bytearray(8192)
    seen = []

    def read_source(tag, offset, dest):
        seen.append(dest.obj is staging and len(dest) <= len(staging))
        dest[:] = regions[tag][offset : offset + len(dest)]

    pack = write_pack(tmp_path, PackKind.PAYLOAD, LAYOUT, PLAN, read_source, staging=staging)
    (tmp_path / "reference").mkdir()
    reference = write_pack(tmp_path / "reference", PackKind.PAYLOAD, LAYOUT, PLAN, host_source(regions), chunk_bytes=MIB)
    assert all(seen) and len(seen) > 3 * MIB // 8192
    assert pack.sha256 == reference.sha256  # chunking never changes the bytes


def test_large_table_pushes_the_data_offset(tmp_path):
    regions = host_regions()
    plan = [PlannedExtent("weights", i * 10, 3, [tensor(f"model.layers.{i}.scale", i * 10, 2)]) for i in range(400)]
    pack = write_pack(tmp_path, PackKind.PAYLOAD, LAYOUT, plan, host_source(regions))
    opened = NativePack.open(pack.path)
    assert opened.header.table_length > 4096 and opened.header.data_offset == align_up(4096 + opened.header.table_length)
    assert opened.read_extent(opened.extents[399]) == regions["weights"][3990:3993]


def test_source_failure_midway_leaves_no_file(tmp_path):
    regions = host_regions()
    reads = []
    source = host_source(regions, reads)

    def failing(tag, offset, dest):
        if len(reads) == 5:
            raise RuntimeError("cudaMemcpy failed: an illegal memory access")
        source(tag, offset, dest)

    with pytest.raises(RuntimeError, match="illegal memory access"):
        write_pack(tmp_path, PackKind.PAYLOAD, LAYOUT, PLAN, failing, chunk_bytes=64 * 1024)
    assert len(reads) == 5 and os.listdir(tmp_path) == []

    def interrupted(done, total):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_pack(tmp_path, PackKind.PAYLOAD, LAYOUT, PLAN, source, progress=interrupted)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "plan, kind, layout, problem",
    [
        ([PlannedExtent("weights", 0, 100), PlannedExtent("weights", 99, 10)], 1, LAYOUT, "overlap in region 'weights'"),
        ([PlannedExtent("vram", 0, 100)], 1, LAYOUT, "region"),
        ([PlannedExtent("weights", 0, 0)], 1, LAYOUT, "length"),
        ([PlannedExtent("weights", 0, 10, [tensor("t", 8, 4)])], 1, LAYOUT, "outside its extent"),
        ([PlannedExtent("weights", 0, 4, [tensor("t", 0, 2)]), PlannedExtent("weights", 8, 4, [tensor("t", 8, 2)])],
         1, LAYOUT, "appears twice"),
        ([], 3, LAYOUT, "invalid pack kind 3"),
        ([], 1, "ABC", "not a lower-case hex SHA-256"),
    ],
)
def test_invalid_plan_is_refused_before_writing(tmp_path, plan, kind, layout, problem):
    with pytest.raises(PackPlanInvalid, match=problem):
        write_pack(tmp_path, kind, layout, plan, host_source(host_regions()))
    assert os.listdir(tmp_path) == []


# --- bad files -------------------------------------------------------------------------------------


def truncations(size: int, header: PackHeader) -> list[int]:
    return [0, 4, 8, 11, 12, 100, 4095, 4096, 4096 + header.table_length // 2, header.data_offset - 1,
            header.data_offset, header.data_offset + 4097, size - 4096, size - 1]


def test_truncated_anywhere_is_named_with_sizes(written, tmp_path):
    pack, _, _ = written
    data = pack.path.read_bytes()
    header = NativePack.open(pack.path).header
    for keep in truncations(len(data), header):
        cut = tmp_path / f"cut-{keep}.pack"
        cut.write_bytes(data[:keep])
        with pytest.raises(PackTruncated) as caught:
            NativePack.open(cut)
        assert caught.value.actual == keep and caught.value.expected > keep, keep
        assert f"the file has {keep}" in str(caught.value) and "\n" not in str(caught.value)


def test_truncated_after_open_is_caught_by_read_extent(written):
    pack, _, _ = written
    opened = NativePack.open(pack.path)
    os.truncate(pack.path, opened.extents[-1].file_offset)
    with pytest.raises(PackTruncated, match="extent at"):
        opened.read_extent(opened.extents[-1])


def test_wrong_magic(written, tmp_path):
    pack, _, _ = written
    for name, data in [("safetensors", b"\x08\x00\x00\x00\x00\x00\x00\x00{}" + bytes(5000)),
                       ("flipped", b"X" + pack.path.read_bytes()[1:]),
                       ("short", b"GGUF")]:
        path = tmp_path / name
        path.write_bytes(data)
        with pytest.raises(PackBadMagic, match="not a coldsnap native pack"):
            NativePack.open(path)


def test_unsupported_version_lists_the_supported_ones(written, tmp_path):
    pack, _, _ = written
    data = bytearray(pack.path.read_bytes())
    struct.pack_into("<I", data, 8, 2)
    for name, content in [("v2.pack", bytes(data)), ("v2-short.pack", bytes(data[:12]))]:
        (tmp_path / name).write_bytes(content)
        with pytest.raises(PackUnsupportedVersion) as caught:
            NativePack.open(tmp_path / name)
        assert caught.value.version == 2 and caught.value.supported == SUPPORTED_PACK_VERSIONS == (1,)
        assert str(caught.value).endswith("unsupported pack format version 2 (supported: 1)")


def test_flipped_table_byte_is_corrupt(written, tmp_path):
    pack, _, _ = written
    data = bytearray(pack.path.read_bytes())
    data[HEADER_BYTES + 10] ^= 0x01
    (tmp_path / "flip.pack").write_bytes(data)
    with pytest.raises(PackCorrupt, match="extents table SHA-256 does not match"):
        NativePack.open(tmp_path / "flip.pack")


def craft(tmp_path, table_value, data_length=8192, kind=1, reserved=b"", table_bytes=None, trailing=b""):
    """A pack assembled by hand, with a self-consistent header around whatever table it is given."""
    table = canonical_json(table_value) if table_bytes is None else table_bytes
    data_offset = align_up(HEADER_BYTES + len(table))
    head = bytearray(HEADER_FIELDS.pack(PACK_MAGIC, 1, kind, HEADER_BYTES, len(table), hashlib.sha256(table).digest(),
                                        data_offset, data_length, bytes.fromhex(LAYOUT)))
    head += reserved + bytes(HEADER_BYTES - len(head) - len(reserved))
    path = tmp_path / "crafted.pack"
    path.write_bytes(bytes(head) + table + bytes(data_offset - HEADER_BYTES - len(table)) + bytes(data_length) + trailing)
    return path


def extent(region="weights", region_offset=0, length=10, file_offset=8192, tensors=()):
    return {"region": region, "region_offset": region_offset, "length": length, "file_offset": file_offset,
            "tensors": list(tensors)}


@pytest.mark.parametrize(
    "kwargs, problem",
    [
        ({"table_value": {"format": 1, "extents": [extent(file_offset=8193)]}}, "not a multiple of 4096"),
        ({"table_value": {"format": 1, "extents": [extent(file_offset=16384)]}}, "outside the data area"),
        ({"table_value": {"format": 1, "extents": [extent(length=8193)]}}, "outside the data area"),
        ({"table_value": {"format": 1, "extents": [extent(), extent(file_offset=12288, region_offset=5)]}}, "overlap in region"),
        ({"table_value": {"format": 1, "extents": [extent(file_offset=12288), extent(file_offset=8192, region_offset=20)]}},
         "out of file order"),
        ({"table_value": {"format": 1, "extents": [], "colour": "blue"}}, "colour: unknown field"),
        ({"table_value": {"format": 2, "extents": []}}, "unsupported format 2"),
        ({"table_value": None, "table_bytes": b'{"format": 1, "extents": []}'}, "not canonical JSON"),
        ({"table_value": None, "table_bytes": b"\xff\xfe"}, "not UTF-8"),
        ({"table_value": None, "table_bytes": canonical_json({"format": 1, "extents": []}).replace(b"[]", b"[" + json.dumps(
            extent(region_offset=2**63)).encode().replace(b" ", b"") + b"]")}, "outside the signed 64-bit range"),
        ({"table_value": {"format": 1, "extents": []}, "kind": 9}, "unknown pack kind 9"),
        ({"table_value": {"format": 1, "extents": []}, "reserved": b"\x01"}, "are not zero"),
        ({"table_value": {"format": 1, "extents": []}, "data_length": 100}, "not a multiple of 4096"),
        ({"table_value": {"format": 1, "extents": []}, "trailing": b"x"}, "1 bytes follow the data area"),
    ],
)
def test_inconsistent_header_or_table_is_corrupt(tmp_path, kwargs, problem):
    with pytest.raises(PackCorrupt, match=problem) as caught:
        NativePack.open(craft(tmp_path, **kwargs))
    assert "\n" not in str(caught.value)


def test_crafted_valid_pack_opens(tmp_path):
    table = {"format": 1, "extents": [extent(), extent(region="runtime", file_offset=12288)]}
    opened = NativePack.open(craft(tmp_path, table, 8192))
    assert [e.region for e in opened.extents] == ["weights", "runtime"]


def test_unreadable_paths(tmp_path):
    with pytest.raises(PackUnreadable, match="No such file"):
        NativePack.open(tmp_path / "missing.pack")
    with pytest.raises(PackUnreadable, match="not a regular file"):
        NativePack.open(tmp_path)
    os.mkfifo(tmp_path / "fifo.pack")  # must fail at once, not block waiting for a writer
    with pytest.raises(PackUnreadable, match="not a regular file"):
        NativePack.open(tmp_path / "fifo.pack")
    assert issubclass(PackUnreadable, PackError) and issubclass(PackError, ValueError)


# --- regions and hydration -------------------------------------------------------------------------

SIZES = {"weights": 4 * MIB, "runtime": 64 * 1024, "cudagraph": 16 * 1024}
BASES = {"weights": 0x7F00_0000_0000, "runtime": 0x7F10_0000_0000, "cudagraph": 0x7F20_0000_0000}


def test_hydration_plan_addresses(written):
    pack, _, _ = written
    opened = NativePack.open(pack.path)
    plan = opened.hydration_plan(BASES, SIZES)
    assert plan == [HydrationCopy(e.file_offset, e.length, BASES[e.region] + e.region_offset) for e in opened.extents]
    assert plan[3] == (opened.extents[3].file_offset, 3 * MIB + 5, 0x7F00_0000_0000 + 9000)  # a plain tuple to the C++ side
    exact = {tag: max(e.region_end for e in opened.extents if e.region == tag) for tag in SIZES}
    opened.check_regions(exact)  # a region exactly as large as its last extent's end is enough


def test_region_too_small_and_extent_out_of_region(written):
    opened = NativePack.open(written[0].path)
    needed = 9000 + 3 * MIB + 5
    with pytest.raises(RegionTooSmall) as caught:
        opened.check_regions({**SIZES, "weights": needed - 1})
    assert (caught.value.tag, caught.value.needed, caught.value.have) == ("weights", needed, needed - 1)
    assert isinstance(caught.value, ExtentOutOfRegion)
    with pytest.raises(RegionTooSmall, match="region 'runtime' has 10 bytes"):
        opened.hydration_plan(BASES, {**SIZES, "runtime": 10})

    without_runtime = {tag: size for tag, size in SIZES.items() if tag != "runtime"}
    with pytest.raises(ExtentOutOfRegion, match="targets region 'runtime', which is not mapped") as missing:
        opened.check_regions(without_runtime)
    assert not isinstance(missing.value, RegionTooSmall)
    no_weights = {tag: base for tag, base in BASES.items() if tag != "weights"}
    for bases in ({**BASES, "cudagraph": 0}, no_weights, {**BASES, "weights": 2**64 - 4096}):
        with pytest.raises(ExtentOutOfRegion, match="no valid base address"):
            opened.hydration_plan(bases, SIZES)


def test_layout_binding(written):
    opened = NativePack.open(written[0].path)
    opened.expect_layout(LAYOUT)
    with pytest.raises(PackLayoutMismatch, match="not the expected layout"):
        opened.expect_layout("0" * 64)

"""Zero pages left out of a CRIU image (coldsnap.snapshot.criu_pages) on hand-made image files; the
real round trip through CRIU is tests/integration/test_criu_snapshot.py."""

import struct

from coldsnap.snapshot.criu_images import _decode, _encode, _read_entries
from coldsnap.snapshot.criu_pages import (PAGE_SIZE, PE_PRESENT, VMA_ANON_PRIVATE, VMA_FILE_PRIVATE, compact_image,
                                          image_census)

BASE = 0x7F0000000000


def _image(fields_list: list[list]) -> bytes:
    out = bytearray(struct.pack("<II", 0x54564319, 0x56084025))
    for fields in fields_list:
        raw = _encode(fields)
        out += struct.pack("<I", len(raw)) + raw
    return bytes(out)


def _write(images, vmas, entries, pages: bytes) -> None:
    images.mkdir()
    vma_fields = [(14, 2, _encode([(1, 0, s), (2, 0, e), (3, 0, 0), (4, 0, 0), (5, 0, 3), (6, 0, 0x22), (7, 0, st),
                                   (8, 0, 0)])) for s, e, st in vmas]
    (images / "mm-1.img").write_bytes(_image([vma_fields]))
    (images / "pagemap-1.img").write_bytes(_image([[(1, 0, 1)], *[[(1, 0, v), (2, 0, n), (4, 0, f)]
                                                                   for v, n, f in entries]]))
    (images / "pages-1.img").write_bytes(pages)


def _entries(images) -> list[tuple[int, int]]:
    fields = [_decode(e) for e in _read_entries(images / "pagemap-1.img")[1][1:]]
    return [(next(v for n, _, v in f if n == 1), next(v for n, _, v in f if n == 5 or n == 2)) for f in fields]


def _page(value: int) -> bytes:
    return bytes([value]) * PAGE_SIZE


def test_zero_runs_of_anonymous_memory_leave_the_image_and_file_backed_ones_stay(tmp_path):
    images = tmp_path / "images"
    anonymous = [_page(1), *[_page(0)] * 6, _page(2), _page(0), _page(3)]  # a long run, then a short one
    file_backed = [_page(0)] * 5  # zeros over a file's bytes: an absent page would come back from the file
    _write(images, [(BASE, BASE + 10 * PAGE_SIZE, VMA_ANON_PRIVATE | 1),
                    (BASE + 10 * PAGE_SIZE, BASE + 15 * PAGE_SIZE, VMA_FILE_PRIVATE | 1)],
           [(BASE, 15, PE_PRESENT)], b"".join(anonymous + file_backed))

    census = image_census(images)
    assert census.zero_bytes == 6 * PAGE_SIZE and census.bytes == 15 * PAGE_SIZE  # the short run is not counted
    compacted = compact_image(images)
    assert compacted.dropped_bytes == 6 * PAGE_SIZE
    assert _entries(images) == [(BASE, 1), (BASE + 7 * PAGE_SIZE, 8)]
    assert (images / "pages-1.img").read_bytes() == b"".join([anonymous[0], *anonymous[7:], *file_backed])
    assert image_census(images).zero_bytes == 0
    assert not list(images.glob("*.compact"))


def test_an_image_without_zero_pages_is_rewritten_unchanged(tmp_path):
    images = tmp_path / "images"
    pages = b"".join(_page(v) for v in (5, 6, 7))
    _write(images, [(BASE, BASE + 3 * PAGE_SIZE, VMA_ANON_PRIVATE | 1)], [(BASE, 3, PE_PRESENT)], pages)
    pagemap = (images / "pagemap-1.img").read_bytes()
    assert compact_image(images).dropped_bytes == 0
    assert (images / "pages-1.img").read_bytes() == pages
    assert (images / "pagemap-1.img").read_bytes() == pagemap

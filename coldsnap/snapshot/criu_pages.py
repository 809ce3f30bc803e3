"""The private memory of a CRIU image: what each process carries, and the zero pages it need not.

CRIU dumps every page a process has written, zeros included (only never-touched pages are
skipped: docs/design.md, "CRIU's page fill"), and its restore reads each back into a fresh page, single-threaded:
a page of zeros costs as much as any other. A freshly mapped private anonymous page *is* zero, so a
page of zeros in a private anonymous mapping can be left out of the image and the restore gives the
same memory: CRIU maps the area anonymously and fills only the pages the pagemap lists
(``criu/pie/restorer.c``); where a child shares a mapping with its parent copy-on-write, a page the
parent has and the child's pagemap lacks is dropped with ``MADV_DONTNEED``, i.e. zero again
(``criu/mem.c`` ``restore_priv_vma_content``, "Remove pages, which were not shared with a child").
File-backed private mappings are left alone: there an absent page comes back from the file, not as
zeros. Shared memory (``pagemap-shmem-*``) is not touched either.

The files (CRIU's ``images/{mm,pagemap,vma,core}.proto``): ``mm-<pid>.img`` lists the process's VMAs
with a status word (``VMA_ANON_PRIVATE`` = 1 << 9, ``VMA_FILE_PRIVATE`` = 1 << 6, ...);
``pagemap-<pid>.img`` a head naming ``pages-<id>.img`` and then runs ``(vaddr, nr_pages, flags)``;
the runs flagged ``PE_PRESENT`` have their pages in ``pages-<id>.img``, back to back, in pagemap order.
:func:`compact_image` rewrites both files of each process without the zero runs of its private
anonymous mappings; :func:`image_census` only counts.
"""

from __future__ import annotations

import os
import re
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path

from coldsnap.atomic import write_atomic
from coldsnap.snapshot.criu_images import Field, ImageFormatError, _decode, _encode, _first, _read_entries

__all__ = ["ProcessPages", "ImageCensus", "image_census", "compact_image", "PAGE_SIZE", "MIN_ZERO_RUN_PAGES"]

PAGE_SIZE = 4096
MIN_ZERO_RUN_PAGES = 4
"""Zero runs shorter than this stay: each run left out splits a pagemap entry, and CRIU reads each
entry with its own I/O vector; single zero pages inside written memory are not worth that."""

# images/mm.proto, vma.proto, pagemap.proto, core.proto, pstree.proto field numbers
_MM_VMAS = 14
_VMA_START, _VMA_END, _VMA_STATUS, _VMA_MADV = 1, 2, 7, 9
_PE_VADDR, _PE_COMPAT_NR, _PE_IN_PARENT, _PE_FLAGS, _PE_NR = 1, 2, 3, 4, 5
_HEAD_PAGES_ID = 1
_CORE_TC, _TC_COMM = 3, 6
# criu/include/image.h, pagemap.h
VMA_AREA_STACK, VMA_AREA_HEAP = 1 << 1, 1 << 5
VMA_FILE_PRIVATE, VMA_ANON_PRIVATE = 1 << 6, 1 << 9
PE_PARENT, PE_PRESENT = 1 << 0, 1 << 2
MADV_HUGEPAGE = 14  # vma_entry.madv is a bitmap of 1 << MADV_*
_LARGE = 64 << 20
_CHUNK = 16 << 20
_ZERO_PAGE = bytes(PAGE_SIZE)


@dataclass
class ProcessPages:
    """One process's private pages in the image, by the kind of mapping that holds them (bytes)."""

    pid: int
    comm: str
    by_kind: dict[str, int] = field(default_factory=dict)
    zero_by_kind: dict[str, int] = field(default_factory=dict)
    """Of ``by_kind``, the pages that held only zeros (in runs of at least :data:`MIN_ZERO_RUN_PAGES`)."""
    dropped_bytes: int = 0
    """Zero pages :func:`compact_image` left out (0 for a census)."""
    huge_pages_advised_bytes: int = 0
    """Pages in mappings advised ``MADV_HUGEPAGE``: CRIU 4.2 fills them with 4 KiB pages all the same and
    applies the advice after the fill (docs/design.md, "CRIU's page fill")."""
    entries_before: int = 0
    entries_after: int = 0

    @property
    def bytes(self) -> int:
        return sum(self.by_kind.values())

    @property
    def zero_bytes(self) -> int:
        return sum(self.zero_by_kind.values())

    def to_json_value(self) -> dict:
        return {"pid": self.pid, "comm": self.comm, "bytes": self.bytes, "zero_bytes": self.zero_bytes,
                "dropped_bytes": self.dropped_bytes, "huge_pages_advised_bytes": self.huge_pages_advised_bytes,
                "by_kind": dict(self.by_kind),
                "zero_by_kind": dict(self.zero_by_kind), "pagemap_entries": [self.entries_before, self.entries_after]}


@dataclass
class ImageCensus:
    processes: list[ProcessPages]

    @property
    def bytes(self) -> int:
        return sum(p.bytes for p in self.processes)

    @property
    def zero_bytes(self) -> int:
        return sum(p.zero_bytes for p in self.processes)

    @property
    def dropped_bytes(self) -> int:
        return sum(p.dropped_bytes for p in self.processes)

    def summary(self) -> str:
        """``pid:bytes:dropped`` per process, comma-separated, largest first (a span attribute)."""
        ordered = sorted(self.processes, key=lambda p: -p.bytes)
        return ",".join(f"{p.pid}:{p.bytes}:{p.dropped_bytes}" for p in ordered)

    def to_json_value(self) -> dict:
        return {"bytes": self.bytes, "zero_bytes": self.zero_bytes, "dropped_bytes": self.dropped_bytes,
                "processes": [p.to_json_value() for p in sorted(self.processes, key=lambda p: -p.bytes)]}


@dataclass(frozen=True)
class _Vma:
    start: int
    end: int
    status: int
    madv: int = 0

    @property
    def huge_pages_advised(self) -> bool:
        return bool(self.madv & 1 << MADV_HUGEPAGE)

    def kind(self) -> str:
        if self.status & VMA_FILE_PRIVATE:
            return "file-backed private (written pages)"
        if not self.status & VMA_ANON_PRIVATE:
            return "other"
        if self.status & VMA_AREA_HEAP:
            return "C heap (brk)"
        if self.status & VMA_AREA_STACK:
            return "main thread stack"
        if self.end - self.start >= _LARGE:
            return "anonymous >= 64 MiB (arenas, CPU tensors, device state parked by the CUDA checkpoint)"
        return "anonymous < 64 MiB (thread stacks, arenas, Python objects)"

    @property
    def droppable(self) -> bool:
        return bool(self.status & VMA_ANON_PRIVATE) and not self.status & VMA_FILE_PRIVATE


@dataclass
class _Entry:
    fields: list[Field]
    vaddr: int
    nr_pages: int
    flags: int

    @property
    def present(self) -> bool:
        return bool(self.flags & PE_PRESENT)

    def split(self, vaddr: int, nr_pages: int) -> "_Entry":
        """This entry's other fields over ``nr_pages`` from ``vaddr``."""
        kept = [(n, w, v) for n, w, v in self.fields if n not in (_PE_VADDR, _PE_COMPAT_NR, _PE_NR)]
        fields: list[Field] = [(_PE_VADDR, 0, vaddr), (_PE_COMPAT_NR, 0, min(nr_pages, 0xFFFFFFFF)), *kept,
                               (_PE_NR, 0, nr_pages)]
        return _Entry(fields, vaddr, nr_pages, self.flags)


def _vmas(path: Path) -> list[_Vma]:
    entries = _read_entries(path)[1]
    if not entries:
        raise ImageFormatError(f"{path.name}: no mm entry")
    found = []
    for number, _, value in _decode(entries[0]):
        if number == _MM_VMAS and isinstance(value, bytes):
            vma = _decode(value)
            found.append(_Vma(int(_first(vma, _VMA_START)), int(_first(vma, _VMA_END)), int(_first(vma, _VMA_STATUS)),
                              int(_first(vma, _VMA_MADV))))
    return sorted(found, key=lambda v: v.start)


def _pagemap(path: Path) -> tuple[bytes, bytes, int, list[_Entry]]:
    header, entries = _read_entries(path)
    if not entries:
        raise ImageFormatError(f"{path.name}: no pagemap head")
    pages_id = int(_first(_decode(entries[0]), _HEAD_PAGES_ID))
    parsed = []
    for raw in entries[1:]:
        fields = _decode(raw)
        numbers = {n for n, _, _ in fields}
        nr = int(_first(fields, _PE_NR)) if _PE_NR in numbers else int(_first(fields, _PE_COMPAT_NR))
        if _PE_FLAGS in numbers:
            flags = int(_first(fields, _PE_FLAGS))
        else:  # images older than the flags field: in_parent or present (criu/pagemap.c)
            flags = PE_PARENT if _first(fields, _PE_IN_PARENT) else PE_PRESENT
        parsed.append(_Entry(fields, int(_first(fields, _PE_VADDR)), nr, flags))
    return header, entries[0], pages_id, parsed


def _comm(path: Path) -> str:
    try:
        core = _decode(_read_entries(path)[1][0])
        tc = _first(core, _CORE_TC, b"")
        comm = _first(_decode(tc), _TC_COMM, b"") if isinstance(tc, bytes) else b""
        return comm.decode(errors="replace") if isinstance(comm, bytes) else "?"
    except (OSError, IndexError, ImageFormatError):
        return "?"


class _VmaCursor:
    """The VMA holding each address, for addresses visited in increasing order."""

    def __init__(self, vmas: list[_Vma]):
        self._vmas, self._at = vmas, 0

    def at(self, address: int) -> _Vma | None:
        while self._at < len(self._vmas) and self._vmas[self._at].end <= address:
            self._at += 1
        if self._at < len(self._vmas) and self._vmas[self._at].start <= address:
            return self._vmas[self._at]
        return None


def _process_ids(images: Path) -> list[int]:
    return sorted(int(m[1]) for p in images.iterdir() if (m := re.fullmatch(r"pagemap-(\d+)\.img", p.name)))


def _scan(images: Path, pid: int, rewrite: bool, min_run: int) -> ProcessPages:
    """Count (and with ``rewrite``, leave out) the zero runs of one process's private anonymous pages."""
    pagemap_path = images / f"pagemap-{pid}.img"
    header, head, pages_id, entries = _pagemap(pagemap_path)
    pages_path = images / f"pages-{pages_id}.img"
    cursor = _VmaCursor(_vmas(images / f"mm-{pid}.img"))
    result = ProcessPages(pid=pid, comm=_comm(images / f"core-{pid}.img"), entries_before=len(entries))
    kept: list[_Entry] = []
    compacted = pages_path.with_name(pages_path.name + ".compact")
    source = os.open(pages_path, os.O_RDONLY | os.O_CLOEXEC)
    target = None
    try:
        if rewrite:  # the new pages file as CRIU made the old one: its mode and owner
            status = os.fstat(source)
            target = os.open(compacted, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            os.fchmod(target, stat.S_IMODE(status.st_mode))
            os.fchown(target, status.st_uid, status.st_gid)
        for entry in entries:
            if not entry.present:
                kept.append(entry)
                continue
            runs = _zero_runs(source, entry, cursor, result, min_run, target)
            kept.extend(_keep(entry, runs))
        if target is not None:
            leftover = os.fstat(source).st_size - os.lseek(source, 0, os.SEEK_CUR)
            if leftover:
                raise ImageFormatError(f"{pages_path.name}: {leftover} bytes past the pages its pagemap lists")
            os.fsync(target)
    except BaseException:
        if target is not None:
            compacted.unlink(missing_ok=True)
        raise
    finally:
        os.close(source)
        if target is not None:
            os.close(target)
    result.entries_after = len(kept)
    if rewrite and not result.zero_bytes:  # nothing to leave out: the dump's own files stay
        compacted.unlink(missing_ok=True)
    elif rewrite:
        result.dropped_bytes = result.zero_bytes
        out = bytearray(header)
        for raw in [head, *(_encode(e.fields) for e in kept)]:
            out += struct.pack("<I", len(raw)) + raw
        # pages first: until the pagemap names the new layout, a crash leaves the capture uncommitted
        os.replace(compacted, pages_path)
        write_atomic(pagemap_path, bytes(out), mode=stat.S_IMODE(os.stat(pagemap_path).st_mode))
    return result


def _zero_runs(source: int, entry: _Entry, cursor: _VmaCursor, result: ProcessPages, min_run: int,
               target: int | None) -> list[tuple[int, int]]:
    """Read one present entry's pages, counting them by kind; returns its zero runs of at least
    ``min_run`` pages in private anonymous mappings as (first page, count), and writes every other page
    to ``target`` (when rewriting), in order."""
    runs: list[tuple[int, int]] = []
    run_start = run_length = 0
    run_kinds: dict[str, int] = {}
    short_run: list[bytes] = []  # the current run's pages while it is shorter than min_run

    def end_run() -> None:
        nonlocal run_length
        if run_length >= min_run:
            runs.append((run_start, run_length))
            for kind, pages in run_kinds.items():
                result.zero_by_kind[kind] = result.zero_by_kind.get(kind, 0) + pages * PAGE_SIZE
        elif target is not None:
            _write_all(target, b"".join(short_run))
        run_length = 0
        run_kinds.clear()
        short_run.clear()

    done = 0
    while done < entry.nr_pages:
        count = min(entry.nr_pages - done, _CHUNK // PAGE_SIZE)
        data = _read_exactly(source, count * PAGE_SIZE, entry.vaddr)
        unwritten = None  # byte offset in data of the first non-zero page not written yet
        for i in range(count):
            vma = cursor.at(entry.vaddr + (done + i) * PAGE_SIZE)
            kind = vma.kind() if vma else "other"
            result.by_kind[kind] = result.by_kind.get(kind, 0) + PAGE_SIZE
            if vma is not None and vma.huge_pages_advised:
                result.huge_pages_advised_bytes += PAGE_SIZE
            if vma is not None and vma.droppable and data.startswith(_ZERO_PAGE, i * PAGE_SIZE):
                if unwritten is not None and target is not None:
                    _write_all(target, data[unwritten:i * PAGE_SIZE])
                unwritten = None
                if run_length == 0:
                    run_start = done + i
                run_length += 1
                run_kinds[kind] = run_kinds.get(kind, 0) + 1
                if run_length < min_run:
                    short_run.append(_ZERO_PAGE)
                else:
                    short_run.clear()
                continue
            if run_length:
                end_run()
            if unwritten is None:
                unwritten = i * PAGE_SIZE
        if unwritten is not None and target is not None:
            _write_all(target, data[unwritten:])
        done += count
    if run_length:
        end_run()
    return runs


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _read_exactly(fd: int, size: int, vaddr: int) -> bytes:
    data = os.read(fd, size)
    while len(data) < size:  # a short read of a regular file: keep reading
        more = os.read(fd, size - len(data))
        if not more:
            raise ImageFormatError(f"the pages image ends inside the pages of the entry at {vaddr:#x}")
        data += more
    return data


def _keep(entry: _Entry, runs: list[tuple[int, int]]) -> list[_Entry]:
    """``entry`` without the page runs ``runs`` (sorted, inside it), as the entries that remain."""
    if not runs:
        return [entry]
    kept, at = [], 0
    for first, count in runs:
        if first > at:
            kept.append(entry.split(entry.vaddr + at * PAGE_SIZE, first - at))
        at = first + count
    if at < entry.nr_pages:
        kept.append(entry.split(entry.vaddr + at * PAGE_SIZE, entry.nr_pages - at))
    return kept


def image_census(images: Path, min_run: int = MIN_ZERO_RUN_PAGES) -> ImageCensus:
    """What each process of the image in ``images`` carries in private pages, by mapping kind, and how
    much of it is zero pages (reads every page; changes nothing)."""
    return ImageCensus([_scan(images, pid, False, min_run) for pid in _process_ids(images)])


def compact_image(images: Path, min_run: int = MIN_ZERO_RUN_PAGES) -> ImageCensus:
    """Leave the zero pages of private anonymous mappings out of the image in ``images`` (each process's
    ``pagemap`` and ``pages`` files rewritten, each file replaced atomically); returns the census with
    what was dropped. The restored memory is the same (see the module docstring)."""
    return ImageCensus([_scan(images, pid, True, min_run) for pid in _process_ids(images)])

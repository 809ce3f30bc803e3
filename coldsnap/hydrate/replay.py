"""Recovery replay: place the tensors of pinned safetensors files at their captured addresses.

When no native pack is available, a restore rebuilds the weights region from the original
safetensors: the captured layout says where each named tensor lived (region, offset, dtype, shape),
the safetensors header says where its bytes are in which file, and the hydration engine copies
straight from those file extents to those addresses.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from coldsnap.contracts.layout import MemoryLayout
from coldsnap.hydrate.engine import CopyItem, HydrationError, HydrationStats, hydrate_items
from coldsnap.memory.regions import StableRegion

__all__ = ["SafetensorsIndex", "SafetensorsEntry", "replay_safetensors", "SAFETENSORS_DTYPES"]

# safetensors dtype code -> torch dtype name (the names MemoryLayout records) and element size.
SAFETENSORS_DTYPES: dict[str, tuple[str, int]] = {
    "BOOL": ("bool", 1),
    "U8": ("uint8", 1),
    "I8": ("int8", 1),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
    "I16": ("int16", 2),
    "U16": ("uint16", 2),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "I32": ("int32", 4),
    "U32": ("uint32", 4),
    "F32": ("float32", 4),
    "I64": ("int64", 8),
    "U64": ("uint64", 8),
    "F64": ("float64", 8),
}

_MAX_HEADER = 100 << 20  # the format's own limit


@dataclass(frozen=True)
class SafetensorsEntry:
    file: Path
    dtype: str  # torch name
    shape: tuple[int, ...]
    file_offset: int
    length: int


class SafetensorsIndex:
    """Where every tensor of a set of safetensors files lies, read from their headers only."""

    def __init__(self, files: Iterable[str | os.PathLike[str]]):
        self.entries: dict[str, SafetensorsEntry] = {}
        for file in files:
            self._read_header(Path(file))

    def _read_header(self, path: Path) -> None:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            prefix = handle.read(8)
            if len(prefix) != 8:
                raise HydrationError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (header_length,) = struct.unpack("<Q", prefix)
            if header_length > min(_MAX_HEADER, size - 8):
                raise HydrationError(f"{path}: safetensors header length {header_length} is impossible")
            try:
                header = json.loads(handle.read(header_length))
            except ValueError as exc:
                raise HydrationError(f"{path}: safetensors header is not JSON ({exc})") from None
        data_start = 8 + header_length
        for name, info in header.items():
            if name == "__metadata__":
                continue
            code = info.get("dtype")
            if code not in SAFETENSORS_DTYPES:
                raise HydrationError(f"{path}: tensor {name!r} has unsupported dtype {code!r}")
            begin, end = info["data_offsets"]
            if not 0 <= begin <= end or data_start + end > size:
                raise HydrationError(f"{path}: tensor {name!r} lies outside the file (truncated?)")
            if name in self.entries:
                raise HydrationError(f"tensor {name!r} appears in both {self.entries[name].file} and {path}")
            self.entries[name] = SafetensorsEntry(
                path, SAFETENSORS_DTYPES[code][0], tuple(info["shape"]), data_start + begin, end - begin
            )


def replay_safetensors(
    files: Iterable[str | os.PathLike[str]],
    layout: MemoryLayout,
    regions: dict[str, StableRegion],
    **engine_options: object,
) -> list[HydrationStats]:
    """Copy every tensor the layout names from the safetensors files to its captured address.

    Checks everything first (each tensor present, same dtype, shape and byte length, regions mapped),
    so a mismatch writes nothing. Returns one stats record per file.
    """
    index = SafetensorsIndex(files)
    per_file: dict[Path, list[CopyItem]] = {}
    problems: list[str] = []
    targets: list[StableRegion] = []
    for region_layout in layout.regions:
        if not region_layout.tensors:
            continue
        target = regions.get(region_layout.tag)
        if target is None:
            problems.append(f"region {region_layout.tag!r} is not reserved")
            continue
        targets.append(target)
        for tensor in region_layout.tensors:
            entry = index.entries.get(tensor.name)
            if entry is None:
                problems.append(f"tensor {tensor.name!r} is in no safetensors file")
            elif (entry.dtype, entry.shape, entry.length) != (tensor.dtype, tuple(tensor.shape), tensor.length):
                problems.append(
                    f"tensor {tensor.name!r}: captured {tensor.dtype}{list(tensor.shape)} ({tensor.length} bytes), "
                    f"file has {entry.dtype}{list(entry.shape)} ({entry.length} bytes)"
                )
            elif tensor.offset + tensor.length > target.mapped_bytes:
                problems.append(f"tensor {tensor.name!r} ends past the mapped bytes of region {target.tag!r}")
            else:
                per_file.setdefault(entry.file, []).append(
                    CopyItem(entry.file_offset, entry.length, target.base + tensor.offset)
                )
    if problems:
        raise HydrationError("recovery replay refused: " + "; ".join(problems[:10]) + (
            f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""))
    return [
        hydrate_items(file, sorted(items), targets, **engine_options)  # type: ignore[arg-type]
        for file, items in sorted(per_file.items())
    ]

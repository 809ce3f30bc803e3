"""Read and rewrite the sockets of a CRIU image, without CRIU's own tools.

A replica restored on another serving port needs its listening sockets bound elsewhere, and one
restored next to another replica of the same image needs its own abstract unix socket names. Both live
in ``files.img``: a CRIU image file is two little-endian u32 magics, then entries, each a u32 length and
a protobuf ``file_entry`` (``images/fdinfo.proto`` of CRIU); an inet socket is its field ``isk``
(``inet_sk_entry``, ``images/sk-inet.proto``), a unix socket its field ``usk`` (``unix_sk_entry``,
``images/sk-unix.proto``). This module decodes just enough protobuf wire format to change those few
fields and re-encodes everything else byte for byte (fields it does not know included), so a copy
rewritten with no change is the original. The hosts have no ``crit``/``pycriu``; this needs neither.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

__all__ = ["ImageFormatError", "InetSocket", "UnixSocket", "RegularFile", "FILES_IMAGE", "ghost_file_ids",
           "read_regular_files", "read_sockets", "rewrite_sockets"]

FILES_IMAGE = "files.img"
REMAP_IMAGE = "remap-fpath.img"

# file_entry fields, fd_types values (images/fdinfo.proto)
_FILE_TYPE, _FILE_REG, _FILE_ISK, _FILE_USK = 1, 3, 4, 16
_REG, _INETSK, _UNIXSK = 1, 4, 5
# reg_file_entry fields (images/regfile.proto); remap_file_path_entry fields and remap_type (images/remap-file-path.proto)
_REG_ID, _REG_FLAGS, _REG_NAME, _REG_SIZE, _REG_EXT, _REG_MODE = 1, 2, 6, 8, 9, 10
_REMAP_ORIG_ID, _REMAP_TYPE, _REMAP_GHOST = 1, 3, 1
# inet_sk_entry fields (images/sk-inet.proto)
_ISK_INO, _ISK_FAMILY, _ISK_TYPE, _ISK_STATE, _ISK_SRC_PORT, _ISK_DST_PORT, _ISK_SRC_ADDR, _ISK_DST_ADDR = (
    2, 3, 4, 6, 7, 8, 11, 12)
# unix_sk_entry fields (images/sk-unix.proto)
_USK_INO, _USK_STATE, _USK_NAME = 2, 4, 11

_VARINT, _FIXED64, _LENGTH, _FIXED32 = 0, 1, 2, 5


class ImageFormatError(ValueError):
    """A CRIU image file this module cannot read (truncated, or not protobuf where protobuf belongs)."""


Field = tuple[int, int, int | bytes]  # (number, wire type, value: an int for varints, raw bytes otherwise)


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(data) or shift > 63:
            raise ImageFormatError("truncated varint")
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, at


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _decode(message: bytes) -> list[Field]:
    fields: list[Field] = []
    at = 0
    while at < len(message):
        key, at = _varint(message, at)
        number, wire = key >> 3, key & 7
        if wire == _VARINT:
            value, at = _varint(message, at)
            fields.append((number, wire, value))
            continue
        if wire == _LENGTH:
            size, at = _varint(message, at)
        elif wire in (_FIXED64, _FIXED32):
            size = 8 if wire == _FIXED64 else 4
        else:
            raise ImageFormatError(f"unsupported protobuf wire type {wire}")
        if at + size > len(message):
            raise ImageFormatError("truncated field")
        fields.append((number, wire, message[at:at + size]))
        at += size
    return fields


def _encode(fields: list[Field]) -> bytes:
    out = bytearray()
    for number, wire, value in fields:
        out += _encode_varint(number << 3 | wire)
        if wire == _VARINT:
            assert isinstance(value, int)
            out += _encode_varint(value)
        else:
            assert isinstance(value, bytes)
            if wire == _LENGTH:
                out += _encode_varint(len(value))
            out += value
    return bytes(out)


def _first(fields: list[Field], number: int, default: int | bytes = 0) -> int | bytes:
    return next((value for n, _, value in fields if n == number), default)


def _file_type(entry: bytes) -> int:
    """A ``file_entry``'s ``type`` without decoding the entry: CRIU writes it first, as one byte (any other
    form is decoded). A restore reads every entry of ``files.img`` (890 for vLLM's CPU build) and only its
    sockets and regular files need decoding."""
    if len(entry) >= 2 and entry[0] == _FILE_TYPE << 3 | _VARINT and entry[1] < 0x80:
        return entry[1]
    return int(_first(_decode(entry), _FILE_TYPE))


def _read_entries(path: Path) -> tuple[bytes, list[bytes]]:
    data = path.read_bytes()
    if len(data) < 8:
        raise ImageFormatError(f"{path.name}: too short for a CRIU image")
    header, entries, at = data[:8], [], 8
    while at < len(data):
        if at + 4 > len(data):
            raise ImageFormatError(f"{path.name}: truncated entry length")
        (size,) = struct.unpack_from("<I", data, at)
        at += 4
        if at + size > len(data):
            raise ImageFormatError(f"{path.name}: truncated entry")
        entries.append(data[at:at + size])
        at += size
    return header, entries


@dataclass(frozen=True)
class InetSocket:
    """An inet socket of the image: ``family`` 2 (IPv4) or 10 (IPv6), ``kind`` 1 (stream) or 2 (datagram),
    ``state`` the kernel's TCP state (10 listening, 7 closed/unconnected, 1 established...)."""

    ino: int
    family: int
    kind: int
    state: int
    src_port: int
    dst_port: int
    src_addr: bytes  # the address, packed (4 or 16 bytes)
    dst_addr: bytes = b""  # the peer's (a connection's), packed; empty when unconnected

    LISTEN = 10
    CLOSE = 7

    @property
    def bound(self) -> bool:
        """Holds a local port that is its own (listening, or a bound unconnected socket) — not a connection's."""
        return self.src_port != 0 and (self.state == self.LISTEN or (self.state == self.CLOSE and self.dst_port == 0))


@dataclass(frozen=True)
class UnixSocket:
    ino: int
    state: int
    name: bytes  # b"\\0..." for an abstract name, a path otherwise, b"" unbound

    @property
    def abstract(self) -> bool:
        return self.name[:1] == b"\0"


def _address(fields: list[Field], number: int) -> tuple[bytes, bool]:
    """The packed address of field ``number`` (src_addr or dst_addr), and whether it was written packed."""
    values = [value for n, wire, value in fields if n == number]
    packed = len(values) == 1 and isinstance(values[0], bytes)  # a packed repeated field
    words: list[int] = []
    for value in values:
        if isinstance(value, bytes):
            at = 0
            while at < len(value):
                word, at = _varint(value, at)
                words.append(word)
        else:
            words.append(value)
    # CRIU stores the address as the kernel's 32-bit words, in memory (network) order.
    return b"".join(struct.pack("<I", w) for w in words), packed


def _address_fields(number: int, address: bytes, packed: bool) -> list[Field]:
    words = [struct.unpack("<I", address[at:at + 4])[0] for at in range(0, len(address), 4)]
    if packed:
        return [(number, _LENGTH, b"".join(_encode_varint(w) for w in words))]
    return [(number, _VARINT, w) for w in words]


def _inet(fields: list[Field]) -> InetSocket:
    ino, family, kind, state, src_port, dst_port = (int(_first(fields, n)) for n in (
        _ISK_INO, _ISK_FAMILY, _ISK_TYPE, _ISK_STATE, _ISK_SRC_PORT, _ISK_DST_PORT))
    return InetSocket(ino, family, kind, state, src_port, dst_port, _address(fields, _ISK_SRC_ADDR)[0],
                      _address(fields, _ISK_DST_ADDR)[0])


def _readdressed(fields: list[Field], addresses: dict[bytes, bytes]) -> list[Field]:
    """``fields`` of an inet socket with its source and destination addresses mapped by ``addresses``
    (packed old → packed new, the same length), each written in the form it had."""
    for number in (_ISK_SRC_ADDR, _ISK_DST_ADDR):
        address, packed = _address(fields, number)
        if address in addresses:
            if len(addresses[address]) != len(address):
                raise ValueError(f"cannot map a {len(address)}-byte address onto a {len(addresses[address])}-byte one")
            first = next(i for i, (n, _, _) in enumerate(fields) if n == number)
            fields = [*[f for f in fields[:first] if f[0] != number], *_address_fields(number, addresses[address], packed),
                      *[f for f in fields[first:] if f[0] != number]]
    return fields


def _unix(fields: list[Field]) -> UnixSocket:
    name = _first(fields, _USK_NAME, b"")
    return UnixSocket(int(_first(fields, _USK_INO)), int(_first(fields, _USK_STATE)),
                      name if isinstance(name, bytes) else b"")


def read_sockets(images: Path) -> tuple[list[InetSocket], list[UnixSocket]]:
    """The inet and unix sockets recorded in ``images/files.img``."""
    path = images / FILES_IMAGE
    inet: list[InetSocket] = []
    unix: list[UnixSocket] = []
    for entry in _read_entries(path)[1]:
        kind = _file_type(entry)
        if kind == _INETSK:
            inet.append(_inet(_decode(_nested(_decode(entry), _FILE_ISK, path))))
        elif kind == _UNIXSK:
            unix.append(_unix(_decode(_nested(_decode(entry), _FILE_USK, path))))
    return inet, unix


def _nested(fields: list[Field], number: int, path: Path) -> bytes:
    value = _first(fields, number, b"")
    if not isinstance(value, bytes):
        raise ImageFormatError(f"{path.name}: field {number} is not a message")
    return value


def ghost_file_ids(images: Path) -> set[int]:
    """The regular files the image carries as ghosts (deleted while open: their bytes are in the image), by
    file id (``remap-fpath.img``; none without it)."""
    path = images / REMAP_IMAGE
    if not path.is_file():
        return set()
    found = set()
    for entry in _read_entries(path)[1]:
        fields = _decode(entry)
        if _first(fields, _REMAP_TYPE) == _REMAP_GHOST:
            found.add(int(_first(fields, _REMAP_ORIG_ID)))
    return found


@dataclass(frozen=True)
class RegularFile:
    """A file of the host the image opens by path at restore (an open descriptor or a mapping): what CRIU
    checks there — its ``size`` (recorded unless it was open write-only for appending) and ``mode``."""

    name: str
    flags: int
    size: int | None
    mode: int | None


def read_regular_files(images: Path) -> list[RegularFile]:
    """The regular-file entries of ``images/files.img`` that CRIU opens on the host at restore: not the
    ones it re-creates or links from the image (ghosts and other remapped files, ``remap-fpath.img``) and
    not external ones (``ext``: handed in by the caller)."""
    path = images / FILES_IMAGE
    remapped = _remapped_ids(images)
    found = []
    for entry in _read_entries(path)[1]:
        if _file_type(entry) != _REG:
            continue
        reg = _decode(_nested(_decode(entry), _FILE_REG, path))
        name = _first(reg, _REG_NAME, b"")
        if int(_first(reg, _REG_ID)) in remapped or _first(reg, _REG_EXT) or not isinstance(name, bytes):
            continue
        numbers = {n for n, _, _ in reg}
        found.append(RegularFile(name.decode(errors="surrogateescape"), int(_first(reg, _REG_FLAGS)),
                                 int(_first(reg, _REG_SIZE)) if _REG_SIZE in numbers else None,
                                 int(_first(reg, _REG_MODE)) if _REG_MODE in numbers else None))
    return found


def _remapped_ids(images: Path) -> set[int]:
    path = images / REMAP_IMAGE
    if not path.is_file():
        return set()
    return {int(_first(_decode(entry), _REMAP_ORIG_ID)) for entry in _read_entries(path)[1]}


def rewrite_sockets(source: Path, target: Path, ports: Callable[[InetSocket], tuple[int | None, int | None]],
                    unix_names: dict[bytes, bytes], ghost_suffix: bytes = b"",
                    addresses: dict[bytes, bytes] | None = None) -> int:
    """Copy ``source/files.img`` to ``target/files.img`` with each inet socket's source and destination
    ports replaced by ``ports(socket)`` (``None``: kept) and each unix socket named in ``unix_names``
    renamed; with ``ghost_suffix``, each ghost file's path gets it too; with ``addresses`` (packed old →
    packed new), each inet socket's source and destination address mapped (a unit restored onto another
    host: a listener bound to the captured host's address cannot bind there, CRIU's "Cannot assign
    requested address"). Returns how many entries changed. Every other byte of every entry is kept as it was.

    Why ghosts: CRIU re-creates a file deleted while open at ``<its path>.cr.<id>.ghost`` (exclusively)
    and links it at its path while it opens it, then removes both — so two restores of one image at once
    collide there ("Can't create ghost regfile: File exists"; seen with two vLLM replicas). Under another
    name, each restore has its own; the process holds a deleted file either way."""
    header, entries = _read_entries(source / FILES_IMAGE)
    ghosts = ghost_file_ids(source) if ghost_suffix else set()
    changed = 0
    out = bytearray(header)
    for entry in entries:
        kind = _file_type(entry)
        if kind not in (_REG, _INETSK, _UNIXSK) or (kind == _REG and not ghosts):
            out += struct.pack("<I", len(entry)) + entry
            continue
        new_entry = entry
        fields = _decode(entry)
        if kind == _REG:
            reg = _decode(_nested(fields, _FILE_REG, source / FILES_IMAGE))
            if int(_first(reg, _REG_ID)) in ghosts:
                renamed = [(n, w, v + ghost_suffix if n == _REG_NAME and isinstance(v, bytes) else v) for n, w, v in reg]
                changed += 1
                new_entry = _encode([(n, w, _encode(renamed) if n == _FILE_REG else v) for n, w, v in fields])
        elif kind in (_INETSK, _UNIXSK):
            number = _FILE_ISK if kind == _INETSK else _FILE_USK
            inner = _decode(_nested(fields, number, source / FILES_IMAGE))
            if kind == _INETSK:
                src, dst = ports(_inet(inner))
                wanted = {n: p for n, p in ((_ISK_SRC_PORT, src), (_ISK_DST_PORT, dst)) if p is not None}
                replacement: list[Field] = [(n, w, wanted.get(n, v)) for n, w, v in inner]
                if addresses:
                    replacement = _readdressed(replacement, addresses)
            else:
                name = _unix(inner).name
                replacement = [(n, w, unix_names[name] if n == _USK_NAME and name in unix_names else v)
                               for n, w, v in inner]
            if replacement != inner:
                changed += 1
                new_entry = _encode([(n, w, _encode(replacement) if n == number else v) for n, w, v in fields])
        out += struct.pack("<I", len(new_entry)) + new_entry
    (target / FILES_IMAGE).write_bytes(bytes(out))
    return changed

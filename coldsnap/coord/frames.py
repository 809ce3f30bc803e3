"""CSKV version 1 wire frames: one ZeroMQ message part per frame.

    offset  size  field
    0       4     magic  b"CSKV"
    4       1     version (1)
    5       1     kind   (1 hello, 2 barrier, 3 put, 4 get, 5 bye, 6 heartbeat, 7 abort, 16 ok,
                  17 value, 18 error)
    6       2     flags  (0; reserved)
    8       4     rank   (u32; the sender's rank, or the addressed rank in replies)
    12      8     sequence (u64; per connection and direction, from 0, no gaps)
    20      4     body length (u32)
    24      n     body: canonical JSON object (integers only: timeouts travel as ``timeout_ms``)
    24+n    32    HMAC-SHA256 over bytes [0, 24+n) keyed with the activation token

All integers are little-endian. A frame whose magic, version, length, HMAC or sequence is wrong, or
that is larger than MAX_FRAME_BYTES, is dropped (and logged) before anything reads its body.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import json
import struct
from dataclasses import dataclass
from typing import Any

from coldsnap.contracts.canonical import canonical_json

__all__ = ["CSKV_VERSION", "Kind", "Frame", "FrameError", "encode_frame", "decode_frame", "MAX_VALUE_BYTES", "MAX_FRAME_BYTES"]

CSKV_VERSION = 1
MAGIC = b"CSKV"
_HEADER = struct.Struct("<4sBBHIQI")
MAC_BYTES = 32
MAX_VALUE_BYTES = 64 * 1024
# A value travels as a JSON string (base64 would grow it by 4/3; strings are UTF-8 text here) plus
# the key and the framing: generous, but a bound.
MAX_FRAME_BYTES = 4 * MAX_VALUE_BYTES + 4096


class Kind(enum.IntEnum):
    HELLO = 1
    BARRIER = 2
    PUT = 3
    GET = 4
    BYE = 5
    HEARTBEAT = 6
    ABORT = 7
    OK = 16
    VALUE = 17
    ERROR = 18


class FrameError(ValueError):
    """A frame that must not be acted on; the message says why."""


@dataclass(frozen=True)
class Frame:
    kind: Kind
    rank: int
    sequence: int
    body: dict[str, Any]


def encode_frame(frame: Frame, token: bytes) -> bytes:
    body = canonical_json(frame.body)
    head = _HEADER.pack(MAGIC, CSKV_VERSION, int(frame.kind), 0, frame.rank, frame.sequence, len(body))
    unsigned = head + body
    return unsigned + hmac.new(token, unsigned, hashlib.sha256).digest()


def decode_frame(data: bytes, token: bytes) -> Frame:
    """Check and decode one frame; raises :class:`FrameError` for anything not to be trusted."""
    if len(data) > MAX_FRAME_BYTES:
        raise FrameError(f"frame of {len(data)} bytes exceeds {MAX_FRAME_BYTES}")
    if len(data) < _HEADER.size + MAC_BYTES:
        raise FrameError(f"frame of {len(data)} bytes is shorter than a header and a MAC")
    magic, version, kind, flags, rank, sequence, length = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise FrameError("bad magic")
    if version != CSKV_VERSION:
        raise FrameError(f"CSKV version {version} is not supported (supported: {CSKV_VERSION})")
    if _HEADER.size + length + MAC_BYTES != len(data):
        raise FrameError("body length does not match the frame size")
    unsigned, mac = data[:-MAC_BYTES], data[-MAC_BYTES:]
    if not hmac.compare_digest(mac, hmac.new(token, unsigned, hashlib.sha256).digest()):
        raise FrameError("bad HMAC (wrong token or altered frame)")
    # Only authenticated bytes are parsed from here on.
    if flags != 0:
        raise FrameError(f"unknown flags {flags:#x}")
    try:
        frame_kind = Kind(kind)
    except ValueError:
        raise FrameError(f"unknown frame kind {kind}") from None
    try:
        body = json.loads(data[_HEADER.size:_HEADER.size + length])
    except (ValueError, UnicodeDecodeError):
        raise FrameError("body is not JSON") from None
    if not isinstance(body, dict):
        raise FrameError("body is not a JSON object")
    return Frame(frame_kind, rank, sequence, body)

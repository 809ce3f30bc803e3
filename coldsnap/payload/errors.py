"""Typed errors of the native pack, its residual and its validation record.

Every error is a :class:`PackError` (a ``ValueError``: the input is wrong, not the program) with a
one-line message that names the file and what is wrong with it.
"""

from __future__ import annotations

__all__ = [
    "PackError",
    "PackUnreadable",
    "PackBadMagic",
    "PackUnsupportedVersion",
    "PackTruncated",
    "PackCorrupt",
    "PackPlanInvalid",
    "PackLayoutMismatch",
    "PackDigestMismatch",
    "ExpectedDigestError",
    "ExtentOutOfRegion",
    "RegionTooSmall",
    "CoverError",
]


class PackError(ValueError):
    """Base of every native-pack error."""


class PackUnreadable(PackError):
    """The file cannot be opened, read or stat'ed (missing, a directory, no permission)."""

    def __init__(self, path: str, reason: str):
        self.path = path
        self.reason = reason
        super().__init__(f"{path}: cannot read: {reason}")


class PackBadMagic(PackError):
    """The file does not start with the native pack magic: it is not a pack at all."""

    def __init__(self, path: str, found: bytes, expected: bytes):
        self.path = path
        self.found = found
        super().__init__(f"{path}: not a coldsnap native pack (magic {found!r}, expected {expected!r})")


class PackUnsupportedVersion(PackError):
    """The pack's format version is not one this build reads."""

    def __init__(self, path: str, version: int, supported: tuple[int, ...]):
        self.path = path
        self.version = version
        self.supported = supported
        listed = ", ".join(str(v) for v in supported)
        super().__init__(f"{path}: unsupported pack format version {version} (supported: {listed})")


class PackTruncated(PackError):
    """The file is shorter than its header says it must be."""

    def __init__(self, path: str, what: str, expected: int, actual: int):
        self.path = path
        self.what = what
        self.expected = expected
        self.actual = actual
        super().__init__(f"{path}: truncated: {what} needs {expected} bytes, the file has {actual}")


class PackCorrupt(PackError):
    """The header or extents table is inconsistent (checksum mismatch, invalid table, bad field)."""

    def __init__(self, path: str, reason: str):
        self.path = path
        self.reason = reason
        super().__init__(f"{path}: corrupt pack: {reason}")


class PackPlanInvalid(PackError):
    """``write_pack`` was given extents that cannot form a valid pack (overlap, bad tag, bad digest)."""


class PackLayoutMismatch(PackError):
    """The pack was cut from another memory layout than the one it is about to be hydrated into."""

    def __init__(self, path: str, pack_digest: str, expected_digest: str):
        self.path = path
        self.pack_digest = pack_digest
        self.expected_digest = expected_digest
        super().__init__(f"{path}: cut from layout {pack_digest}, not the expected layout {expected_digest}")


class PackDigestMismatch(PackError):
    """The file's SHA-256 is not the expected one: it was changed, truncated or never was that file."""

    def __init__(self, path: str, expected: str, actual: str):
        self.path = path
        self.expected = expected
        self.actual = actual
        super().__init__(f"{path}: SHA-256 mismatch: expected {expected}, file has {actual}")


class ExpectedDigestError(PackError):
    """No expected SHA-256 is known for a file (its name is not ``<sha256>.pack``), or it is malformed."""


class ExtentOutOfRegion(PackError):
    """An extent does not fit the region it must be hydrated into (the region is absent or too small)."""


class RegionTooSmall(ExtentOutOfRegion):
    """A region is smaller than the pack's extents in it need."""

    def __init__(self, path: str, tag: str, needed: int, have: int):
        self.path = path
        self.tag = tag
        self.needed = needed
        self.have = have
        super().__init__(f"{path}: region {tag!r} has {have} bytes, the pack's extents need {needed}")


class CoverError(PackError):
    """Payload and residual do not cover the preserved allocations exactly once."""

"""Native payload: the content-addressed pack format, the residual rule and the one verifier.

- :mod:`coldsnap.payload.pack`: the versioned binary pack (:class:`NativePack`, :func:`write_pack`);
- :mod:`coldsnap.payload.residual`: the stable bytes not in the payload, and the exact-cover check;
- :mod:`coldsnap.payload.validation`: :func:`verify_file` and ``.coldsnap-validation.json``.

Engine-neutral: nothing here imports torch or touches a GPU.
"""

from coldsnap.payload.errors import (
    CoverError,
    ExpectedDigestError,
    ExtentOutOfRegion,
    PackBadMagic,
    PackCorrupt,
    PackDigestMismatch,
    PackError,
    PackLayoutMismatch,
    PackPlanInvalid,
    PackTruncated,
    PackUnreadable,
    PackUnsupportedVersion,
    RegionTooSmall,
)
from coldsnap.payload.pack import (
    SUPPORTED_PACK_VERSIONS,
    HydrationCopy,
    NativePack,
    PackExtent,
    PackKind,
    PackTable,
    PlannedExtent,
    WrittenPack,
    write_pack,
)
from coldsnap.payload.residual import check_cover, plan_residual, residual_extents
from coldsnap.payload.validation import Verification, verify_file

__all__ = [
    "SUPPORTED_PACK_VERSIONS",
    "CoverError",
    "ExpectedDigestError",
    "ExtentOutOfRegion",
    "HydrationCopy",
    "NativePack",
    "PackBadMagic",
    "PackCorrupt",
    "PackDigestMismatch",
    "PackError",
    "PackExtent",
    "PackKind",
    "PackLayoutMismatch",
    "PackPlanInvalid",
    "PackTable",
    "PackTruncated",
    "PackUnreadable",
    "PackUnsupportedVersion",
    "PlannedExtent",
    "RegionTooSmall",
    "Verification",
    "WrittenPack",
    "check_cover",
    "plan_residual",
    "residual_extents",
    "verify_file",
    "write_pack",
]

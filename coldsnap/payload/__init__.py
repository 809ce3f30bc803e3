"""Native payload: the content-addressed pack format, the residual rule and the one verifier.

- :mod:`coldsnap.payload.pack`: the versioned binary pack's format; :mod:`coldsnap.payload.pack_reader` reads one
  (:class:`NativePack`), :mod:`coldsnap.payload.pack_writer` writes one (:func:`write_pack`);
- :mod:`coldsnap.payload.residual`: the stable bytes not in the payload, and the exact-cover check;
- :mod:`coldsnap.payload.validation`: :func:`verify_file` and ``.coldsnap-validation.json``;
- :mod:`coldsnap.payload.records`: when such a record vouches for a file (standard library only).

Engine-neutral: nothing here imports torch or touches a GPU.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the names below are, for type checkers
    from coldsnap.payload.errors import (
        CoverError, ExpectedDigestError, ExtentOutOfRegion, PackBadMagic, PackCorrupt, PackDigestMismatch,
        PackError, PackLayoutMismatch, PackPlanInvalid, PackTruncated, PackUnreadable, PackUnsupportedVersion,
        RegionTooSmall)
    from coldsnap.payload.pack import SUPPORTED_PACK_VERSIONS, PackExtent, PackKind, PackTable
    from coldsnap.payload.pack_reader import HydrationCopy, NativePack
    from coldsnap.payload.pack_writer import PlannedExtent, WrittenPack, write_pack
    from coldsnap.payload.residual import check_cover, plan_residual, residual_extents
    from coldsnap.payload.validation import Verification, verify_file

# Re-exports load their module on first use (PEP 562): a restore's first step reads validation records
# (coldsnap.payload.records) before pydantic, which the pack and validation modules build models with,
# is imported.
_MODULE_EXPORTS = {
    "errors": ("CoverError", "ExpectedDigestError", "ExtentOutOfRegion", "PackBadMagic", "PackCorrupt",
        "PackDigestMismatch", "PackError", "PackLayoutMismatch", "PackPlanInvalid", "PackTruncated",
        "PackUnreadable", "PackUnsupportedVersion", "RegionTooSmall"),
    "pack": ("SUPPORTED_PACK_VERSIONS", "PackExtent", "PackKind", "PackTable"),
    "pack_reader": ("HydrationCopy", "NativePack"),
    "pack_writer": ("PlannedExtent", "WrittenPack", "write_pack"),
    "residual": ("check_cover", "plan_residual", "residual_extents"),
    "validation": ("Verification", "verify_file"),
}
_EXPORTS = {name: module for module, names in _MODULE_EXPORTS.items() for name in names}

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


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value

"""Contracts: the documents coldsnap exchanges with managers, strictly decoded and canonically hashed.

This package imports neither torch nor an engine.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the names below are, for type checkers
    from coldsnap.contracts.artifact import ARTIFACT_FORMAT, ArtifactDescriptor
    from coldsnap.contracts.base import Contract, ContractError, decode_document, load_document
    from coldsnap.contracts.canonical import CanonicalJsonError, canonical_json, canonical_sha256
    from coldsnap.contracts.capabilities import Capabilities, build_capabilities
    from coldsnap.contracts.layout import MemoryLayout, SemanticManifest
    from coldsnap.contracts.profiles import SNAPSHOT_DRIVERS, UnsupportedRequest, resolve_request
    from coldsnap.contracts.receipt import RECEIPT_FORMAT, Clock, OperationReceipt, Span, TimingEnvelope
    from coldsnap.contracts.request import REQUEST_FORMAT, OperationRequest
    from coldsnap.contracts.timing_events import TIMING_EVENT_ADAPTER, TIMING_EVENT_FORMAT

# Re-exports load their module on first use (PEP 562): a restore must not pay for building the models of
# capabilities or timing events it never touches.
_EXPORTS = {
    "ARTIFACT_FORMAT": "artifact", "ArtifactDescriptor": "artifact",
    "Contract": "base", "ContractError": "base", "decode_document": "base", "load_document": "base",
    "CanonicalJsonError": "canonical", "canonical_json": "canonical", "canonical_sha256": "canonical",
    "Capabilities": "capabilities", "build_capabilities": "capabilities",
    "MemoryLayout": "layout", "SemanticManifest": "layout",
    "SNAPSHOT_DRIVERS": "profiles", "UnsupportedRequest": "profiles", "resolve_request": "profiles",
    "RECEIPT_FORMAT": "receipt", "Clock": "receipt", "OperationReceipt": "receipt", "Span": "receipt",
    "TimingEnvelope": "receipt",
    "REQUEST_FORMAT": "request", "OperationRequest": "request",
    "TIMING_EVENT_ADAPTER": "timing_events", "TIMING_EVENT_FORMAT": "timing_events",
}

__all__ = [
    "ARTIFACT_FORMAT",
    "REQUEST_FORMAT",
    "RECEIPT_FORMAT",
    "TIMING_EVENT_FORMAT",
    "TIMING_EVENT_ADAPTER",
    "ArtifactDescriptor",
    "Capabilities",
    "CanonicalJsonError",
    "Clock",
    "Contract",
    "ContractError",
    "MemoryLayout",
    "OperationReceipt",
    "OperationRequest",
    "SNAPSHOT_DRIVERS",
    "SemanticManifest",
    "Span",
    "TimingEnvelope",
    "UnsupportedRequest",
    "build_capabilities",
    "canonical_json",
    "canonical_sha256",
    "decode_document",
    "load_document",
    "resolve_request",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'coldsnap.contracts' has no attribute {name!r}")
    return getattr(importlib.import_module(f"coldsnap.contracts.{module}"), name)

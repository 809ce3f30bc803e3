"""Contracts: the documents coldsnap exchanges with managers, strictly decoded and canonically hashed.

This package imports neither torch nor an engine.
"""

from coldsnap.contracts.artifact import ARTIFACT_FORMAT, ArtifactDescriptor
from coldsnap.contracts.base import Contract, ContractError, decode_document, load_document
from coldsnap.contracts.canonical import CanonicalJsonError, canonical_json, canonical_sha256
from coldsnap.contracts.capabilities import Capabilities, build_capabilities
from coldsnap.contracts.layout import MemoryLayout, SemanticManifest
from coldsnap.contracts.profiles import SNAPSHOT_DRIVERS, UnsupportedRequest, resolve_request
from coldsnap.contracts.receipt import RECEIPT_FORMAT, Clock, OperationReceipt, Span, TimingEnvelope
from coldsnap.contracts.request import REQUEST_FORMAT, OperationRequest
from coldsnap.contracts.timing_events import TIMING_EVENT_ADAPTER, TIMING_EVENT_FORMAT

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

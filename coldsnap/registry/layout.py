"""How an artifact directory maps onto OCI manifests (the shapes :mod:`.publish` writes and :mod:`.pull`
reads), and the strict reading of what a registry hands back."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter, ValidationError

from coldsnap.contracts.artifact import RelativePath
from coldsnap.registry.client import sha256_digest

__all__ = [
    "ARTIFACT_TYPE",
    "DESCRIPTOR_TYPE",
    "CAPSULE_TYPE",
    "PACK_TYPE",
    "INDEX_MEDIA_TYPE",
    "MANIFEST_MEDIA_TYPE",
    "EMPTY_CONFIG",
    "Blob",
    "CHUNK_TYPE",
    "Chunk",
    "LayoutError",
    "chunked_pack_manifest_bytes",
    "manifest_bytes",
    "index_bytes",
    "read_index",
    "read_manifest",
]

INDEX_MEDIA_TYPE = "application/vnd.oci.image.index.v1+json"
MANIFEST_MEDIA_TYPE = "application/vnd.oci.image.manifest.v1+json"
ARTIFACT_TYPE = "application/vnd.coldsnap.artifact.v1"
"""The image index that binds one artifact: its digest is what ``coldsnap publish`` prints."""
DESCRIPTOR_TYPE = "application/vnd.coldsnap.descriptor.v1"
CAPSULE_TYPE = "application/vnd.coldsnap.capsule.v1"
PACK_TYPE = "application/vnd.coldsnap.pack.v1"
DESCRIPTOR_CONFIG_TYPE = "application/vnd.coldsnap.artifact-descriptor.v9+json"
CAPSULE_CONFIG_TYPE = "application/vnd.coldsnap.capsule-manifest.v1+json"
FILE_TYPE = "application/vnd.coldsnap.file.v1"
CHUNK_TYPE = "application/vnd.coldsnap.pack.chunk.v1"
"""A layer of a pack manifest that is one fixed-size piece of the pack (its offset annotated)."""
EMPTY_CONFIG_TYPE = "application/vnd.oci.empty.v1+json"
EMPTY_CONFIG = b"{}"
TITLE = "org.opencontainers.image.title"
MODE = "vnd.coldsnap.file.mode"
PACK_SHA256 = "vnd.coldsnap.pack.sha256"
PACK_SIZE = "vnd.coldsnap.pack.size"
CHUNK_OFFSET = "vnd.coldsnap.chunk.offset"

_relative_path: TypeAdapter[str] = TypeAdapter(RelativePath)


class LayoutError(ValueError):
    """A manifest that is not one coldsnap published; the message says what is wrong."""


@dataclass(frozen=True)
class Chunk:
    """``size`` bytes of a pack at ``offset``, published as their own blob ``digest`` (``sha256:<hex>``)."""

    offset: int
    digest: str
    size: int


@dataclass(frozen=True)
class Blob:
    """One file of the artifact as a blob: where it goes, its digest (``sha256:<hex>``), size, mode. A
    chunked pack is one file of several blobs: ``chunks``, in order, cover its bytes exactly, and its
    ``digest`` (the pack's SHA-256, as the descriptor binds it) is no blob of its own."""

    path: str
    digest: str
    size: int
    mode: int = 0o644
    media_type: str = FILE_TYPE
    chunks: tuple[Chunk, ...] = ()

    def descriptor(self) -> dict[str, Any]:
        return {"mediaType": self.media_type, "digest": self.digest, "size": self.size,
                "annotations": {TITLE: self.path, MODE: f"{self.mode:04o}"}}


def _canonical(value: Any) -> bytes:
    """Deterministic bytes: the same artifact publishes the same manifests (a second publish finds
    them all present)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def manifest_bytes(artifact_type: str, config: Blob | None, layers: list[Blob], annotations: dict[str, str]) -> bytes:
    config_descriptor = (config.descriptor() if config is not None else
                         {"mediaType": EMPTY_CONFIG_TYPE, "digest": _empty_digest(), "size": len(EMPTY_CONFIG)})
    return _canonical({"schemaVersion": 2, "mediaType": MANIFEST_MEDIA_TYPE, "artifactType": artifact_type,
                       "config": config_descriptor, "layers": [layer.descriptor() for layer in layers],
                       "annotations": annotations})


def chunked_pack_manifest_bytes(pack: Blob) -> bytes:
    """A pack's manifest with one layer per chunk: each layer's digest is its chunk's SHA-256 and says where
    in the pack it goes; the manifest names the pack's own SHA-256 and size. The index pins this manifest,
    so it binds every chunk's digest to the pack the descriptor names."""
    layers = [{"mediaType": CHUNK_TYPE, "digest": c.digest, "size": c.size,
               "annotations": {TITLE: pack.path, MODE: f"{pack.mode:04o}", CHUNK_OFFSET: str(c.offset)}}
              for c in pack.chunks]
    return _canonical({"schemaVersion": 2, "mediaType": MANIFEST_MEDIA_TYPE, "artifactType": PACK_TYPE,
                       "config": {"mediaType": EMPTY_CONFIG_TYPE, "digest": _empty_digest(), "size": len(EMPTY_CONFIG)},
                       "layers": layers,
                       "annotations": {PACK_SHA256: pack.digest[7:], PACK_SIZE: str(pack.size)}})


def index_bytes(manifests: list[tuple[bytes, str, dict[str, str]]], annotations: dict[str, str]) -> bytes:
    """The image index over (manifest bytes, artifact type, annotations)."""
    return _canonical({"schemaVersion": 2, "mediaType": INDEX_MEDIA_TYPE, "artifactType": ARTIFACT_TYPE,
                       "manifests": [{"mediaType": MANIFEST_MEDIA_TYPE, "artifactType": kind, "digest": sha256_digest(data),
                                      "size": len(data), "annotations": notes} for data, kind, notes in manifests],
                       "annotations": annotations})


def _empty_digest() -> str:
    return sha256_digest(EMPTY_CONFIG)


def _json(data: bytes, what: str) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except ValueError:
        raise LayoutError(f"{what} is not JSON") from None
    if not isinstance(value, dict):
        raise LayoutError(f"{what} is not a JSON object")
    return value


def _descriptor(value: Any, what: str) -> tuple[str, int]:
    if not isinstance(value, dict):
        raise LayoutError(f"{what}: not an OCI descriptor")
    digest, size = value.get("digest"), value.get("size")
    if not isinstance(digest, str) or not digest.startswith("sha256:") or len(digest) != 71 \
            or not isinstance(size, int) or size < 0:
        raise LayoutError(f"{what}: needs a sha256 digest and a size")
    return digest, size


def read_index(data: bytes, what: str) -> list[tuple[str, int, str]]:
    """The (digest, size, artifact type) of every manifest of a coldsnap artifact index."""
    index = _json(data, what)
    if index.get("artifactType") != ARTIFACT_TYPE:
        raise LayoutError(f"{what} is not a coldsnap artifact (artifactType {index.get('artifactType')!r}, "
                          f"expected {ARTIFACT_TYPE}); publish one with `coldsnap publish DIR REF`")
    manifests = index.get("manifests")
    if not isinstance(manifests, list) or not manifests:
        raise LayoutError(f"{what}: lists no manifests")
    entries = []
    for n, entry in enumerate(manifests):
        digest, size = _descriptor(entry, f"{what} manifest {n}")
        kind = entry.get("artifactType")
        if kind not in (DESCRIPTOR_TYPE, CAPSULE_TYPE, PACK_TYPE):
            raise LayoutError(f"{what} manifest {n}: unknown artifactType {kind!r}")
        entries.append((digest, size, kind))
    if sum(kind == DESCRIPTOR_TYPE for _, _, kind in entries) != 1:
        raise LayoutError(f"{what}: needs exactly one descriptor manifest")
    return entries


def read_manifest(data: bytes, kind: str, what: str) -> list[Blob]:
    """Every file a coldsnap manifest carries (its config too, unless it is the empty config)."""
    manifest = _json(data, what)
    if manifest.get("artifactType") != kind:
        raise LayoutError(f"{what}: artifactType {manifest.get('artifactType')!r}, expected {kind}")
    layers = manifest.get("layers")
    if not isinstance(layers, list):
        raise LayoutError(f"{what}: no layers")
    described: list[Any] = [manifest.get("config"), *layers]
    blobs = []
    for n, entry in enumerate(described):
        digest, size = _descriptor(entry, f"{what} {'config' if n == 0 else f'layer {n - 1}'}")
        assert isinstance(entry, dict)  # _descriptor checked it
        if n == 0 and entry.get("mediaType") == EMPTY_CONFIG_TYPE:
            continue
        notes = entry.get("annotations") or {}
        try:
            path = _relative_path.validate_python(notes.get(TITLE))
            mode = int(notes.get(MODE, "0644"), 8)
        except (ValidationError, TypeError, ValueError):
            raise LayoutError(f"{what}: entry {n} has no valid {TITLE} (a relative path) or {MODE}") from None
        if mode & ~0o777:
            raise LayoutError(f"{what}: {path} has mode {mode:o}: only permission bits travel")
        blobs.append(Blob(path, digest, size, mode, entry.get("mediaType") or FILE_TYPE))
    if kind == PACK_TYPE and any(b.media_type == CHUNK_TYPE for b in blobs):
        return [_chunked_pack(manifest, layers, blobs, what)]
    return blobs


def _chunked_pack(manifest: dict[str, Any], layers: list[Any], blobs: list[Blob], what: str) -> Blob:
    """The one file a chunked pack manifest carries: its chunks must all be chunks of one path, cover it
    from 0 without gap or overlap, and add up to the size it names."""
    notes = manifest.get("annotations") or {}
    sha256, size = notes.get(PACK_SHA256), notes.get(PACK_SIZE)
    if not isinstance(sha256, str) or len(sha256) != 64 or not all(c in "0123456789abcdef" for c in sha256) \
            or not isinstance(size, str) or not size.isdigit():
        raise LayoutError(f"{what}: a chunked pack needs {PACK_SHA256} (64 hex digits) and {PACK_SIZE}")
    if {b.media_type for b in blobs} != {CHUNK_TYPE} or len({(b.path, b.mode) for b in blobs}) != 1:
        raise LayoutError(f"{what}: a chunked pack's layers must all be chunks of one file")
    chunks, expected = [], 0
    for n, (layer, blob) in enumerate(zip(layers, blobs)):
        offset = (layer.get("annotations") or {}).get(CHUNK_OFFSET)
        if not isinstance(offset, str) or not offset.isdigit() or int(offset) != expected or blob.size == 0:
            raise LayoutError(f"{what}: chunk {n} is not at offset {expected}, where the chunks before it end")
        chunks.append(Chunk(expected, blob.digest, blob.size))
        expected += blob.size
    if expected != int(size):
        raise LayoutError(f"{what}: the chunks hold {expected} bytes, the pack {size}")
    return Blob(blobs[0].path, "sha256:" + sha256, expected, blobs[0].mode, PACK_TYPE, tuple(chunks))

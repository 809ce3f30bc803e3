"""``[oci://]REGISTRY/REPOSITORY[:TAG][@sha256:DIGEST]``: where an artifact is published."""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["OCI_SCHEME", "Reference", "BadReference", "parse_reference"]

OCI_SCHEME = "oci://"
_REPOSITORY = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_REGISTRY = re.compile(r"(?:localhost|[A-Za-z0-9.-]+\.[A-Za-z0-9.-]+|\[[0-9A-Fa-f:]+\]|[A-Za-z0-9.-]+)(?::[0-9]{1,5})?")


class BadReference(ValueError):
    """Not a reference coldsnap can publish to or pull from; the message says what is wrong."""


@dataclass(frozen=True)
class Reference:
    registry: str
    """``host[:port]`` as written."""
    repository: str
    tag: str | None = None
    digest: str | None = None
    """``sha256:<hex>``: the descriptor artifact's digest, which pins every byte of the artifact."""

    @property
    def pinned(self) -> str:
        """What to ask the registry for: the digest when known, else the tag."""
        return self.digest or self.tag or "latest"

    def with_digest(self, digest: str) -> "Reference":
        return Reference(self.registry, self.repository, self.tag, digest)

    def __str__(self) -> str:
        text = f"{self.registry}/{self.repository}"
        if self.tag:
            text += f":{self.tag}"
        if self.digest:
            text += f"@{self.digest}"
        return text


def parse_reference(text: str) -> Reference:
    """Parse a reference; the registry must be named (no implicit Docker Hub: an artifact goes where it
    is told). Credentials never belong in it (they come from the auth files)."""
    rest = text[len(OCI_SCHEME):] if text.startswith(OCI_SCHEME) else text
    if "://" in rest:
        raise BadReference(f"{text!r}: give REGISTRY/REPOSITORY[:TAG][@sha256:DIGEST] (optionally after oci://)")
    if "@" in rest.split("/", 1)[0]:
        raise BadReference(f"{text!r}: no credentials in a reference; they come from the container auth file "
                             "(REGISTRY_AUTH_FILE, `podman login` or `docker login`)")
    digest = None
    if "@" in rest:
        rest, digest = rest.rsplit("@", 1)
        if not _DIGEST.fullmatch(digest):
            raise BadReference(f"{text!r}: the digest must be sha256: and 64 lowercase hex digits")
    registry, slash, path = rest.partition("/")
    if not slash or not path:
        raise BadReference(f"{text!r}: name the registry and the repository, e.g. registry.example.com/team/model:tag")
    if not _REGISTRY.fullmatch(registry):
        raise BadReference(f"{text!r}: {registry!r} is not a registry host[:port]")
    tag = None
    last = path.rsplit("/", 1)[-1]
    if ":" in last:
        path, tag = path.rsplit(":", 1)
        if not _TAG.fullmatch(tag):
            raise BadReference(f"{text!r}: {tag!r} is not a valid tag ([A-Za-z0-9_][A-Za-z0-9_.-]*, at most 128)")
    if not _REPOSITORY.fullmatch(path):
        raise BadReference(f"{text!r}: {path!r} is not a valid repository name (lowercase, digits, . _ - and /)")
    return Reference(registry, path, tag, digest)

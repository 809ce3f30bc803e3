"""The ``publish`` and ``pull`` commands, and the pull behind ``restore``/``warm`` of an ``oci://`` reference.

Progress goes to stderr; ``publish`` prints the pinned reference (``REGISTRY/REPO[:TAG]@sha256:…``) on stdout,
``pull`` the directory. A user mistake (a bad reference, a taken directory) exits 2, a registry or
transfer failure 1, each with one line naming what to do; nothing secret is ever printed.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from coldsnap.contracts.base import ContractError
from coldsnap.ownership import HandOver, Owner, OwnerError, resolve_owner
from coldsnap.payload.errors import PackError
from coldsnap.progress import ProgressBar
from coldsnap.registry.client import client_for
from coldsnap.registry.errors import RegistryError
from coldsnap.registry.credentials import CredentialsError
from coldsnap.registry.layout import LayoutError
from coldsnap.registry.pull import DestinationTaken, PullError, PullResult, PullSession
from coldsnap.registry.pull_staging import incomplete, lock_path, staging_dir
from coldsnap.registry.publish import publish
from coldsnap.registry.reference import OCI_SCHEME, BadReference, parse_reference

__all__ = ["CachedArtifact", "OciPullFailed", "pull_into_cache", "run_publish", "run_pull"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def _say(command: str, text: str) -> None:
    print(f"coldsnap {command}: {text}", file=sys.stderr)


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def chunk_size(text: str) -> int | None:
    """``--chunk-size``: bytes, or a number with K, M or G; None unless 64 KiB to 4 GiB and a multiple of 4 KiB."""
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = text[-1:] if text[-1:] in ("K", "M", "G") else ""
    number = text[:-1] if unit else text
    if not number.isdigit():
        return None
    size = int(number) * _UNITS[unit]
    return size if 64 << 10 <= size <= 4 << 30 and size % 4096 == 0 else None


def _secrets_allow_publishing(root: Path, allow_secrets: bool) -> bool:
    """The scan before anything is sent (:mod:`coldsnap.secrets`): a capsule that holds a secret, by its record
    or by the scan, is refused unless ``allow_secrets``; what was found is said by file, offset and kind."""
    from coldsnap.secrets.gate import secrets_of_artifact
    from coldsnap.secrets.scan import ScannerMissing

    try:
        found = secrets_of_artifact(root)
    except ScannerMissing as exc:
        if allow_secrets:
            _say("publish", f"not scanned for secrets ({exc}); publishing as --allow-secrets says")
            return True
        _say("publish", f"cannot scan {root} for secrets before publishing it: {exc} (or --allow-secrets)")
        return False
    _say("publish", f"secret scan: {found.summary()}")
    for unit in found.unrecorded:
        _say("publish", f"{unit}: captured by a build that passed its whole environment to the command; the scan "
                        "is all that speaks for it")
    if found.clean:
        return True
    for line in found.lines():
        _say("publish", f"  {line}")
    if allow_secrets:
        _say("publish", "publishing all the same (--allow-secrets): whoever can pull it can read them")
        return True
    _say("publish", f"refused: {root} holds secrets (above; values never shown). Capture it again without them "
                    "(docs/secrets.md), or publish it with --allow-secrets to a registry only trusted readers reach")
    return False


def run_publish(directory: str, reference_text: str, as_json: bool = False, chunk_text: str = "256M",
                allow_secrets: bool = False) -> int:
    root = Path(directory)
    chunk_bytes = chunk_size(chunk_text)
    if chunk_bytes is None:
        _say("publish", f"--chunk-size {chunk_text!r}: give 64K to 4G, a multiple of 4K (e.g. 256M)")
        return EXIT_USAGE
    if not (root / "artifact.json").is_file():
        _say("publish", f"{directory} is not a coldsnap artifact (no artifact.json)")
        return EXIT_USAGE
    try:
        reference = parse_reference(reference_text)
        if reference.digest:
            raise BadReference(f"{reference_text!r}: publish to a tag (or just REGISTRY/REPO); the digest is what "
                                 "publish prints")
    except BadReference as exc:
        _say("publish", str(exc))
        return EXIT_USAGE
    if not _secrets_allow_publishing(root, allow_secrets):
        return EXIT_FAILED
    bar = ProgressBar("coldsnap publish: sending")
    try:
        client = client_for(reference, push=True)
        result = publish(root, reference, client, on_progress=bar.update, log=lambda text: _say("publish", text),
                         chunk_bytes=chunk_bytes)
    except (ContractError, PackError, ValueError) as exc:
        bar.finish()
        _say("publish", f"{directory} cannot be published: {exc}")
        return EXIT_FAILED
    except (RegistryError, CredentialsError) as exc:
        bar.finish()
        _say("publish", str(exc))
        return EXIT_FAILED
    bar.finish()
    _say("publish", f"{result.blobs_sent} of {result.blobs} blobs and {result.manifests_sent} manifests sent, "
         f"{result.bytes_sent / 1e9:.2f} of {result.bytes_total / 1e9:.2f} GB, in {result.seconds:.2f} s")
    if as_json:
        sys.stdout.write(json.dumps({"reference": str(result.reference), "digest": result.digest, "blobs": result.blobs,
                                     "blobs_sent": result.blobs_sent, "bytes_total": result.bytes_total,
                                     "bytes_sent": result.bytes_sent, "manifests_sent": result.manifests_sent,
                                     "seconds": round(result.seconds, 3)}, sort_keys=True) + "\n")
    else:
        print(result.reference)
    return EXIT_OK


class OciPullFailed(Exception):
    """The pull behind an ``oci://`` restore failed; ``usage`` when the caller must fix the input."""

    def __init__(self, message: str, usage: bool = False):
        super().__init__(message)
        self.usage = usage


def _pull(reference_text: str, destination: Path, command: str, owner: Owner | str | None = None,
          stream: bool = False) -> tuple[PullResult | None, PullSession | None, HandOver]:
    """Pull into ``destination``; what the pull wrote (DIR, or on failure its staging folder, its lock file and
    the folders it made) is handed to the owner (``--owner``, else the sudo caller), whatever the outcome.
    ``stream``: return as soon as DIR holds everything but the packs' chunks, with the session still pulling
    them (its owner's hand-over then comes with :meth:`CachedArtifact.finish`)."""
    try:
        reference = parse_reference(reference_text)
        hand_over = HandOver(resolve_owner(owner))
    except (BadReference, OwnerError) as exc:
        raise OciPullFailed(str(exc), usage=True) from None
    hand_over.claim_new(destination)  # nothing when DIR is there already (the same artifact: left as it is)
    hand_over.claim_new(staging_dir(destination))
    hand_over.claim_written(lock_path(destination))
    bar = ProgressBar(f"coldsnap {command}: pulling")
    session = PullSession(reference, destination, client_for(reference), on_progress=None if stream else bar.update,
                          log=lambda text: _say(command, text))
    handed = False
    try:
        if stream:
            session.start().usable()
            handed = True
            return None, session, hand_over
        return session.run(), None, hand_over
    except DestinationTaken as exc:
        raise OciPullFailed(str(exc), usage=True) from None
    except (RegistryError, CredentialsError, LayoutError, PullError) as exc:
        raise OciPullFailed(str(exc)) from None
    except OSError as exc:
        raise OciPullFailed(f"writing {destination}: {exc.strerror or exc}") from None
    finally:
        bar.finish()
        if not handed:
            _hand_over(hand_over, command)


def _hand_over(hand_over: HandOver, command: str) -> None:
    report = hand_over.apply()
    for warning in report.warnings() if report else []:
        _say(command, warning)


@dataclass
class CachedArtifact:
    """The artifact an ``oci://`` reference names, in the host's cache: whole, or (a streaming restore on a
    host that had no copy) with its packs still arriving through ``session``."""

    directory: Path
    command: str
    session: PullSession | None = None
    hand_over: HandOver | None = None

    def finish(self, cancel: bool = False) -> None:
        """Wait for the rest of the pull (``cancel``: stop it; what arrived stays for the next pull to resume),
        then hand what it wrote to its owner. A failure is said, not raised: the operation has its own outcome."""
        if self.session is None:
            return
        if cancel:
            self.session.cancel()
        try:
            result = self.session.finish()
            _say(self.command, f"the pull finished: {result.bytes_fetched / 1e9:.2f} GB in {result.seconds:.2f} s "
                 f"({result.bytes_fetched / max(result.seconds, 1e-9) / 1e9:.2f} GB/s), every chunk verified; kept in "
                 f"{self.directory}")
        except (RegistryError, CredentialsError, LayoutError, PullError, OSError) as exc:
            _say(self.command, f"{'the pull was stopped' if cancel else 'the pull did not finish'} ({exc}); what arrived "
                 f"stays in {self.directory} and the next restore of it pulls the rest")
        finally:
            if self.hand_over is not None:
                _hand_over(self.hand_over, self.command)
            self.session = None


def run_pull(reference_text: str, directory: str, as_json: bool = False, owner: str | None = None) -> int:
    destination = Path(directory).absolute()
    try:
        result, _, _ = _pull(reference_text, destination, "pull", owner)
        assert result is not None
    except OciPullFailed as exc:
        _say("pull", str(exc))
        return EXIT_USAGE if exc.usage else EXIT_FAILED
    if result.already_there:
        _say("pull", f"{destination} already holds {result.digest}")
    else:
        _say("pull", f"{result.blobs_fetched} of {result.blobs} files, {result.bytes_fetched / 1e9:.2f} GB, "
             f"in {result.seconds:.2f} s ({result.bytes_fetched / max(result.seconds, 1e-9) / 1e9:.2f} GB/s), verified")
    if as_json:
        sys.stdout.write(json.dumps({"directory": str(destination), "digest": result.digest, "blobs": result.blobs,
                                     "blobs_fetched": result.blobs_fetched, "bytes_fetched": result.bytes_fetched,
                                     "already_there": result.already_there, "seconds": round(result.seconds, 3)},
                                    sort_keys=True) + "\n")
    else:
        print(destination)
    return EXIT_OK


def pull_into_cache(reference_text: str, cache_root: Path, command: str, owner: Owner | None = None,
                    stream: bool = False) -> CachedArtifact:
    """The artifact ``oci://REF`` names, pulled (or found) under ``cache_root`` (``STATE/oci``) in a folder named by
    its index digest: a pinned reference restores from disk after its first pull; a tag is asked again
    each time and pulled anew when it moved. ``stream``: hand the folder over while the packs' chunks still
    arrive (:meth:`CachedArtifact.finish` waits for them)."""
    try:
        reference = parse_reference(reference_text)
        if reference.digest is None:  # a tag: ask where it points now
            _, _, digest = client_for(reference).get_manifest(reference.pinned)
            reference = reference.with_digest(digest)
    except BadReference as exc:
        raise OciPullFailed(str(exc), usage=True) from None
    except (RegistryError, CredentialsError) as exc:
        raise OciPullFailed(str(exc)) from None
    cache_root.mkdir(parents=True, exist_ok=True)
    destination = cache_root / reference.digest.removeprefix("sha256:")[:32]  # type: ignore[union-attr]
    if (destination / "artifact.json").is_file() and not incomplete(destination):
        # a folder there was renamed into place only after every file matched this index: no registry needed
        _say(command, f"{reference_text} is already on this host ({destination})")
        return CachedArtifact(destination, command)
    result, session, hand_over = _pull(OCI_SCHEME + str(reference), destination, command, owner, stream)
    if result is not None and result.already_there:
        _say(command, f"{reference_text} is already on this host ({destination})")
    if session is not None:
        _say(command, f"{destination}: every file but the packs is here and verified; their chunks go on arriving "
             "while the restore starts")
    return CachedArtifact(destination, command, session, hand_over)

"""The ``publish`` and ``pull`` commands, and the pull behind ``restore``/``warm`` of an ``oci://`` reference.

Progress goes to stderr; ``publish`` prints the pinned reference (``REGISTRY/REPO[:TAG]@sha256:…``) on stdout,
``pull`` the directory. A user mistake (a bad reference, a taken directory) exits 2, a registry or
transfer failure 1, each with one line naming what to do; nothing secret is ever printed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from coldsnap.contracts.base import ContractError
from coldsnap.ownership import HandOver, Owner, OwnerError, resolve_owner
from coldsnap.payload.errors import PackError
from coldsnap.progress import ProgressBar
from coldsnap.registry.client import RegistryError, client_for
from coldsnap.registry.credentials import CredentialsError
from coldsnap.registry.layout import LayoutError
from coldsnap.registry.pull import DestinationTaken, PullError, PullResult, lock_path, pull, staging_dir
from coldsnap.registry.publish import publish
from coldsnap.registry.reference import OCI_SCHEME, BadReference, parse_reference

__all__ = ["OCI_SCHEME", "OciPullFailed", "pull_into_cache", "run_publish", "run_pull"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def _say(command: str, text: str) -> None:
    print(f"coldsnap {command}: {text}", file=sys.stderr)


def run_publish(directory: str, reference_text: str, as_json: bool = False) -> int:
    root = Path(directory)
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
    bar = ProgressBar("coldsnap publish: sending")
    try:
        client = client_for(reference, push=True)
        result = publish(root, reference, client, on_progress=bar.update, log=lambda text: _say("publish", text))
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


def _pull(reference_text: str, destination: Path, command: str, owner: Owner | str | None = None) -> PullResult:
    """Pull into ``destination``; what the pull wrote (DIR, or on failure its staging folder, its lock file and
    the folders it made) is handed to the owner (``--owner``, else the sudo caller), whatever the outcome."""
    try:
        reference = parse_reference(reference_text)
        hand_over = HandOver(resolve_owner(owner))
    except (BadReference, OwnerError) as exc:
        raise OciPullFailed(str(exc), usage=True) from None
    hand_over.claim_new(destination)  # nothing when DIR is there already (the same artifact: left as it is)
    hand_over.claim_new(staging_dir(destination))
    hand_over.claim_written(lock_path(destination))
    bar = ProgressBar(f"coldsnap {command}: pulling")
    try:
        return pull(reference, destination, client_for(reference), on_progress=bar.update,
                    log=lambda text: _say(command, text))
    except DestinationTaken as exc:
        raise OciPullFailed(str(exc), usage=True) from None
    except (RegistryError, CredentialsError, LayoutError, PullError) as exc:
        raise OciPullFailed(str(exc)) from None
    except OSError as exc:
        raise OciPullFailed(f"writing {destination}: {exc.strerror or exc}") from None
    finally:
        bar.finish()
        report = hand_over.apply()
        for warning in report.warnings() if report else []:
            _say(command, warning)


def run_pull(reference_text: str, directory: str, as_json: bool = False, owner: str | None = None) -> int:
    destination = Path(directory).absolute()
    try:
        result = _pull(reference_text, destination, "pull", owner)
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


def pull_into_cache(reference_text: str, cache_root: Path, command: str, owner: Owner | None = None) -> Path:
    """The artifact ``oci://REF`` names, pulled (or found) under ``cache_root`` (``STATE/oci``) in a folder named by
    its index digest: a pinned reference restores from disk after its first pull; a tag is asked again
    each time and pulled anew when it moved."""
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
    if (destination / "artifact.json").is_file():
        # a folder there was renamed into place only after every file matched this index: no registry needed
        _say(command, f"{reference_text} is already on this host ({destination})")
        return destination
    result = _pull(OCI_SCHEME + str(reference), destination, command, owner)
    if result.already_there:
        _say(command, f"{reference_text} is already on this host ({destination})")
    return destination

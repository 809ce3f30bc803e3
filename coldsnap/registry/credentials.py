"""Registry credentials from the standard container auth files and credential helpers.

Looked up, first match wins (as podman/skopeo and docker do): ``$REGISTRY_AUTH_FILE``,
``$XDG_RUNTIME_DIR/containers/auth.json``, ``~/.config/containers/auth.json``,
``$DOCKER_CONFIG/config.json`` or ``~/.docker/config.json``. In each, ``credHelpers[registry]`` or
``credsStore`` names a ``docker-credential-<helper>`` program asked with ``get``; otherwise
``auths[registry].auth`` is base64 ``user:password`` (or ``identitytoken``). Nothing read here is ever
written to an artifact, a receipt or a log: :class:`Credentials` does not print its secret.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["AUTH_FILE_ENV", "Credentials", "CredentialsError", "auth_files", "find_credentials"]

AUTH_FILE_ENV = "REGISTRY_AUTH_FILE"


class CredentialsError(Exception):
    """An auth file or credential helper that exists but cannot be used; says which and why."""


@dataclass(frozen=True)
class Credentials:
    username: str
    secret: str = field(repr=False)
    source: str = ""
    """Where they came from (a file path or ``docker-credential-<helper>``), for messages."""
    identity_token: bool = False
    """``secret`` is an OAuth2 refresh token (docker's ``identitytoken``), not a password."""


def auth_files() -> list[Path]:
    paths = []
    if os.environ.get(AUTH_FILE_ENV):
        paths.append(Path(os.environ[AUTH_FILE_ENV]))
    if os.environ.get("XDG_RUNTIME_DIR"):
        paths.append(Path(os.environ["XDG_RUNTIME_DIR"]) / "containers" / "auth.json")
    home = Path(os.path.expanduser("~"))
    paths.append(home / ".config" / "containers" / "auth.json")
    paths.append(Path(os.environ["DOCKER_CONFIG"]) / "config.json" if os.environ.get("DOCKER_CONFIG")
                 else home / ".docker" / "config.json")
    return paths


def _host_of(key: str) -> str:
    """``https://host:port/v1/`` → ``host:port`` (docker writes keys in several forms)."""
    key = key.split("://", 1)[-1]
    return key.split("/", 1)[0]


def _from_helper(helper: str, registry: str) -> Credentials | None:
    program = f"docker-credential-{helper}"
    try:
        done = subprocess.run([program, "get"], input=registry, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise CredentialsError(f"the credential helper {program} named for {registry} is not installed") from None
    except subprocess.TimeoutExpired:
        raise CredentialsError(f"the credential helper {program} did not answer in 60 s") from None
    if done.returncode != 0:
        if "credentials not found" in (done.stdout + done.stderr).lower():
            return None
        raise CredentialsError(f"the credential helper {program} failed (exit {done.returncode})")
    try:
        answer = json.loads(done.stdout)
        username, secret = answer["Username"], answer["Secret"]
    except (ValueError, KeyError, TypeError):
        raise CredentialsError(f"the credential helper {program} answered something that is not its JSON") from None
    return Credentials(username, secret, program, identity_token=username == "<token>")


def _from_file(path: Path, registry: str) -> Credentials | None:
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise CredentialsError(f"{path}: cannot read the auth file ({getattr(exc, 'strerror', None) or exc})") from None
    if not isinstance(config, dict):
        raise CredentialsError(f"{path}: not an auth file (a JSON object)")
    helpers = config.get("credHelpers") or {}
    for key, helper in helpers.items():
        if _host_of(key) == registry:
            return _from_helper(helper, registry)
    for key, entry in (config.get("auths") or {}).items():
        if _host_of(key) != registry or not isinstance(entry, dict):
            continue
        if entry.get("identitytoken"):
            return Credentials("<token>", entry["identitytoken"], str(path), identity_token=True)
        if entry.get("auth"):
            try:
                username, _, password = base64.b64decode(entry["auth"]).decode().partition(":")
            except (ValueError, UnicodeDecodeError):
                raise CredentialsError(f"{path}: the entry for {registry} is not base64 user:password") from None
            return Credentials(username, password, str(path))
    if config.get("credsStore"):
        return _from_helper(config["credsStore"], registry)
    return None


def find_credentials(registry: str) -> Credentials | None:
    """The credentials for ``registry`` (``host[:port]``), or None: anonymous."""
    for path in auth_files():
        found = _from_file(path, registry)
        if found is not None:
            return found
    return None

"""The served API key: refused in a captured command, read from a file at restore.

A server started with ``--api-key K`` (vLLM, SGLang) or ``VLLM_API_KEY`` holds K in its memory, so in the capsule.
coldsnap captures it without one and installs the key at restore (``--api-key-file F``,
:mod:`coldsnap.agent.api_key`), where the engine's own check then guards the restored server.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

__all__ = ["SERVED_KEY_OPTIONS", "SERVED_KEY_VARIABLES", "served_key_in_command", "read_api_key", "ApiKeyFileError"]

SERVED_KEY_OPTIONS = {"vllm": ("--api-key",), "sglang": ("--api-key", "--admin-api-key")}
"""The options each engine's server takes its key from."""
SERVED_KEY_VARIABLES = {"vllm": ("VLLM_API_KEY",)}
"""The environment variables it takes one from (SGLang has none)."""


def served_key_in_command(engine: str, command: list[str], environment: Mapping[str, str]) -> str | None:
    """How ``command`` (started with ``environment``) gives the server an API key, in words; None when it gives none."""
    for option in SERVED_KEY_OPTIONS.get(engine, ()):
        if any(arg == option or arg.startswith(option + "=") for arg in command):
            return f"the command gives {option}"
    for name in SERVED_KEY_VARIABLES.get(engine, ()):
        if environment.get(name):
            return f"the command is started with {name} (--env {name} or the unit's env)"
    return None


class ApiKeyFileError(ValueError):
    """The API key file cannot be read or holds no usable key."""


def read_api_key(path: str | Path) -> str:
    """The key in ``path``: its text without surrounding whitespace; one token (no space inside)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ApiKeyFileError(f"API key file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ApiKeyFileError(f"API key file {path}: not text") from None
    key = text.strip()
    if not key:
        raise ApiKeyFileError(f"API key file {path} is empty")
    if any(c.isspace() for c in key) or not key.isprintable():
        raise ApiKeyFileError(f"API key file {path}: the key must be one line without spaces (what follows "
                              "'Authorization: Bearer ')")
    return key

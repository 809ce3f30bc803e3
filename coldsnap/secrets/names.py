"""Which environment variable names bear secrets.

A name is split into its ``_``-separated words (upper-cased); it is secret-bearing when a word says so
(``HF_TOKEN``, ``VLLM_API_KEY``, ``DB_PASSWORD``, ``GOOGLE_APPLICATION_CREDENTIALS``, ``REGISTRY_AUTH_FILE``),
when it belongs to a cloud's credential family (``AWS_*``, ``AZURE_*``), or when it is one of the registry
credential locations coldsnap itself reads. Whole words, not substrings: ``TOKENIZERS_PARALLELISM`` and
``PASSTHROUGH`` are not secrets. A name the rule misses is still caught by the scan of values
(:mod:`coldsnap.secrets.scan`) when its value has a known token format.
"""

from __future__ import annotations

from typing import Iterable, Mapping

__all__ = ["SECRET_WORDS", "SECRET_PREFIXES", "SECRET_NAMES", "is_secret_name", "names_a_secret", "secret_names"]

SECRET_WORDS = frozenset({
    "TOKEN", "TOKENS", "SECRET", "SECRETS", "PASSWORD", "PASSWORDS", "PASSWD", "PASS", "PASSPHRASE",
    "CREDENTIAL", "CREDENTIALS", "CREDS", "APIKEY", "KEY", "KEYS", "AUTH", "AUTHORIZATION", "COOKIE",
})
"""Words of a name that make it secret-bearing (``API_KEY`` through ``KEY``, ``ACCESS_TOKEN`` through ``TOKEN``)."""

SECRET_PREFIXES = ("AWS_", "AZURE_")
"""Cloud credential families: every variable of them is withheld (``AWS_REGION`` too: pass it with ``--env``)."""

SECRET_NAMES = frozenset({"DOCKER_CONFIG", "DOCKER_AUTH_CONFIG", "GOOGLE_APPLICATION_CREDENTIALS"})
"""Names no word rule catches: the registry credentials' folder coldsnap reads, a cloud's key file."""


def is_secret_name(name: str) -> bool:
    """Whether the variable ``name`` bears a secret by the rules above (coldsnap's own ``COLDSNAP_*`` never:
    they are settings, :mod:`coldsnap.settings`)."""
    return names_a_secret(name) or (not name.upper().startswith("COLDSNAP_") and name.upper().startswith(SECRET_PREFIXES))


def names_a_secret(name: str) -> bool:
    """Whether ``name`` itself says its value is a secret (a secret word, or a name of :data:`SECRET_NAMES`), not
    only its family (``AWS_REGION``): the names whose values the scan searches for."""
    upper = name.upper()
    if upper.startswith("COLDSNAP_"):
        return False
    return upper in SECRET_NAMES or any(word in SECRET_WORDS for word in upper.replace("-", "_").split("_"))


def secret_names(environment: Mapping[str, str] | Iterable[str]) -> list[str]:
    """The secret-bearing names of ``environment``, sorted."""
    return sorted(name for name in environment if is_secret_name(name))

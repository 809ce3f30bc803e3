"""The registry client's errors: each message names the registry and what to do."""

__all__ = ["DigestMismatch", "RegistryAuthError", "RegistryError", "RegistryNotFound", "RegistryProtocolError",
           "RegistryUnreachable"]


class RegistryError(Exception):
    """A registry operation that failed; the message names the registry and what to do."""


class RegistryUnreachable(RegistryError):
    pass


class RegistryAuthError(RegistryError):
    pass


class RegistryNotFound(RegistryError):
    pass


class RegistryProtocolError(RegistryError):
    pass


class DigestMismatch(RegistryError):
    pass

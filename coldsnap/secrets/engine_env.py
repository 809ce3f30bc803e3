"""The environment a captured command starts with: the launcher's, less its secrets and less coldsnap's own
settings the engine does not read, plus the unit's ``env``.

Whatever the engine's environment holds ends up in the capsule's page images (the process's environment block
and every copy Python makes of it), and a capsule is published to a registry a whole fleet reads. So a
secret-bearing variable (:func:`coldsnap.secrets.names.is_secret_name`) reaches the engine only when the
operator asks for it by name (``--env NAME``, the request unit's ``pass_env``) or sets it in the unit's ``env``;
the artifact then records that it holds it, and ``publish`` refuses it unless told ``--allow-secrets``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterable, Mapping

from coldsnap.secrets.names import is_secret_name
from coldsnap.settings import SETTINGS

__all__ = ["EngineEnvironment", "engine_environment"]


@dataclass(frozen=True)
class EngineEnvironment:
    variables: dict[str, str]
    """What the command is started with."""
    withheld: tuple[str, ...]
    """Secret-bearing names of the launcher's environment left out (sorted)."""
    held: tuple[str, ...]
    """Secret-bearing names the command gets all the same, asked for by name or set in the unit's env (sorted)."""
    settings_withheld: tuple[str, ...]
    """coldsnap's own ``COLDSNAP_*`` settings of the launcher's environment the engine does not read."""


def engine_environment(unit_env: Mapping[str, str], pass_env: Iterable[str] = (),
                       launcher_env: Mapping[str, str] | None = None) -> EngineEnvironment:
    """The captured command's environment from ``launcher_env`` (default: this process's), ``pass_env`` (names
    taken from it although they look secret; a name it does not have is simply absent) and ``unit_env``
    (added last, as given)."""
    launcher_env = os.environ if launcher_env is None else launcher_env
    passed = set(pass_env)
    variables: dict[str, str] = {}
    withheld, settings_withheld = [], []
    for name, value in launcher_env.items():
        if name.startswith("COLDSNAP_") and not SETTINGS.reaches_engine(name):
            settings_withheld.append(name)
        elif is_secret_name(name) and name not in passed:
            withheld.append(name)
        else:
            variables[name] = value
    variables.update(unit_env)
    held = sorted(name for name in variables if is_secret_name(name))
    return EngineEnvironment(variables, tuple(sorted(withheld)), tuple(held), tuple(sorted(settings_withheld)))

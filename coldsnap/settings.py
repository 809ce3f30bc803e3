"""Every ``COLDSNAP_*`` environment variable, in one typed registry: name, type, default, what it does and who
reads it; one rule for booleans; the docs table (``docs/settings.md``) is generated from it
(``scripts/docs-settings.py``) and a test fails on a ``COLDSNAP_`` literal of the code that is not here.

Who reads a setting decides where it may travel. ``launcher``: the ``coldsnap`` process (capture, restore,
publish, ...) and nothing it starts; a command-line flag that stands for it reaches the launcher's code
through :meth:`SettingsRegistry.give` (this process only), never through ``os.environ``. ``agent``: code
inside the served engine (coldsnap's agent and engine plugins), which sees the environment the engine was
started with, so these alone are passed on to a captured command
(:mod:`coldsnap.secrets.engine_env`). ``criu``: a child of the launcher (CRIU's action script) told
explicitly.

Booleans: ``1``, ``true``, ``yes``, ``on`` switch on; ``0``, ``false``, ``no``, ``off`` switch off (any case);
unset or empty is the default. Anything else is a :class:`SettingError` for the launcher, and a warning (and
the default) inside the engine, where a plugin must never break its engine.

This module is imported by the restore's early entry and by engine plugins: standard library only.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Literal, Mapping

__all__ = ["Setting", "SettingError", "SettingsRegistry", "SETTINGS", "TRUE_WORDS", "FALSE_WORDS"]

logger = logging.getLogger(__name__)

Reader = Literal["launcher", "agent", "criu"]
Kind = Literal["flag", "int", "bytes", "seconds", "path", "choice", "text", "list"]

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


class SettingError(ValueError):
    """A ``COLDSNAP_*`` variable holds a value its type does not allow."""


@dataclass(frozen=True)
class Setting:
    name: str
    kind: Kind
    default: str
    """The default as the docs say it (a value, or how it is derived)."""
    what: str
    readers: tuple[Reader, ...]
    choices: tuple[str, ...] = ()
    flag: str | None = None
    """The command-line flag that stands for it, where one does."""

    @property
    def reaches_engine(self) -> bool:
        return "agent" in self.readers


class SettingsRegistry:
    """The registered settings, and their values as this process sees them: a value given by a flag
    (:meth:`give`) first, then the environment."""

    def __init__(self, settings: Iterable[Setting]):
        self.settings = {s.name: s for s in settings}
        self._given: dict[str, str] = {}

    def __iter__(self) -> Iterator[Setting]:
        return iter(sorted(self.settings.values(), key=lambda s: s.name))

    def __contains__(self, name: object) -> bool:
        return name in self.settings

    def get(self, name: str) -> Setting:
        try:
            return self.settings[name]
        except KeyError:
            raise KeyError(f"{name} is not a registered coldsnap setting (coldsnap/settings.py)") from None

    def reaches_engine(self, name: str) -> bool:
        """Whether the captured command is started with ``name`` (an unregistered ``COLDSNAP_*``: no)."""
        setting = self.settings.get(name)
        return setting is not None and setting.reaches_engine

    def give(self, name: str, value: str) -> None:
        """A command-line flag's value for ``name``, seen by this process's code only (no child inherits it)."""
        self.get(name)
        self._given[name] = value

    def forget(self, name: str) -> None:
        """Undo :meth:`give` (tests)."""
        self._given.pop(name, None)

    def text(self, name: str, environ: Mapping[str, str] | None = None) -> str | None:
        """The value, stripped; None when unset or empty."""
        self.get(name)
        value = self._given.get(name) if environ is None else None
        if value is None:
            value = (os.environ if environ is None else environ).get(name)
        value = value.strip() if value is not None else None
        return value or None

    def flag(self, name: str, environ: Mapping[str, str] | None = None) -> bool:
        """A boolean by the one rule (module docstring); its registered default when unset."""
        setting = self.get(name)
        assert setting.kind == "flag", f"{name} is a {setting.kind}, not a flag"
        value = self.text(name, environ)
        if value is None:
            return setting.default in TRUE_WORDS
        if value.lower() in TRUE_WORDS:
            return True
        if value.lower() in FALSE_WORDS:
            return False
        return self._invalid(setting, f"{name}={value!r}: want one of {', '.join(TRUE_WORDS + FALSE_WORDS)}",
                             setting.default in TRUE_WORDS)

    def choice(self, name: str, environ: Mapping[str, str] | None = None) -> str | None:
        """One of the setting's choices; None when unset."""
        setting = self.get(name)
        value = self.text(name, environ)
        if value is None or value in setting.choices:
            return value
        return self._invalid(setting, f"{name}={value!r}: want one of {', '.join(setting.choices)}", None)

    def number(self, name: str, environ: Mapping[str, str] | None = None) -> int | None:
        """A whole number (kinds ``int`` and ``bytes``) >= 0; None when unset."""
        return self._parsed(name, environ, int, lambda number: number >= 0, "a whole number >= 0")

    def seconds(self, name: str, environ: Mapping[str, str] | None = None) -> float | None:
        """A duration in seconds > 0; None when unset."""
        return self._parsed(name, environ, float, lambda seconds: seconds > 0, "seconds > 0")

    def _parsed(self, name: str, environ: Mapping[str, str] | None, convert: Callable[[str], Any],
                valid: Callable[[Any], bool], want: str) -> Any:
        value = self.text(name, environ)
        if value is None:
            return None
        try:
            parsed = convert(value)
        except ValueError:
            parsed = None
        if parsed is None or not valid(parsed):
            return self._invalid(self.get(name), f"{name}={value!r}: want {want}", None)
        return parsed

    def _invalid(self, setting: Setting, problem: str, fallback: Any) -> Any:
        if "agent" in setting.readers:  # (also) inside the engine: warn, never raise
            logger.warning("coldsnap: %s; using the default (%s)", problem, setting.default)
            return fallback
        raise SettingError(problem)


_L: tuple[Reader, ...] = ("launcher",)
_A: tuple[Reader, ...] = ("agent",)
_LA: tuple[Reader, ...] = ("launcher", "agent")

SETTINGS = SettingsRegistry([
    # capture
    Setting("COLDSNAP_CAPTURE_VERIFY", "flag", "1", "The capture restores its capsule once before committing it.",
            _L, flag="--no-verify"),
    Setting("COLDSNAP_CANARY_PROBES", "list", "136:4,600:2", "The canary's probes a capture records (LEN:TOKENS,...); "
            "every restore must answer them bit for bit.", _L, flag="--canary-probes"),
    Setting("COLDSNAP_CAPTURE_REFERENCE", "choice", "plain for vLLM and SGLang, none otherwise", "The reference check: "
            "a plain start of the command first, whose answers the captured engine must give back exactly.", _L,
            choices=("plain", "none"), flag="--reference"),
    Setting("COLDSNAP_REFERENCE_PROBES", "list", "8:32,40:32,100:32,183:32,287:32", "The reference check's own probes, "
            "asked after the canary's.", _L, flag="--reference-probes"),
    Setting("COLDSNAP_ALLOW_UNQUALIFIED_DRIVER", "flag", "0", "An NVIDIA driver below the qualified floor is a "
            "receipt warning instead of a refusal.", _L),
    # restore
    Setting("COLDSNAP_STATE_DIR", "path", "$XDG_RUNTIME_DIR/coldsnap, else /run/coldsnap (root), else "
            "/tmp/coldsnap-UID", "The state root: replicas, standbys, logs, kernel facts, the OCI cache.", _L,
            flag="--state-dir"),
    Setting("COLDSNAP_HOST_THP", "choice", "off", "Switch the host's transparent huge pages to always during CRIU's "
            "fill, and back.", _L, choices=("always", "off"), flag="--host-thp"),
    Setting("COLDSNAP_EARLY_RESTORE", "flag", "1", "`coldsnap restore DIR` starts CRIU from the program's entry, "
            "before the rest of coldsnap is imported.", _L),
    Setting("COLDSNAP_EARLY_STAGING", "flag", "1", "The early entry also stages the weights on the GPU beside CRIU.",
            _L),
    Setting("COLDSNAP_STANDBY_PIN_PACK", "flag", "1", "A warm standby pins each rank's pack in memory ahead of wake.",
            _L),
    Setting("COLDSNAP_STANDIN_GPU_FREE_BYTES", "bytes", "unset (no check)", "Tests: a CPU capsule's regions are "
            "checked against a stand-in GPU with this many bytes free.", _L),
    # CRIU
    Setting("COLDSNAP_CRIU", "path", "criu on PATH", "The CRIU binary coldsnap runs.", _L),
    Setting("COLDSNAP_CRIU_FILL_THREADS", "text", "auto: min(7, max(1, CPUs/2 - 1))", "Helper threads per restored "
            "process for CRIU's page fill (a number up to 16, 0: single-threaded, or auto).", _L),
    Setting("COLDSNAP_CRIU_THP_FILL", "choice", "auto: on unless a VM balloon reports free pages", "Whether CRIU fills "
            "huge pages (1, 0 or auto).", _L, choices=("0", "1", "auto")),
    Setting("COLDSNAP_CRIU_LOG_LEVEL", "choice", "CRIU's own", "CRIU's log verbosity (-v0 .. -v4) for dump and restore.",
            _L, choices=("0", "1", "2", "3", "4")),
    Setting("COLDSNAP_UNLOCK_HOLD", "path", "set by coldsnap", "Internal: where CRIU's post-restore action script finds "
            "the launcher's unlock-hold FIFOs.", ("criu",)),
    # the manager's host provider (docs/host-provider.md)
    Setting("COLDSNAP_HOST_PROVIDER_SOCKET", "path", "unset (no provider)", "The manager's host-provider socket for this "
            "operation (a path, or @NAME for an abstract one).", _L),
    Setting("COLDSNAP_HOST_PROVIDER_TOKEN", "text", "unset", "The operation's token for that socket (never passed to an "
            "engine: its name bears a secret).", _L),
    # registry
    Setting("COLDSNAP_PLAIN_HTTP_REGISTRIES", "list", "none (HTTPS everywhere)", "Registries spoken to over plain "
            "HTTP (comma-separated REGISTRY names).", _L),
    Setting("COLDSNAP_PULL_STREAMS", "int", "min(16, max(4, 2 x CPUs))", "Chunks or ranges a pull fetches at once.", _L),
    Setting("COLDSNAP_PULL_DIRECT", "flag", "1", "A pull writes 4 KiB-aligned pack chunks with O_DIRECT.", _L),
    # hydration: the launcher's staging and the agent's loads alike
    Setting("COLDSNAP_HYDRATE_THREADS", "int", "min(16, max(4, 3/4 x CPUs))", "Threads of native hydration, prefetch "
            "and reads.", _LA),
    Setting("COLDSNAP_HYDRATE_CHUNK_BYTES", "bytes", "2097152", "Chunk of buffered hydration reads.", _LA),
    Setting("COLDSNAP_HYDRATE_RING_BYTES", "bytes", "100663296", "Pinned ring of buffered hydration reads.", _LA),
    Setting("COLDSNAP_HYDRATE_DIRECT_CHUNK_BYTES", "bytes", "16777216", "Chunk of O_DIRECT hydration reads.", _LA),
    Setting("COLDSNAP_HYDRATE_DIRECT_RING_BYTES", "bytes", "536870912", "Ring of O_DIRECT hydration reads.", _LA),
    # the engine's side
    Setting("COLDSNAP_CONTROL", "text", "set by coldsnap", "The agent's socket name; set only on a command coldsnap "
            "starts (its presence means: run under coldsnap).", _A),
    Setting("COLDSNAP_AGENT_LEASE_WAIT_S", "seconds", "15", "A restored tree no launcher takes the lease of within "
            "this long stops itself.", _A),
    Setting("COLDSNAP_AGENT_RESUME_TIMEOUT_S", "seconds", "300", "A prepared process nobody resumes within this long "
            "kills its process group.", _A),
    Setting("COLDSNAP_TRIM_LOCAL_MEMORY", "flag", "1", "Lower the CUDA stack limit before the checkpoint, restore it "
            "at resume.", _A),
    Setting("COLDSNAP_KEY_GATE_HELD", "flag", "0", "Set by coldsnap (n580 restore with --api-key-file): the served "
            "HTTP process's key gate starts held (the engine's guarded paths answer 401) until the key is given.", _A),
    Setting("COLDSNAP_NATIVE_PACK", "path", "set by coldsnap (n580)", "The native pack the load format hydrates the "
            "weights from at load.", _A),
    Setting("COLDSNAP_WEIGHTS_MODE", "choice", "auto", "The load format's mode when its own config names none.", _A,
            choices=("auto", "native", "recovery", "cache-only-auto")),
    Setting("COLDSNAP_GRAPHS", "choice", "unset (graphs at start)", "n580 recreate policy: serve eagerly first, "
            "capture CUDA graphs after the first answer (torch-lm).", _A, choices=("after-ready",)),
    Setting("COLDSNAP_PLACEMENT_ABI", "choice", "2", "The n580 template's placement ABI (the request unit's env, "
            "from --placement-abi).", _L, choices=("1", "2"), flag="--placement-abi"),
    Setting("COLDSNAP_TEMPLATE_PRELOAD", "list", "the engine adapter's modules", "Modules the n580 template imports "
            "before its pre-CUDA boundary (the request unit's env, from --preload).", _L, flag="--preload"),
    Setting("COLDSNAP_VLLM_SLEEP_BACKEND", "text", "vLLM's configured backend", "vLLM < 0.33: the sleep backend of "
            "models loaded with --load-format coldsnap (coldsnap).", _A),
    Setting("COLDSNAP_VLLM_GRAPH_REGION", "flag", "1", "vLLM's CUDA-graph pool lives in coldsnap's cudagraph region.",
            _A),
    Setting("COLDSNAP_VLLM_KEEP_PREFIX_CACHE", "flag", "0", "Diagnostics only: keep vLLM's prefix cache after restore "
            "(answers differ).", _A),
    Setting("COLDSNAP_POISON_GRAPH_MEMORY", "flag", "0", "Diagnostics: fill vLLM's cudagraph region with 0xFF after "
            "each resume.", _A),
    Setting("COLDSNAP_SLEEP_PACK_DIR", "path", "/dev/shm/coldsnap-sleep-PGRP", "Where vLLM's coldsnap sleep backend "
            "writes its pack and records.", _A),
    # the demo
    Setting("COLDSNAP_VLLM_VENV", "path", "CHECKOUT/.venv-vllm", "The virtualenv `coldsnap demo --engine vllm` uses.",
            _L),
])

"""Artifact descriptor, format 9: the committed record of one capture.

It binds the request, the semantic manifest, the platform the capture ran on and, per launch unit,
the capsule (CRIU images, residual, metadata) and per worker the optional native payload. Paths are
relative to the artifact directory so an artifact can be moved or staged elsewhere whole.
"""

from __future__ import annotations

import posixpath
from typing import Annotated, ClassVar, Literal

from pydantic import AfterValidator, Field

from coldsnap.contracts.base import Contract, Identifier, Sha256Hex
from coldsnap.contracts.common import EngineName, GraphPolicyMode, SnapshotDriverName
from coldsnap.contracts.request import ModelSpec

__all__ = [
    "ARTIFACT_FORMAT",
    "FileRef",
    "PinnedFile",
    "PlatformRecord",
    "CanaryProbe",
    "EnvironmentRecord",
    "CanaryRecord",
    "ReferenceRecord",
    "WorkerRecord",
    "UnitRecord",
    "ArtifactDescriptor",
]

ARTIFACT_FORMAT = 9


def _relative_path(path: str) -> str:
    normalized = posixpath.normpath(path)
    if path.startswith("/") or normalized.startswith("..") or normalized != path or path in ("", "."):
        raise ValueError(f"{path!r} must be a normalized path relative to the artifact directory")
    return path


RelativePath = Annotated[str, AfterValidator(_relative_path)]


class FileRef(Contract):
    """A content-addressed file of the artifact."""

    path: RelativePath
    """Path relative to the artifact directory."""
    sha256: Sha256Hex
    """SHA-256 of the file's bytes."""
    size_bytes: int = Field(ge=0)
    """File size."""


def _absolute_path(path: str) -> str:
    if not path.startswith("/") or posixpath.normpath(path) != path:
        raise ValueError(f"{path!r} must be a normalized absolute path")
    return path


class PinnedFile(Contract):
    """A file outside the artifact that a restore may read, pinned by content (a recovery safetensors)."""

    path: Annotated[str, AfterValidator(_absolute_path)]
    """Absolute path on the capture host; a restore host must have the same bytes there."""
    sha256: Sha256Hex
    """SHA-256 of the file's bytes at capture."""
    size_bytes: int = Field(ge=0)
    """File size at capture."""


class PlatformRecord(Contract):
    """The capture host, as far as restore compatibility depends on it."""

    arch: str
    """Process architecture (``x86_64``, ``aarch64``)."""
    kernel: str
    """``uname -r`` of the capture host (enforced only with ``compatibility.kernel=exact``)."""
    nvidia_driver: str | None
    """NVIDIA kernel driver version (``580.159.04``); ``None`` on CPU engines."""
    nvidia_driver_floor: int | None
    """Major of ``nvidia_driver``: the captured driver floor."""
    gpu_model: str | None
    """GPU name of the capture (``NVIDIA H200``)."""
    compute_capability: str | None
    """GPU compute capability (``9.0``)."""
    criu_version: str
    """CRIU version that dumped the capsules."""


class CanaryProbe(Contract):
    """One probe of the canary (:mod:`coldsnap.activation.canary_probes`): a prompt of token ids, the
    greedy tokens the captured server generated after it and each one's logprob, all to be reproduced."""

    prompt_ids: list[int] = Field(min_length=1)
    """The prompt, as token ids."""
    token_ids: list[int] = Field(min_length=1)
    """The tokens the captured server generated (EOS ignored)."""
    logprob_bits: list[int] = Field(min_length=1)
    """Each generated token's logprob as the captured server computed it, as the bits of the IEEE-754
    double (canonical JSON has no floats; the bits keep it exact): a restore must give the same."""


class CanaryRecord(Contract):
    """The exact-response canary recorded at capture."""

    prompt: str
    """Prompt sent greedily."""
    expected_response: str
    """Response text the restored server must reproduce."""
    token_ids: list[int]
    """Token ids the captured server produced."""
    prompt_argmax: list[int] | None = None
    """The top-1 next token the captured server's prefill predicted at each prompt position but the first
    (its ``prompt_logprobs``); ``None`` when the engine gave none."""
    restore_tokens: int | None = Field(default=None, ge=1)
    """What a restore checks: with ``prompt_argmax``, one prefill's predictions at every prompt position
    plus the first ``restore_tokens`` of ``token_ids`` (the same model checked at more positions for less
    decode time); ``None``: every one of ``token_ids`` and the response text."""
    probes: list[CanaryProbe] = Field(default_factory=list)
    """Asked after the prompt, in this order; each one's tokens and logprobs must come back exactly (empty:
    the engine gave no logprobs, or an artifact captured before probes existed)."""


class ReferenceRecord(Contract):
    """The capture's reference check (:mod:`coldsnap.activation.reference_check`): the captured engine's
    answers against a plain start of the same command on the same host."""

    mode: Literal["plain", "none"]
    """``plain``: checked, and equal (a capture whose engine answered otherwise is never committed);
    ``none``: not checked (``note`` says why)."""
    note: str | None = None
    """Why it was not checked (``--reference none``, a driver or topology the check does not cover), or what
    the check met on its way (a retry, and why)."""
    plain_starts: int = Field(default=0, ge=0)
    """Plain starts of the command the check ran (1; 2 after a mismatch)."""
    capture_starts: int = Field(default=0, ge=0)
    """Starts of the captured engine (1; 2 after a mismatch: the second one was captured)."""
    canary_token_ids: list[int] = Field(default_factory=list)
    """The canary prompt's tokens, as the plain start and the captured engine both generated them."""
    probes: list[CanaryProbe] = Field(default_factory=list)
    """Every probe both answered, in the order asked (the restore's probes, then the check's own): token ids and
    logprob bits, equal in both."""
    answers_sha256: Sha256Hex | None = None
    """Digest of every answer of the plain start (the canary's tokens and predictions, each probe's ids and
    logprob bits; also in the receipt's ``capture.reference`` span)."""


class WorkerRecord(Contract):
    """Per-worker state of a capture."""

    worker_id: Identifier
    """Worker identity (from the request)."""
    rank: int = Field(ge=0)
    """Worker rank."""
    layout_digest: Sha256Hex
    """Digest of the worker's stable memory layout."""
    residual: FileRef
    """Stable bytes not in the native payload (pack + residual cover every preserved allocation)."""
    payload: FileRef | None
    """Native model payload (content-addressed pack), ``None`` when native generation was off."""
    recovery: list[PinnedFile] | None = None
    """The safetensors the engine loaded the weights from, replayed into the captured layout (plus the
    residual) when the payload is missing, fails verification or ``weights.mode`` is ``recovery``;
    ``None`` when the engine reported none."""
    recovery_plan: FileRef | None = None
    """Which byte ranges of ``recovery`` land unchanged where in the captured layout, recorded while the
    engine loaded them (:mod:`coldsnap.hydrate.recovery_plan`): a recovery restore streams them through
    the hydration engine instead of the engine's loaders. ``None``: the engine's loaders replay them."""
    recovery_gap: FileRef | None = None
    """With ``recovery_plan``: the payload's bytes the plan does not cover (transformed weights, padding),
    a residual-format pack; plan + gap cover the payload's extents exactly."""


class EnvironmentRecord(Contract):
    """What of the launcher's environment the captured command was started with, by name only (never a
    value): :mod:`coldsnap.secrets.engine_env`."""

    withheld: list[str] = Field(default_factory=list)
    """Secret-bearing names of the launcher's environment the command did not get."""
    held: list[str] = Field(default_factory=list)
    """Secret-bearing names the command got all the same (``--env NAME``, the unit's ``env``): their values are
    in the capsule's page images, and ``coldsnap publish`` refuses the artifact unless ``--allow-secrets``."""


class UnitRecord(Contract):
    """Per-launch-unit state of a capture."""

    unit_id: Identifier
    """Launch-unit identity."""
    capsule: FileRef
    """The unit's capsule archive (CRIU images, metadata, cache seed)."""
    workers: list[WorkerRecord] = Field(min_length=1)
    """The unit's workers."""
    environment: EnvironmentRecord | None = None
    """The secret-bearing names withheld from and held by the command (``None``: captured by a build that
    passed the whole environment on)."""


class ArtifactDescriptor(Contract):
    """Artifact descriptor (format 9), committed atomically as the last step of a capture."""

    SUPPORTED_FORMATS: ClassVar[tuple[int, ...]] = (ARTIFACT_FORMAT,)

    format: Literal[9]
    """Artifact format version; only 9 is accepted."""
    artifact_id: Identifier
    """Identity of this capture."""
    created_unix_ns: int = Field(ge=0)
    """Commit time, Unix nanoseconds."""
    engine: EngineName
    """Engine adapter that captured it."""
    snapshot_driver: SnapshotDriverName
    """Snapshot driver that captured it; restore must select the same one."""
    request_sha256: Sha256Hex
    """Canonical SHA-256 of the resolved capture request."""
    semantic_manifest_sha256: Sha256Hex
    """Canonical SHA-256 of the capture's semantic manifest."""
    model: ModelSpec
    """Model and recovery revision."""
    graph_policy: GraphPolicyMode
    """How CUDA graphs were treated."""
    platform: PlatformRecord
    """Capture host facts that restore admission checks."""
    canary: CanaryRecord
    """Exact-response canary recorded at capture."""
    reference: ReferenceRecord | None = None
    """The reference check at capture (``None``: captured by a build before the check existed)."""
    units: list[UnitRecord] = Field(min_length=1)
    """Capsules and workers, per launch unit."""

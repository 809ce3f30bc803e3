"""Operation request, format 4: the one immutable document a manager sends on stdin.

Policy fields a caller leaves out are resolved from the selected snapshot driver's profile
(:mod:`coldsnap.contracts.profiles`) *before* the request is hashed, so a request that spells out a
default and one that omits it have the same canonical SHA-256.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, Field, SerializerFunctionWrapHandler, model_serializer, model_validator

from coldsnap.contracts.base import Contract, Identifier
from coldsnap.contracts.common import (
    EngineName,
    GraphPolicyMode,
    NativeMaterialization,
    OperationName,
    SnapshotDriverName,
    WeightsMode,
)

__all__ = [
    "REQUEST_FORMAT",
    "WorkerSpec",
    "LaunchUnitSpec",
    "ModelSpec",
    "WeightsPolicy",
    "GraphPolicy",
    "KvPolicy",
    "CompatibilityPolicy",
    "ValidationPolicy",
    "Policy",
    "FileOwner",
    "UnitSelection",
    "OperationRequest",
]

REQUEST_FORMAT = 4

Port = Annotated[int, Field(ge=1, le=65535)]
EnvName = Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", max_length=255)]


class WorkerSpec(Contract):
    """One accelerator-owning engine process slot of a launch unit."""

    worker_id: Identifier
    """Stable worker identity; it names the worker's native payload and residual."""
    rank: int = Field(ge=0)
    """Global rank of the worker in the engine's process groups; unique across the request."""
    device_slot: int = Field(ge=0)
    """Index into the unit's visible devices at activation. Placement, not identity."""


class LaunchUnitSpec(Contract):
    """One process-tree activation boundary (a container or a process tree), owning one or more workers."""

    unit_id: Identifier
    """Stable launch-unit identity within the request."""
    command: list[str] = Field(min_length=1)
    """Exact argv of the serving process (e.g. ``vllm serve MODEL --load-format coldsnap ...``)."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment added to the serving process; placement values belong here, not in ``command``. A
    secret-bearing name set here is passed on deliberately (the artifact records that it holds it)."""
    pass_env: list[EnvName] = Field(default_factory=list)
    """Names of the launcher's environment variables passed to the serving process although their names say
    they bear secrets (``HF_TOKEN``, ``*_API_KEY``, ``AWS_*``, ...: withheld otherwise, see
    :mod:`coldsnap.secrets.engine_env`); names only, never values. The artifact records that it holds them."""

    @model_serializer(mode="wrap")
    def _without_empty_pass_env(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # absent when empty: a request without it keeps the canonical digest it had before the field existed
        # (an artifact's request_sha256 binds its request.json)
        document = handler(self)
        if not document.get("pass_env"):
            document.pop("pass_env", None)
        return document
    serving_port: Port | None = None
    """TCP port the unit serves HTTP on; the canary is sent there. ``None`` when the unit does not serve."""
    workers: list[WorkerSpec] = Field(min_length=1)
    """Workers of this unit, in rank order."""


class ModelSpec(Contract):
    """The model being served."""

    name: str = Field(min_length=1)
    """Model name or local path as the engine command names it."""
    revision: str | None = None
    """Immutable revision (a Hugging Face commit) of the recovery safetensors; ``None`` for local models."""


class WeightsPolicy(Contract):
    """Where weights come from on restore."""

    mode: WeightsMode | None = None
    """``auto`` prefers a verified native pack and falls back to recovery; ``native`` makes a missing pack fatal;
    ``recovery`` replays the pinned safetensors; ``cache-only-auto`` checks only the existing cache."""
    native_generation: Literal["off", "on"] | None = None
    """Whether capture writes a native pack from the live weights when ``mode`` is ``recovery`` (``off``, the
    default: no pack, restores replay the pinned safetensors); the other modes restore from the pack, so
    capture always writes it for them."""
    native_materialization: NativeMaterialization | None = None
    """Whether a recovery restore also materializes a native pack (engine-dependent; see capabilities)."""


class GraphPolicy(Contract):
    """What happens to CUDA graphs across the snapshot."""

    mode: GraphPolicyMode | None = None
    """``retain`` keeps captured graph executables in the image; ``recreate`` captures them again after restore."""


class KvPolicy(Contract):
    """What happens to the KV cache across the snapshot."""

    mode: Literal["discard"] | None = None
    """``discard``: KV bytes are never stored; the region is remapped at its address and zeroed on restore."""


class CompatibilityPolicy(Contract):
    """How strictly a restore host must match the capture host."""

    enforce_captured_driver_floor: bool | None = None
    """Also require the NVIDIA driver of the capture host (the snapshot driver's own minimum always applies)."""
    kernel: Literal["capability", "exact"] | None = None
    """``capability``: a CRIU capability probe on the destination; ``exact``: ``uname -r`` must match."""


class ValidationPolicy(Contract):
    """The exact-response canary that must pass before a restored server takes traffic."""

    prompt: str | None = None
    """Prompt sent with greedy decoding through the engine's own HTTP API."""
    expected_response: str | None = None
    """The response the engine must produce exactly."""
    max_tokens: int | None = Field(default=None, ge=1, le=4096)
    """Generation limit of the canary request."""


class Policy(Contract):
    """Operation policy. Every field left out is filled from the snapshot driver's profile."""

    weights: WeightsPolicy = Field(default_factory=WeightsPolicy)
    """Weight source policy."""
    graphs: GraphPolicy = Field(default_factory=GraphPolicy)
    """CUDA graph policy."""
    kv: KvPolicy = Field(default_factory=KvPolicy)
    """KV cache policy."""
    compatibility: CompatibilityPolicy = Field(default_factory=CompatibilityPolicy)
    """Host compatibility policy."""
    validation: ValidationPolicy = Field(default_factory=ValidationPolicy)
    """Canary policy."""


class FileOwner(Contract):
    """Who gets the files an operation writes: numeric ids, as the manager resolved its user."""

    uid: int = Field(ge=0, le=2**32 - 2)
    """User id the files and directories are handed to."""
    gid: int = Field(ge=0, le=2**32 - 2)
    """Group id they are handed to."""


Endpoint = Annotated[str, Field(pattern=r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):[0-9]{1,5}$")]
"""``HOST:PORT`` (an IPv6 literal in brackets)."""


def _absolute(path: str) -> str:
    if not path.startswith("/"):
        raise ValueError(f"{path!r} must be an absolute path")
    return path


class UnitSelection(Contract):
    """Which unit of an activation of several launch units this launcher runs, on this unit's host, and
    where the units meet (the activation's CSKV coordinator, like torchrun's rendezvous endpoint). Every
    unit's launcher gets the same request but for this selection. Placement, not identity: left out of
    the artifact's request and of its digest."""

    unit_id: Identifier
    """The unit this launcher captures or restores (one of ``units``)."""
    index: int = Field(ge=0, le=1023)
    """The unit's place in the activation, 0..units-1 (unit 0 serves HTTP and answers the canary): where it
    is in ``units`` when the request lists them all."""
    units: int = Field(ge=2, le=1024)
    """How many launch units the activation has; a restore of an artifact of another count is refused."""
    rendezvous: Endpoint
    """The coordinator every unit joins (``HOST:PORT``)."""
    rendezvous_token_file: Annotated[str, AfterValidator(_absolute)]
    """A file holding the activation's token (>= 16 bytes), the same on every unit's host."""
    serve_rendezvous: Endpoint | None = None
    """This unit serves the coordinator itself, listening there (typically unit 0: ``0.0.0.0:29600``)."""
    join_timeout_s: int = Field(default=60, ge=1, le=3600)
    """How long this unit waits for the coordinator to answer its first HELLO (a unit may start before the
    one that serves it): ``unit.rendezvous`` after that."""
    address: str | None = Field(default=None, min_length=1, max_length=64)
    """This unit's address on the activation's network, where the other units reach it (default: the
    address of this host's route to ``rendezvous``)."""


class OperationRequest(Contract):
    """A capture, restore or lifecycle request (request format 4)."""

    SUPPORTED_FORMATS: ClassVar[tuple[int, ...]] = (REQUEST_FORMAT,)

    format: Literal[4]
    """Request format version; only 4 is accepted."""
    operation: OperationName
    """What to do."""
    operation_id: Identifier
    """Caller-chosen identity of this operation; echoed in the receipt and every timing event."""
    engine: EngineName
    """Engine adapter to use."""
    snapshot_driver: SnapshotDriverName
    """Snapshot process driver: ``n610`` (initialized CUDA state) or ``n580`` (pre-CUDA template)."""
    model: ModelSpec
    """The model served by every unit."""
    units: list[LaunchUnitSpec] = Field(min_length=1)
    """The complete launch topology."""
    artifact: str = Field(min_length=1)
    """Artifact directory: written by ``capture`` (must not hold a committed descriptor), read by the others."""
    prepare_only: bool = False
    """``restore`` only: run admission (formats, driver floor, CRIU check, payload verification, ports), start nothing."""
    standby_ttl_s: int | None = Field(default=None, ge=1, le=7 * 86400)
    """``warm`` only: seconds the standby waits for ``wake`` before it stops itself (default 3600).
    Left out of the canonical form when absent, so requests without it keep their digests."""
    api_key_file: str | None = Field(default=None, min_length=1)
    """``restore`` and ``wake`` only: a file holding the API key the restored server requires from then on
    (``Authorization: Bearer KEY`` on the engine's guarded paths), installed in its HTTP process before the
    canary, which asks with it. A path, never the key: requests and receipts are kept and the key is never
    captured (docs/secrets.md). Left out of the canonical form when absent."""
    policy: Policy = Field(default_factory=Policy)
    """Overrides of the snapshot driver's default policy."""
    owner: FileOwner | None = None
    """Who gets every file and directory the operation writes under the artifact directory and the state
    root (coldsnap runs as root), mode bits kept, failed operations included. ``coldsnap CMD --owner
    UID:GID`` overrides it; without either, the caller's ``SUDO_UID``/``SUDO_GID`` under sudo, else nothing
    changes owner. Left out of the canonical form when absent, so requests without it keep their digests."""

    unit: UnitSelection | None = None
    """One unit of several: this launcher runs ``unit.unit_id`` on its host and meets the others at
    ``unit.rendezvous`` (:mod:`coldsnap.activation.units`). A capture's request may list only that unit
    (``coldsnap capture --units N --unit K``): the units' own requests are joined at the rendezvous. Left
    out of the canonical form when absent."""

    @property
    def partial(self) -> bool:
        """A capture request of one unit of several that lists only that unit."""
        return self.unit is not None and len(self.units) == 1

    @model_validator(mode="after")
    def _check_topology(self) -> "OperationRequest":
        unit_ids = [u.unit_id for u in self.units]
        if len(set(unit_ids)) != len(unit_ids):
            raise ValueError(f"units: duplicate unit_id in {unit_ids}")
        workers = [w for u in self.units for w in u.workers]
        worker_ids = [w.worker_id for w in workers]
        if len(set(worker_ids)) != len(worker_ids):
            raise ValueError(f"units: duplicate worker_id in {worker_ids}")
        ranks = sorted(w.rank for w in workers)
        if self.unit is not None:
            if self.unit.unit_id not in unit_ids:
                raise ValueError(f"unit: {self.unit.unit_id!r} is not one of the units {unit_ids}")
            if len(self.units) not in (1, self.unit.units):
                raise ValueError(f"unit: the request lists {len(self.units)} units, unit.units says {self.unit.units}")
            if len(self.units) == 1 and self.operation != "capture":
                raise ValueError(f"unit: a {self.operation} request lists every unit of the activation (the artifact's)")
            if self.unit.index >= self.unit.units:
                raise ValueError(f"unit: index {self.unit.index} is not in 0..{self.unit.units - 1}")
            if len(self.units) > 1 and self.units[self.unit.index].unit_id != self.unit.unit_id:
                raise ValueError(f"unit: units[{self.unit.index}] is {self.units[self.unit.index].unit_id!r}, "
                                 f"not {self.unit.unit_id!r}")
        if self.partial:  # its ranks are the unit's global ones; the joined request has them all
            if len(set(ranks)) != len(ranks):
                raise ValueError(f"units: a rank appears twice in {ranks}")
        elif ranks != list(range(len(workers))):
            raise ValueError(f"units: worker ranks must be 0..{len(workers) - 1} exactly once, got {ranks}")
        for unit in self.units:
            slots = [w.device_slot for w in unit.workers]
            if len(set(slots)) != len(slots):
                raise ValueError(f"units: unit {unit.unit_id!r} assigns one device_slot twice: {slots}")
        if self.prepare_only and self.operation != "restore":
            raise ValueError(f"prepare_only applies to restore only, not {self.operation}")
        if self.standby_ttl_s is not None and self.operation != "warm":
            raise ValueError(f"standby_ttl_s applies to warm only, not {self.operation}")
        if self.api_key_file is not None and self.operation not in ("restore", "wake"):
            raise ValueError(f"api_key_file applies to restore and wake only, not {self.operation} (a capture's "
                             "server runs without a key, so none is in its capsule)")
        if self.api_key_file is not None and self.engine not in ("vllm", "sglang"):
            raise ValueError(f"api_key_file: {self.engine} has no API key check to install (vLLM and SGLang have)")
        return self

    def to_json_value(self) -> dict[str, Any]:
        value = super().to_json_value()
        for optional in ("standby_ttl_s", "owner", "unit", "api_key_file"):
            if value.get(optional) is None:
                value.pop(optional, None)
        return value

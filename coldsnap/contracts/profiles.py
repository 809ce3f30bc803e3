"""Snapshot drivers and their default policy profiles.

Each driver owns its defaults; a request's omitted policy fields are resolved from them before the
request is validated as a whole and hashed (the seeds' operator contract).
"""

from __future__ import annotations

from dataclasses import dataclass

from coldsnap.contracts.base import ContractError
from coldsnap.contracts.common import EngineName, NativeMaterialization, SnapshotDriverName
from coldsnap.contracts.request import (
    CompatibilityPolicy,
    GraphPolicy,
    KvPolicy,
    OperationRequest,
    Policy,
    ValidationPolicy,
    WeightsPolicy,
)

__all__ = [
    "SnapshotDriverProfile",
    "SNAPSHOT_DRIVERS",
    "ENGINE_NATIVE_MATERIALIZATION",
    "ENGINE_PACKAGES",
    "CANARY_PROMPT",
    "CANARY_RESPONSE",
    "resolve_request",
]

CANARY_PROMPT = "Reply with exactly: coldsnap-cuda-snapshot-ok"
CANARY_RESPONSE = "coldsnap-cuda-snapshot-ok"


@dataclass(frozen=True)
class SnapshotDriverProfile:
    """A snapshot process driver: what it captures, the NVIDIA driver it needs, its default policy."""

    name: SnapshotDriverName
    minimum_nvidia_driver: int
    """Lowest NVIDIA kernel driver major version the driver supports."""
    boundary: str
    """What the captured process holds."""
    default_graph_mode: str
    """``retain`` when graph executables survive in the image, else ``recreate``."""

    def default_weights_mode(self, engine: EngineName) -> str:
        # vLLM on n580 restores through a pre-CUDA template, where recovery is the qualified default.
        return "recovery" if (self.name == "n580" and engine == "vllm") else "auto"


SNAPSHOT_DRIVERS: dict[str, SnapshotDriverProfile] = {
    "n580": SnapshotDriverProfile(
        name="n580",
        minimum_nvidia_driver=580,
        boundary="pre-CUDA process template; CUDA state is created fresh on restore",
        default_graph_mode="recreate",
    ),
    "n610": SnapshotDriverProfile(
        name="n610",
        minimum_nvidia_driver=610,
        boundary="initialized CUDA process state (CUDA checkpoint driver API)",
        default_graph_mode="retain",
    ),
}

# Native materialization modes each engine adapter supports, default first.
ENGINE_NATIVE_MATERIALIZATION: dict[str, tuple[NativeMaterialization, ...]] = {
    "vllm": ("async", "off", "required"),
    "sglang": ("off",),
    "torch-lm": ("off",),
}

# The Python package inside the serving image that integrates each engine.
ENGINE_PACKAGES: dict[str, str] = {
    "vllm": "coldsnap_vllm",
    "sglang": "coldsnap_sglang",
    "torch-lm": "coldsnap.workloads.torch_lm",
}


def resolve_request(request: OperationRequest) -> OperationRequest:
    """Fill every omitted policy field from the driver's profile; check the result against the engine.

    The returned request is what is hashed and recorded; raises :class:`ContractError` when an explicit
    setting is not supported by the selected engine.
    """
    profile = SNAPSHOT_DRIVERS[request.snapshot_driver]
    engine_modes = ENGINE_NATIVE_MATERIALIZATION[request.engine]
    given = request.policy
    materialization = given.weights.native_materialization or engine_modes[0]
    if materialization not in engine_modes:
        raise ContractError(
            "request",
            [
                f"policy.weights.native_materialization: {request.engine} supports "
                f"{', '.join(sorted(engine_modes))}, not {materialization}"
            ],
        )
    policy = Policy(
        weights=WeightsPolicy(
            mode=given.weights.mode or profile.default_weights_mode(request.engine),
            native_generation=given.weights.native_generation or "off",
            native_materialization=materialization,
        ),
        graphs=GraphPolicy(mode=given.graphs.mode or profile.default_graph_mode),
        kv=KvPolicy(mode=given.kv.mode or "discard"),
        compatibility=CompatibilityPolicy(
            enforce_captured_driver_floor=(
                True
                if given.compatibility.enforce_captured_driver_floor is None
                else given.compatibility.enforce_captured_driver_floor
            ),
            kernel=given.compatibility.kernel or "capability",
        ),
        validation=ValidationPolicy(
            prompt=given.validation.prompt if given.validation.prompt is not None else CANARY_PROMPT,
            expected_response=(
                given.validation.expected_response
                if given.validation.expected_response is not None
                else CANARY_RESPONSE
            ),
            max_tokens=given.validation.max_tokens or 16,
        ),
    )
    return request.model_copy(update={"policy": policy})

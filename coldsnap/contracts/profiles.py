"""What this build implements, and the default policy profile of each snapshot driver it implements.

One registry answers both questions a manager asks: what ``coldsnap capabilities`` advertises, and
what a request may name. A request naming anything else is refused at resolution with the code
``request.unsupported``. The contract types (:mod:`coldsnap.contracts.common`) keep the operator contract's whole
vocabulary — sleep/status, ``async`` and ``required`` materialization, ``cache-only-auto`` —
so such a request decodes and is refused by name rather than failing as a parse error.

Each driver owns its defaults; a request's omitted policy fields are resolved from them before the
request is validated as a whole and hashed (the operator contract, docs/design.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from coldsnap.contracts.base import ContractError
from coldsnap.contracts.common import (
    EngineName,
    GraphPolicyMode,
    NativeMaterialization,
    OperationName,
    ReplaySemantics,
    SnapshotDriverName,
    WeightsMode,
)
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
    "EngineAdapter",
    "SNAPSHOT_DRIVERS",
    "ENGINE_ADAPTERS",
    "OPERATIONS",
    "UNSUPPORTED",
    "UnsupportedRequest",
    "WEIGHTS_MODES",
    "CANARY_PROMPT",
    "CANARY_RESPONSE",
    "unsupported_problems",
    "resolve_request",
]

CANARY_PROMPT = "Reply with exactly: coldsnap-cuda-snapshot-ok"
CANARY_RESPONSE = "coldsnap-cuda-snapshot-ok"

UNSUPPORTED = "request.unsupported"
"""The receipt error code of a request that names something this build does not implement."""


@dataclass(frozen=True)
class SnapshotDriverProfile:
    """A snapshot process driver: what it captures, the NVIDIA driver it needs, its default policy."""

    name: SnapshotDriverName
    minimum_nvidia_driver: int
    """Lowest NVIDIA kernel driver major version the driver supports."""
    boundary: str
    """What the captured process holds."""
    default_graph_mode: GraphPolicyMode
    """``retain`` when graph executables survive in the image, else ``recreate``."""
    default_weights_mode: WeightsMode
    """Weight source when a request omits it."""
    cuda_checkpoint: bool
    """Whether it moves CUDA state with the CUDA checkpoint driver API (a host must have it)."""
    operations: tuple[OperationName, ...]
    """The operations it runs (n580 has no warm boundary: the engine starts only once placed)."""
    enforce_captured_driver_floor: bool
    """Whether a restore also needs the capture host's NVIDIA driver when the request omits it: an n610
    image holds that driver's CUDA state; an n580 template holds none (it is portable across drivers ≥ 580)."""


@dataclass(frozen=True)
class EngineAdapter:
    """An engine this build drives."""

    name: EngineName
    python_package: str
    """The Python package inside the serving image that integrates the engine."""
    native_materialization: tuple[NativeMaterialization, ...]
    """Native materialization modes this build runs, default first."""
    template_preload: tuple[str, ...]
    """What an n580 template imports before its pre-CUDA boundary (nothing that touches a GPU or NVML)."""


SNAPSHOT_DRIVERS: dict[str, SnapshotDriverProfile] = {
    "n580": SnapshotDriverProfile(
        name="n580",
        minimum_nvidia_driver=580,
        boundary="pre-CUDA template: the launcher with the engine's modules imported, placed at restore",
        default_graph_mode="recreate",  # the engine's own startup captures them again
        default_weights_mode="auto",
        cuda_checkpoint=False,
        operations=("capture", "restore"),
        enforce_captured_driver_floor=False,
    ),
    "n610": SnapshotDriverProfile(
        name="n610",
        minimum_nvidia_driver=610,
        boundary="initialized CUDA process state (CUDA checkpoint driver API)",
        default_graph_mode="retain",
        default_weights_mode="auto",
        cuda_checkpoint=True,
        operations=("capture", "restore", "warm", "wake"),
        enforce_captured_driver_floor=True,
    ),
}

# Materialization (a recovery restore also writing a native pack) is `off` everywhere: no restore path
# writes a pack, whatever the request says.
# A template preloads what the engine's startup imports first and that loads no NVIDIA device; a unit's
# COLDSNAP_TEMPLATE_PRELOAD env replaces the list. Not vLLM itself: `import vllm` probes the platform
# through NVML (opens /dev/nvidia*, seen with vLLM 0.26 on the H200), so its template preloads vLLM's
# heavy dependencies. A CUDA torch maps libcuda on import: on a GPU host these need placement ABI 1.
ENGINE_ADAPTERS: dict[str, EngineAdapter] = {
    "vllm": EngineAdapter(name="vllm", python_package="coldsnap_vllm", native_materialization=("off",),
                          template_preload=("torch", "transformers", "fastapi", "uvicorn", "openai")),
    "sglang": EngineAdapter(name="sglang", python_package="coldsnap_sglang", native_materialization=("off",),
                            template_preload=("torch", "transformers", "fastapi", "uvicorn")),
    "torch-lm": EngineAdapter(name="torch-lm", python_package="coldsnap.workloads.torch_lm",
                              native_materialization=("off",),
                              template_preload=("torch", "coldsnap.workloads.torch_lm.serve")),
}

# The operations `coldsnap capture`, `restore`, `warm` and `wake` run, with what repeating a request does:
# a repeated warm finds the standby it made and succeeds without a second one; a wake turns the standby
# into the serving process (a repeated wake finds no standby and fails, changing nothing).
OPERATIONS: dict[OperationName, ReplaySemantics] = {
    "capture": "conflicts-with-existing-output",
    "restore": "replacement-oriented",
    "warm": "convergent",
    "wake": "replacement-oriented",
}


class UnsupportedRequest(ContractError):
    """A well-formed request naming what this build does not implement; its receipt code is ``request.unsupported``."""

    code = UNSUPPORTED

    def __init__(self, problems: list[str]):
        super().__init__("request", problems)

    @property
    def message(self) -> str:
        """The problems as one line, for a receipt's error."""
        return "; ".join(self.problems)


def _not_implemented(location: str, value: str, implemented: Iterable[str], scope: str = "this build") -> str:
    return f"{location}: {value} is not implemented in {scope} (implemented: {', '.join(implemented)})"


# Where restore takes the weights from. `native`: the native pack, or nothing; `auto`: the pack, else (missing or
# failing verification) the safetensors the capture pinned, replayed into the captured layout plus the residual;
# `recovery`: those safetensors always (a `recovery` capture with native generation off writes no pack).
# `cache-only-auto` is not built.
WEIGHTS_MODES: tuple[WeightsMode, ...] = ("auto", "native", "recovery")


def unsupported_problems(request: OperationRequest) -> list[str]:
    """One line for every field of ``request`` naming what this build does not implement."""
    problems = []
    if request.operation not in OPERATIONS:
        problems.append(_not_implemented("operation", request.operation, OPERATIONS))
    adapter = ENGINE_ADAPTERS.get(request.engine)
    if adapter is None:
        problems.append(_not_implemented("engine", request.engine, sorted(ENGINE_ADAPTERS)))
    driver = SNAPSHOT_DRIVERS.get(request.snapshot_driver)
    if driver is None:
        problems.append(_not_implemented("snapshot_driver", request.snapshot_driver, SNAPSHOT_DRIVERS))
    elif request.operation in OPERATIONS and request.operation not in driver.operations:
        problems.append(_not_implemented("operation", request.operation, driver.operations,
                                          f"snapshot driver {driver.name}"))
    weights_mode = request.policy.weights.mode
    if weights_mode is not None and weights_mode not in WEIGHTS_MODES:
        problems.append(_not_implemented("policy.weights.mode", weights_mode, WEIGHTS_MODES))
    materialization = request.policy.weights.native_materialization
    if adapter is not None and materialization is not None and materialization not in adapter.native_materialization:
        problems.append(_not_implemented("policy.weights.native_materialization", materialization,
                                         adapter.native_materialization, f"this build for {adapter.name}"))
    return problems


def resolve_request(request: OperationRequest) -> OperationRequest:
    """Fill every omitted policy field from the driver's profile and the engine adapter.

    The returned request is what is hashed and recorded; raises :class:`UnsupportedRequest` when the
    request names an operation, engine, snapshot driver or policy value this build does not implement.
    """
    problems = unsupported_problems(request)
    if problems:
        raise UnsupportedRequest(problems)
    profile = SNAPSHOT_DRIVERS[request.snapshot_driver]
    adapter = ENGINE_ADAPTERS[request.engine]
    given = request.policy
    policy = Policy(
        weights=WeightsPolicy(
            mode=given.weights.mode or profile.default_weights_mode,
            native_generation=given.weights.native_generation or "off",
            native_materialization=given.weights.native_materialization or adapter.native_materialization[0],
        ),
        graphs=GraphPolicy(mode=given.graphs.mode or profile.default_graph_mode),
        kv=KvPolicy(mode=given.kv.mode or "discard"),
        compatibility=CompatibilityPolicy(
            enforce_captured_driver_floor=(
                profile.enforce_captured_driver_floor
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

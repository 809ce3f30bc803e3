"""What a restore brings back and where: decided once, by the rules of this module (standard library only).

A restore has two ways in. The program's fast entry (:mod:`coldsnap.activation.early_restore`) decides from
the command line and the artifact's JSON before pydantic is imported, so that CRIU starts then; admission
(:mod:`coldsnap.activation.admission`) decides from the strictly decoded request and artifact. Both decide
with these functions, on the same JSON shapes (admission on its models' JSON form), and admission *checks*
the entry's decision against its own rather than deciding anything again: an entry that decided otherwise
is abandoned, saying how it differed (``restore.admission.early``).

- :func:`aimed_request`: the request of a restore, warm or wake of an artifact, its capture's re-aimed by the
  command's flags (the port, the GPUs, the weights' mode, the unit, the API key file);
- :func:`chosen_unit` and :func:`decide`: from that request, the artifact's descriptor and the unit's capsule,
  the :class:`RestoreInputs`: the unit, the serving port, the weights' mode, the GPUs asked for and the
  capture's, and what the replica plan needs (:meth:`RestoreInputs.replica`, :meth:`RestoreInputs.gpu_placement`).
"""

from __future__ import annotations

import argparse
import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coldsnap.activation.restore_place import GpuPlacement, Replica, gpu_remap, plan

__all__ = ["RequestProblem", "RestoreInputs", "aimed_request", "chosen_unit", "decide", "differences", "unit_capsule",
           "unit_images"]

WEIGHTS_MODES = ("auto", "native", "recovery")


class RequestProblem(ValueError):
    """The flags do not fit the artifact (the CLI says it as a usage error; the fast entry declines)."""


def unit_images(root: Path, unit_id: str) -> Path:
    """Where a unit's CRIU images are in an artifact (:meth:`coldsnap.activation.artifact_dir.ArtifactDir.images`)."""
    return root / "units" / unit_id / "images"


def unit_capsule(root: Path, unit_id: str) -> Path:
    """Where a unit's capsule manifest is in an artifact, beside its images."""
    return root / "units" / unit_id / "capsule.json"


def _units(request: dict[str, Any]) -> list[dict[str, Any]]:
    return request.get("units") or [{}]


def aimed_request(captured: dict[str, Any], operation: str, directory: Path, operation_id: str,
                  args: argparse.Namespace, selection: dict[str, Any] | None) -> dict[str, Any]:
    """The request of ``operation`` (restore, warm, wake) on the artifact at ``directory``: ``captured`` (its
    ``request.json``, left as it is) re-aimed by ``args`` — the command's parsed flags — and ``selection``
    (``{"index": K, "unit": {...}}`` for one unit of several, else None). :class:`RequestProblem` when they do
    not fit the artifact."""
    captured = copy.deepcopy(captured)
    captured.update(operation=operation, operation_id=operation_id, artifact=str(directory))
    captured.pop("owner", None)  # the capture's caller's: this operation's owner is its own caller's
    units = _units(captured)
    if selection:
        if selection["unit"]["units"] != len(units):
            raise RequestProblem(f"--units {selection['unit']['units']}, but {directory} is an artifact of "
                                 f"{len(units)} launch unit(s)")
        captured["unit"] = selection["unit"] | {"unit_id": units[selection["index"]].get("unit_id")}
    elif len(units) > 1:
        raise RequestProblem(f"{directory} is an artifact of {len(units)} launch units: {operation} each on its own "
                             f"host with --units {len(units)} --unit K --rendezvous HOST:PORT --rendezvous-token-file "
                             f"F (all at once; a subset of the units is never "
                             f"{ {'wake': 'woken', 'warm': 'warmed'}.get(operation, 'restored')})")
    if operation == "restore":
        captured["prepare_only"] = args.prepare_only
        unit = units[selection["index"]] if selection else units[0]
        if args.port is not None:
            unit["serving_port"] = args.port
        if args.gpu is not None:
            unit.setdefault("env", {})["CUDA_VISIBLE_DEVICES"] = args.gpu
    if getattr(args, "api_key_file", None):
        captured["api_key_file"] = str(Path(args.api_key_file).resolve())
    if operation == "warm" and args.ttl is not None:
        captured["standby_ttl_s"] = args.ttl
    if args.weights:
        policy = captured.setdefault("policy", {})
        policy.setdefault("weights", {})["mode"] = args.weights
    return captured


@dataclass(frozen=True)
class RestoreInputs:
    """Everything a restore decides before it starts anything, and nothing it finds on the host."""

    artifact: Path
    """The artifact directory, resolved."""
    unit_index: int
    unit_id: str
    captured_port: int
    """The serving port the unit's image listens on."""
    serving_port: int
    """Where the restored server listens (its other ports move by the same shift)."""
    weights_mode: str
    """``auto``, ``native`` or ``recovery`` (:func:`coldsnap.activation.admission.weight_sources`)."""
    gpus: str | None
    """The ``CUDA_VISIBLE_DEVICES`` the request places the ranks on (``--gpu``); None: unset."""
    captured_gpus: str | None
    """The ``CUDA_VISIBLE_DEVICES`` the capture gave the engine; None: unset."""
    controls: tuple[tuple[int, str], ...]
    """Rank → its agent's captured control socket, in rank order."""
    template_control: str | None
    """An n580 template's control socket as captured."""

    @property
    def images(self) -> Path:
        return unit_images(self.artifact, self.unit_id)

    def replica(self, moved: dict[bytes, bytes] | None = None) -> Replica:
        """This restore's place on the host, every bind probed (:func:`coldsnap.activation.restore_place.plan`;
        :class:`~coldsnap.activation.restore_place.PortsTaken` when something it needs is taken). ``moved``: one
        unit of several, every unit's captured address → its new one."""
        return plan(self.images, self.captured_port, self.serving_port, dict(self.controls), self.template_control,
                    moved)

    def gpu_placement(self, captured_uuids: list[str], current_uuids: list[str]) -> GpuPlacement:
        """Where the image's GPUs go on this host (:func:`coldsnap.activation.restore_place.gpu_remap`; a
        :class:`ValueError` when the GPUs asked for are not there)."""
        return gpu_remap(captured_uuids, self.captured_gpus, current_uuids, self.gpus)


def chosen_unit(request: dict[str, Any], descriptor: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """The index and descriptor record of the unit this restore brings back: the request's selection of one
    of several, else the only one (admission refuses the rest, ``admission.topology``)."""
    selection = request.get("unit")
    index = selection["index"] if selection else 0
    return index, descriptor["units"][index]


def decide(request: dict[str, Any], captured: dict[str, Any] | None, descriptor: dict[str, Any],
           capsule: dict[str, Any], root: Path) -> RestoreInputs:
    """The restore's :class:`RestoreInputs` from its request, the capture's request (None: unreadable), the
    artifact's descriptor and the chosen unit's capsule, all as JSON; KeyError, TypeError or ValueError on
    a document without what it needs (strict decoding says more, at admission)."""
    index, unit = chosen_unit(request, descriptor)
    metadata = capsule["metadata"]
    units = _units(request)
    # (a unit of several that serves nothing moves its ports as unit 0's serving port does)
    asked = units[index].get("serving_port") or units[0].get("serving_port")
    mode = ((request.get("policy") or {}).get("weights") or {}).get("mode") or "auto"
    if mode not in WEIGHTS_MODES:
        raise ValueError(f"weights mode {mode!r}")
    template = metadata.get("template")
    captured_units = _units(captured or {})
    return RestoreInputs(
        artifact=root.resolve(), unit_index=index, unit_id=unit["unit_id"],
        captured_port=metadata["serving_port"], serving_port=asked or metadata["serving_port"],
        weights_mode=mode, gpus=(units[index].get("env") or {}).get("CUDA_VISIBLE_DEVICES"),
        captured_gpus=(captured_units[index].get("env") or {}).get("CUDA_VISIBLE_DEVICES")
        if index < len(captured_units) else None,
        controls=tuple(sorted((worker["rank"], worker["control"]) for worker in metadata["workers"])),
        template_control=template["control"] if template else None)


def differences(entry: RestoreInputs, admitted: RestoreInputs) -> list[str]:
    """What the fast entry decided otherwise than admission (empty: the same restore)."""
    return [f"{name} {getattr(entry, name)!r}, admission {getattr(admitted, name)!r}"
            for name in RestoreInputs.__dataclass_fields__ if getattr(entry, name) != getattr(admitted, name)]

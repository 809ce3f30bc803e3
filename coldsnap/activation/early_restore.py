"""A restore's first step: CRIU started before the rest of coldsnap is imported (standard library only).

``coldsnap restore DIR`` spends its first ~0.2-0.3 s importing pydantic and building the contract
models; CRIU's restore of the tree takes about as long, and needs none of them. So the program's entry
(:mod:`coldsnap.__main__`) calls :func:`start_tree` first: from the artifact's own JSON, read strictly
with the standard library, it checks what must hold before anything of the artifact runs —

- the descriptor is an n610 artifact of one launch unit, captured on this architecture;
- the capsule manifest and every CRIU image are the bytes the descriptor binds, vouched for by their
  validation records (:mod:`coldsnap.payload.records`; nothing is hashed here);
- the serving port's lock (:mod:`coldsnap.activation.operation_locks`) and every bind of the replica
  (:func:`coldsnap.activation.restore_place.plan`) —

then writes the replica's images and starts CRIU (:meth:`~coldsnap.snapshot.criu.CriuSnapshotter.start_restore`),
and, where the restore's launcher stages weights (:mod:`coldsnap.activation.staging`: the native packs
vouched for by their records, the GPUs placed as the request places them and with room for the restore),
starts that staging beside CRIU (:class:`EarlyStaging`).
Strict decoding is deferred, not dropped: the operation then runs its whole admission as always
(:func:`coldsnap.activation.admission.admit`), and only a restore it admits adopts the tree
(:meth:`EarlyRestore.adopt`, the same artifact, unit and port) and each rank's staging where admission
places that rank's weights as the entry did; any failure before that kills the tree and drops the staged
memory (:meth:`EarlyRestore.abandon`). The restored tree holds no GPU memory until the CUDA restore, which
only an admitted restore reaches, so an abandoned one loses nothing.

What it restores and where — the unit, the serving port, the weights' mode, the GPUs, the replica — it
decides with the rules admission decides with (:mod:`coldsnap.activation.restore_inputs`), from flags parsed
by the CLI's own definitions (:func:`coldsnap.cli.flags.restore_arguments`); admission then checks that it
decided the same. Whatever this step does not handle — another flag (``--prepare-only``, ``--request-json``,
``--owner``, units, ``--host-thp``), ``oci://``, sudo's caller as owner, not root, an n580 artifact, a file
no record vouches for, a port or lock taken, any error — leaves everything to the full path, which does it
all and reports what is wrong as before; the receipt says why (``restore.admission.early``).
``COLDSNAP_EARLY_RESTORE=0`` turns the step off.

What it did is one object, :class:`FastEntry`, handed from the program's entry to the CLI and on to the
restore (:func:`coldsnap.activation.lifecycle.restore`); whoever holds it last abandons a tree no restore adopted.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NoReturn

from coldsnap.activation.operation_locks import LockHeld, OperationLock, PortLock
from coldsnap.activation.restore_place import PortsTaken, Replica, write_replica_images
from coldsnap.activation.restore_inputs import (RequestProblem, RestoreInputs, aimed_request, chosen_unit, decide,
                                               unit_capsule)
from coldsnap.activation.state import artifact_id
from coldsnap.cli.flags import restore_arguments
from coldsnap.contracts.canonical import parse_strict_json
from coldsnap.host import STATE_DIR_ENV, state_root
from coldsnap.operation_ids import new_operation_id
from coldsnap.payload.records import vouched_by_records
from coldsnap.secrets.served_key import ApiKeyFileError, read_api_key
from coldsnap.snapshot.criu import CriuSnapshotter
from coldsnap.snapshot.criu_options import SnapshotOptions
from coldsnap.snapshot.criu_restore import PendingRestore
from coldsnap.snapshot.thp import HOST_THP_ENV
from coldsnap.settings import SETTINGS, SettingError

__all__ = ["EARLY_RESTORE_ENV", "EarlyRestore", "EntryPlan", "FastEntry", "entry_plan", "start_tree"]

EARLY_RESTORE_ENV = "COLDSNAP_EARLY_RESTORE"
EARLY_STAGING_ENV = "COLDSNAP_EARLY_STAGING"
"""``0``: the entry starts CRIU but leaves the weights' staging to the restore's own step (after admission)."""

_TAKEN = frozenset({"artifact", "port", "gpu", "weights", "api_key_file", "state_dir", "receipt_json", "timing_events",
                    "operation_id"})
"""The destinations of ``coldsnap restore``'s flags this step takes (none changes what CRIU restores but the
port and the state directory; the API key is installed by the full path, after the ranks resumed); any other
flag given leaves the restore to the full path."""


@dataclass
class EarlyRestore:
    """A tree whose CRIU restore this process started at its entry, not yet adopted by the restore."""

    inputs: RestoreInputs
    """What the entry decided (admission checks it decides the same: :func:`~coldsnap.activation.restore_inputs.differences`)."""
    artifact_id: str
    operation_id: str
    replica: Replica
    lock: OperationLock
    pending: PendingRestore
    origin: tuple[int, int]
    """(monotonic, unix) nanoseconds at this process's entry: the operation's clock origin."""
    checked_ns: tuple[int, int]
    """When this step's checks ran, on that clock (from the program's start: its imports included)."""
    criu_started_ns: int
    staging: EarlyStaging | None = None
    """The launcher's staging of the ranks' weights, started beside CRIU (where it stages)."""
    settled: bool = False
    """Adopted by the restore (its to finish) or abandoned: nobody's to take any more."""

    def adopt(self) -> PendingRestore:
        """The restore's from here on: its CRIU to finish (and to kill on failure, as its own)."""
        self.settled = True
        return self.pending

    def abandon(self) -> None:
        """Kill the tree and release the port (an admission failed, or another restore was admitted)."""
        if self.settled:
            return
        self.settled = True
        self.pending.abandon()
        if self.staging is not None:
            self.staging.drop()
        self.lock.release()


class EarlyStaging:
    """The ranks' weights staged by the entry: decided on a thread of its own (the GPUs' placement and
    room), then one :class:`~coldsnap.activation.staging.WeightStager` per rank. The restore takes the
    stagers it would have started itself (:meth:`take`); :meth:`drop` cancels and releases the rest."""

    def __init__(self, decide: Callable[[], tuple[dict[int, Any], dict[int, int], dict[str, int]]]):
        self.stagers: dict[int, Any] = {}
        self.devices: dict[int, int] = {}
        """The engine's device ordinal → this launcher's, as the entry placed them."""
        self.held: dict[str, int] = {}
        """GPU UUID → the bytes the stagers map there and the launcher's context: free for this restore."""
        self.skipped = ""
        """Why nothing was staged, if so (for the receipt)."""

        def run() -> None:
            try:
                self.stagers, self.devices, self.held = decide()
            except Exception as exc:  # noqa: BLE001 - the restore then stages as it always did
                self.skipped = f"{type(exc).__name__}: {exc}"

        self._thread = threading.Thread(target=run, name="coldsnap-early-staging", daemon=True)
        self._thread.start()

    def decided(self) -> "EarlyStaging":
        self._thread.join()
        return self

    def take(self, rank: int, devices: dict[int, int]) -> Any | None:
        """Rank ``rank``'s stager, if the entry started one onto the GPUs admission placed it on (``devices``)."""
        self.decided()
        stager = self.stagers.get(rank)
        if stager is None or any(devices.get(device, device) != mine for device, mine in self.devices.items()):
            return None
        return self.stagers.pop(rank)

    def drop(self) -> None:
        """Cancel and release every stager not taken."""
        self.decided()
        for stager in self.stagers.values():
            stager.cancel()
        for stager in self.stagers.values():
            stager.join()
            stager.release()
        self.stagers.clear()


@dataclass
class FastEntry:
    """What the program's entry did for this ``coldsnap restore``: the tree it started, or why it declined."""

    tree: EarlyRestore | None
    declined: str | None
    """Why no tree was started (None: one was): the receipt's ``restore.admission.early``."""

    def abandon(self) -> None:
        """A tree no restore adopted is killed (a no-op once adopted, or when none was started)."""
        if self.tree is not None:
            self.tree.abandon()


NOT_RUN = FastEntry(None, "the program's entry did not run it")
"""A restore started otherwise than by ``coldsnap restore`` (in process, a capture's check restore)."""


class _Declined(Exception):
    """The fast entry leaves this restore to the full path, for the reason given (the receipt says it)."""


def start_tree(argv: list[str], origin: tuple[int, int] | None = None) -> FastEntry:
    """``coldsnap restore`` ARGV's tree started, or nothing done and why. Never raises. ``origin``: (monotonic,
    unix) nanoseconds of the program's start, the operation's clock (default now)."""
    origin = origin or (time.monotonic_ns(), time.time_ns())
    try:
        try:
            if not SETTINGS.flag(EARLY_RESTORE_ENV):
                raise _Declined(f"{EARLY_RESTORE_ENV} is off")
        except SettingError as exc:  # the full path says what is wrong, if anything reads it
            raise _Declined(str(exc)) from None
        if os.geteuid() != 0:
            raise _Declined("not root")
        if os.environ.get("SUDO_UID") or os.environ.get("SUDO_GID"):
            raise _Declined("under sudo (the full path hands what it writes to the caller)")
        if SETTINGS.text(HOST_THP_ENV):
            raise _Declined("--host-thp (the host's THP mode is switched by the full path)")
        return FastEntry(_start(entry_plan(argv), origin), None)
    except _Declined as declined:
        return FastEntry(None, str(declined))
    except Exception as exc:  # noqa: BLE001 - the full path does everything again and says what is wrong
        return FastEntry(None, f"{type(exc).__name__}: {exc}")


class _EntryParser(argparse.ArgumentParser):
    """The restore's own flags (:func:`~coldsnap.cli.flags.restore_arguments`), a bad one declined, not exited on."""

    def error(self, message: str) -> NoReturn:
        raise _Declined(f"the arguments: {message}")


def _parsed(argv: list[str]) -> argparse.Namespace:
    """ARGV as ``coldsnap restore`` parses it; :class:`_Declined` for a flag given that the entry does not take."""
    parser = _EntryParser(prog="coldsnap restore", add_help=False)
    restore_arguments(parser)
    args = parser.parse_args(argv)
    for action in parser._actions:
        if action.dest not in _TAKEN and getattr(args, action.dest) != action.default:
            raise _Declined(f"{max(action.option_strings, key=len)} is not an option the fast entry takes")
    if args.artifact is None:
        raise _Declined("no artifact directory")
    if "://" in args.artifact:
        raise _Declined("an oci:// reference (pulled by the full path first)")
    return args


@dataclass(frozen=True)
class EntryPlan:
    """What the entry decided from its argv and the artifact's JSON, before it touches anything."""

    args: argparse.Namespace
    inputs: RestoreInputs
    descriptor: dict[str, Any]
    captured: dict[str, Any]
    """The capture's ``request.json``."""
    request: dict[str, Any]
    """This restore's request (:func:`~coldsnap.activation.restore_inputs.aimed_request`)."""
    capsule: dict[str, Any]


def entry_plan(argv: list[str]) -> EntryPlan:
    """The restore ARGV asks for, decided as admission decides it (:func:`~coldsnap.activation.restore_inputs.decide`);
    :class:`_Declined` where the entry leaves it to the full path. Reads files, changes nothing."""
    args = _parsed(argv)
    root = Path(args.artifact).resolve()
    descriptor = parse_strict_json((root / "artifact.json").read_bytes())
    captured = parse_strict_json((root / "request.json").read_bytes())
    if args.api_key_file:
        try:
            read_api_key(Path(args.api_key_file))
        except ApiKeyFileError as exc:
            raise _Declined(f"--api-key-file: {exc}") from None
    try:
        request = aimed_request(captured, "restore", root, args.operation_id or "", args, None)
    except RequestProblem as exc:
        raise _Declined(str(exc)) from None
    if (descriptor.get("snapshot_driver") != "n610" or len(descriptor["units"]) != 1
            or _object(descriptor, "platform", "arch") != os.uname().machine):  # (platform.machine(), unimported)
        raise _Declined("not a one-unit n610 artifact of this machine's architecture")
    _, unit = chosen_unit(request, descriptor)
    capsule_path = root / _object(unit, "capsule", "path")
    if capsule_path != unit_capsule(root, unit["unit_id"]):
        raise _Declined("the capsule is not beside its images")
    capsule = parse_strict_json(capsule_path.read_bytes())
    if capsule.get("unit_id") != unit["unit_id"]:
        raise _Declined("the capsule is another unit's")
    return EntryPlan(args, decide(request, captured, descriptor, capsule, root), descriptor, captured, request, capsule)


def _object(document: Any, *keys: str | int) -> Any:
    """``document[k0][k1]...``; KeyError/TypeError on anything missing (the caller falls back)."""
    for key in keys:
        document = document[key]
    return document


def _start(decided: EntryPlan, origin: tuple[int, int]) -> EarlyRestore:
    args, inputs, capsule = decided.args, decided.inputs, decided.capsule
    if args.state_dir:  # (as the full path's --state-dir does)
        SETTINGS.give(STATE_DIR_ENV, os.path.abspath(args.state_dir))
    root, images = inputs.artifact, inputs.images
    identity = artifact_id(root)
    records = state_root() / identity / "records"
    capsule_path = unit_capsule(root, inputs.unit_id)
    files = [(capsule_path, _object(decided.descriptor, "units", inputs.unit_index, "capsule", "sha256"))]
    files += [(images / entry["path"], entry["sha256"]) for entry in capsule["files"]]
    record_dirs: dict[Path, Path | None] = {folder: records / folder.relative_to(root)
                                            for folder in {path.parent for path, _ in files}}
    if any(".." in Path(entry["path"]).parts for entry in capsule["files"]):
        raise _Declined("a capsule file outside its images")
    if not vouched_by_records(files, record_dirs):
        raise _Declined("its files are not vouched for by this host's validation records yet (the full path checks "
                        "and records them: the next restore here takes the fast entry)")
    metadata = capsule["metadata"]
    operation_id = args.operation_id or new_operation_id("restore")
    try:
        lock = PortLock(inputs.serving_port, "restore", operation_id, str(root)).acquire()
    except LockHeld as exc:
        raise _Declined(f"the port's lock is held: {exc}") from None
    pending: PendingRestore | None = None
    try:
        replica = inputs.replica()
        checked_ns = time.monotonic_ns() - origin[0]
        state_dir = state_root() / identity / replica.name
        state_dir.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        state_dir.mkdir(exist_ok=True, mode=0o700)
        copy = write_replica_images(images, state_dir, replica)
        if metadata.get("gpu_pids"):  # the checkpoint API ready when the tree is
            from coldsnap.snapshot.cuda_checkpoint import start_cuda_in_background

            start_cuda_in_background()
        criu_started_ns = time.monotonic_ns() - origin[0]
        pending = CriuSnapshotter(options=SnapshotOptions(tcp=metadata["criu_tcp"])).start_restore(
            copy, state_dir, root, own_images=True)
        staging = _start_staging(decided, records, origin) \
            if metadata.get("gpu_pids") and SETTINGS.flag(EARLY_STAGING_ENV) else None
        return EarlyRestore(inputs, identity, operation_id, replica, lock, pending, origin, (0, checked_ns),
                            criu_started_ns, staging)
    except PortsTaken as exc:
        lock.release()
        raise _Declined(f"the replica's ports: {exc}") from None
    except BaseException:
        if pending is not None:
            pending.abandon()
        lock.release()
        raise


def _start_staging(decided: EntryPlan, records: Path, origin: tuple[int, int]) -> EarlyStaging:
    """Each rank's weights staged as the restore would stage them (:func:`~coldsnap.activation.staging.stages_rank`),
    where its packs are vouched for by their records and its GPUs, placed as the request places them, have
    room for the whole restore (:func:`~coldsnap.activation.gpu_room.shortfalls`); decided on a thread."""
    from coldsnap.activation.gpu_room import LAUNCHER_CONTEXT_BYTES, needs_per_gpu, shortfalls
    from coldsnap.activation.staging import WeightStager, stages_rank
    from coldsnap.activation.state import host_cache_dir

    inputs, metadata = decided.inputs, decided.capsule["metadata"]
    root, mode = inputs.artifact, inputs.weights_mode
    unit = decided.descriptor["units"][inputs.unit_index]
    by_rank = {w["rank"]: w for w in metadata["workers"]}

    def decide() -> tuple[dict[int, Any], dict[int, int], dict[str, int]]:
        from coldsnap.snapshot.cuda_checkpoint import cuda_devices
        from coldsnap.snapshot.nvml import device_memory

        ranks = {}
        for worker in unit["workers"]:
            regions = {tag: _Region.of(r) for tag, r in by_rank[worker["rank"]]["regions"].items()}
            packs = [(root / ref["path"], ref["sha256"]) for ref in (worker.get("payload"), worker["residual"]) if ref]
            folders = {path.parent: records / path.parent.relative_to(root) for path, _ in packs}
            source = "native" if mode != "recovery" and vouched_by_records(packs, folders) else None
            if stages_rank("restore", source, worker.get("payload"), regions):
                ranks[worker["rank"]] = (worker, regions)
        if not ranks:
            return {}, {}, {}
        current = [device["uuid"] for device in cuda_devices(host_cache_dir())]
        placement = inputs.gpu_placement(metadata["gpu_uuids"], current)
        cuda_regions = {by_rank[rank]["pid"]: {tag: r["high_water"] for tag, r in by_rank[rank]["regions"].items()
                                               if r["backend"] == "cuda"} for rank in by_rank}
        needs = needs_per_gpu([(u["gpu_uuid"], u["pid"], u["serving_bytes"]) for u in metadata.get("gpu_memory", [])],
                              cuda_regions, dict(placement.pairs), staging=True)
        if shortfalls(needs, {uuid: memory.free for uuid, memory in device_memory().items()}):
            return {}, {}, {}  # (admission refuses it, saying why)
        held: dict[str, int] = {}
        stagers = {}
        for rank, (worker, regions) in ranks.items():
            for record in WeightStager.stageable(regions).values():
                uuid = current[placement.launcher_ordinals.get(record.device, record.device)]
                held[uuid] = held.get(uuid, LAUNCHER_CONTEXT_BYTES) + record.high_water
            residual = worker["residual"]
            stagers[rank] = WeightStager(regions, root / worker["payload"]["path"],
                                         root / residual["path"] if residual else None, worker["layout_digest"],
                                         lambda: time.monotonic_ns() - origin[0],
                                         placement.launcher_ordinals).start()
        return stagers, placement.launcher_ordinals, held

    return EarlyStaging(decide)


@dataclass(frozen=True)
class _Region:
    """What staging reads of a region's record (:class:`~coldsnap.activation.staging.StageableRegion`), from its JSON."""

    backend: str
    device: int
    high_water: int
    chunk_bytes: int

    @classmethod
    def of(cls, record: dict) -> "_Region":
        numbers = [record["device"], record["high_water"], record["chunk_bytes"]]
        if not isinstance(record["backend"], str) or any(type(n) is not int or n < -1 for n in numbers):
            raise ValueError(f"not a region record: {record!r}")  # (strict decoding says more, later)
        return cls(record["backend"], *numbers)

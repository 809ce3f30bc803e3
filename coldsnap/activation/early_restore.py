"""A restore's first step: CRIU started before the rest of coldsnap is imported (standard library only).

``coldsnap restore DIR`` spends its first ~0.2-0.3 s importing pydantic and building the contract
models; CRIU's restore of the tree takes about as long, and needs none of them. So the program's entry
(:mod:`coldsnap.__main__`) calls :func:`start_tree` first: from the artifact's own JSON, read strictly
with the standard library, it checks what must hold before anything of the artifact runs —

- the descriptor is an n610 artifact of one launch unit, captured on this architecture;
- the capsule manifest and every CRIU image are the bytes the descriptor binds, vouched for by their
  validation records (:mod:`coldsnap.payload.records`; nothing is hashed here);
- the serving port's lock (:mod:`coldsnap.activation.operation_locks`) and every bind of the replica
  (:func:`coldsnap.activation.replica_plan.plan`) —

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

Whatever this step does not handle — another command or flag (``--prepare-only``, ``--request-json``,
``--owner``, units, ``oci://``, ``--host-thp``), sudo's caller as owner, not root, an n580 artifact, a
file no record vouches for, a port or lock taken, any error — leaves everything to the full path, which
does it all and reports what is wrong as before. ``COLDSNAP_EARLY_RESTORE=0`` turns the step off.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from coldsnap.activation.operation_locks import LockHeld, OperationLock, PortLock
from coldsnap.activation.replica_plan import PortsTaken, Replica, plan, write_replica_images
from coldsnap.activation.state import artifact_id
from coldsnap.contracts.canonical import parse_strict_json
from coldsnap.host import STATE_DIR_ENV, state_root
from coldsnap.operation_ids import new_operation_id
from coldsnap.payload.records import vouched_by_records
from coldsnap.snapshot.criu import CriuSnapshotter
from coldsnap.snapshot.criu_options import SnapshotOptions
from coldsnap.snapshot.criu_restore import PendingRestore
from coldsnap.snapshot.thp import HOST_THP_ENV
from coldsnap.settings import SETTINGS, SettingError

__all__ = ["EARLY_RESTORE_ENV", "EarlyRestore", "abandon_unadopted", "early_decision", "early_restore", "start_tree"]

EARLY_RESTORE_ENV = "COLDSNAP_EARLY_RESTORE"
EARLY_STAGING_ENV = "COLDSNAP_EARLY_STAGING"
"""``0``: the entry starts CRIU but leaves the weights' staging to the restore's own step (after admission)."""

_VALUED_FLAGS = ("--port", "--gpu", "--state-dir", "--receipt-json", "--timing-events", "--operation-id", "--weights",
                 "--api-key-file")
"""``coldsnap restore`` flags this step takes (none changes what CRIU restores but the port and the state
directory; the API key is installed by the full path, after the ranks resumed); any other flag leaves the
restore to the full path."""


@dataclass
class EarlyRestore:
    """A tree whose CRIU restore this process started at its entry, not yet adopted by the restore."""

    root: Path
    """The artifact directory (resolved)."""
    artifact_id: str
    unit_id: str
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
    _done: bool = False

    def matches(self, root: Path, identity: str, unit_id: str, serving_port: int) -> bool:
        """Whether the admitted restore is the one this step started (same artifact bytes, unit and port)."""
        return ((not self._done) and root.resolve() == self.root and identity == self.artifact_id
                and unit_id == self.unit_id and serving_port == self.replica.serving_port)

    def adopt(self) -> PendingRestore:
        """The restore's from here on: its CRIU to finish (and to kill on failure, as its own)."""
        self._done = True
        return self.pending

    def abandon(self) -> None:
        """Kill the tree and release the port (an admission failed, or another restore was admitted)."""
        if self._done:
            return
        self._done = True
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


_started: EarlyRestore | None = None
_declined: str | None = "the program's entry did not run it"  # why no tree was started (None: one was)


class _Declined(Exception):
    """The fast entry leaves this restore to the full path, for the reason given (the receipt says it)."""


def early_decision() -> tuple[bool, str | None]:
    """Whether the entry started this restore's tree, and why not when it did not (the receipt's
    ``restore.admission.early``)."""
    return _declined is None, _declined


def early_restore() -> EarlyRestore | None:
    """The tree this process's entry started, until a restore adopts or abandons it."""
    return _started if _started is not None and not _started._done else None


def abandon_unadopted() -> None:
    """At the program's end: a tree no restore adopted (a usage error after the entry started it) is killed."""
    pending = early_restore()
    if pending is not None:
        pending.abandon()


def start_tree(argv: list[str], origin: tuple[int, int] | None = None) -> None:
    """``coldsnap restore`` ARGV's tree started (:func:`early_restore` has it), or nothing done. Never raises.
    ``origin``: (monotonic, unix) nanoseconds of the program's start, the operation's clock (default now)."""
    global _started, _declined
    origin = origin or (time.monotonic_ns(), time.time_ns())
    try:
        try:
            if not SETTINGS.flag(EARLY_RESTORE_ENV):
                raise _Declined(f"{EARLY_RESTORE_ENV} is off")
        except SettingError as exc:  # the full path says what is wrong, if anything reads it
            raise _Declined(str(exc)) from None
        flags = _flags(argv)
        if os.geteuid() != 0:
            raise _Declined("not root")
        if os.environ.get("SUDO_UID") or os.environ.get("SUDO_GID"):
            raise _Declined("under sudo (the full path hands what it writes to the caller)")
        if SETTINGS.text(HOST_THP_ENV):
            raise _Declined("--host-thp (the host's THP mode is switched by the full path)")
        _started = _start(flags, origin)
        _declined = None
    except _Declined as declined:
        _started, _declined = None, str(declined)
    except Exception as exc:  # noqa: BLE001 - the full path does everything again and says what is wrong
        _started, _declined = None, f"{type(exc).__name__}: {exc}"


def _flags(argv: list[str]) -> dict[str, str]:
    """``DIR`` and the valued flags of :data:`_VALUED_FLAGS` (``--flag V`` or ``--flag=V``); :class:`_Declined`
    for anything else."""
    flags: dict[str, str] = {}
    tokens = iter(argv)
    for token in tokens:
        if token.startswith("-"):
            name, equals, value = token.partition("=")
            if name not in _VALUED_FLAGS or name in flags:
                raise _Declined(f"{name} is not an option the fast entry takes" if name not in _VALUED_FLAGS
                                else f"{name} given twice")
            value = value if equals else next(tokens, "")
            if not value:
                raise _Declined(f"{name} without a value")
            flags[name] = value
        elif "://" in token:
            raise _Declined("an oci:// reference (pulled by the full path first)")
        elif "DIR" in flags:
            raise _Declined(f"a second operand {token!r}")
        else:
            flags["DIR"] = token
    if "DIR" not in flags:
        raise _Declined("no artifact directory")
    return flags


def _object(document: Any, *keys: str) -> Any:
    """``document[k0][k1]...``; KeyError/TypeError on anything missing (the caller falls back)."""
    for key in keys:
        document = document[key]
    return document


def _start(flags: dict[str, str], origin: tuple[int, int]) -> EarlyRestore:
    if "--state-dir" in flags:  # (as the full path's --state-dir does)
        SETTINGS.give(STATE_DIR_ENV, os.path.abspath(flags["--state-dir"]))
    root = Path(flags["DIR"]).resolve()
    descriptor = parse_strict_json((root / "artifact.json").read_bytes())
    captured = parse_strict_json((root / "request.json").read_bytes())
    units = _object(descriptor, "units")
    if (descriptor.get("snapshot_driver") != "n610" or len(units) != 1 or len(captured.get("units") or [{}]) != 1
            or _object(descriptor, "platform", "arch") != os.uname().machine):  # (platform.machine(), unimported)
        raise _Declined("not a one-unit n610 artifact of this machine's architecture")
    unit = units[0]
    identity = artifact_id(root)
    records = state_root() / identity / "records"
    capsule_path = root / _object(unit, "capsule", "path")
    images = root / "units" / unit["unit_id"] / "images"
    if capsule_path.parent != images.parent:
        raise _Declined("the capsule is not beside its images")
    capsule = parse_strict_json(capsule_path.read_bytes())
    if capsule.get("unit_id") != unit["unit_id"]:
        raise _Declined("the capsule is another unit's")
    files = [(capsule_path, _object(unit, "capsule", "sha256"))]
    files += [(images / entry["path"], entry["sha256"]) for entry in capsule["files"]]
    record_dirs = {folder: records / folder.relative_to(root) for folder in {path.parent for path, _ in files}}
    if any(".." in Path(entry["path"]).parts for entry in capsule["files"]):
        raise _Declined("a capsule file outside its images")
    if not vouched_by_records(files, record_dirs):
        raise _Declined("its files are not vouched for by this host's validation records yet (the full path checks "
                        "and records them: the next restore here takes the fast entry)")
    metadata = capsule["metadata"]
    port = int(flags["--port"]) if "--port" in flags else (captured.get("units") or [{}])[0].get("serving_port") \
        or metadata["serving_port"]
    operation_id = flags.get("--operation-id") or new_operation_id("restore")
    try:
        lock = PortLock(port, "restore", operation_id, str(root)).acquire()
    except LockHeld as exc:
        raise _Declined(f"the port's lock is held: {exc}") from None
    pending: PendingRestore | None = None
    try:
        template = metadata.get("template")
        replica = plan(images, metadata["serving_port"], port, {w["rank"]: w["control"] for w in metadata["workers"]},
                       template["control"] if template else None)
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
        staging = _start_staging(flags, captured, unit, metadata, root, records, origin) \
            if metadata.get("gpu_pids") and SETTINGS.flag(EARLY_STAGING_ENV) else None
        return EarlyRestore(root, identity, unit["unit_id"], operation_id, replica, lock, pending, origin,
                            (0, checked_ns), criu_started_ns, staging)
    except PortsTaken as exc:
        lock.release()
        raise _Declined(f"the replica's ports: {exc}") from None
    except BaseException:
        if pending is not None:
            pending.abandon()
        lock.release()
        raise


def _start_staging(flags: dict[str, str], captured: dict, unit: dict, metadata: dict, root: Path, records: Path,
                   origin: tuple[int, int]) -> EarlyStaging:
    """Each rank's weights staged as the restore would stage them (:func:`~coldsnap.activation.staging.stages_rank`),
    where its packs are vouched for by their records and its GPUs, placed as the request places them, have
    room for the whole restore (:func:`~coldsnap.activation.gpu_room.shortfalls`); decided on a thread."""
    from coldsnap.activation.gpu_room import LAUNCHER_CONTEXT_BYTES, needs_per_gpu, shortfalls
    from coldsnap.activation.replica_plan import gpu_remap
    from coldsnap.activation.staging import WeightStager, stages_rank
    from coldsnap.activation.state import host_cache_dir

    mode = flags.get("--weights") or ((captured.get("policy") or {}).get("weights") or {}).get("mode") or "auto"
    request_unit = (captured.get("units") or [{}])[0]
    requested = flags.get("--gpu") or (request_unit.get("env") or {}).get("CUDA_VISIBLE_DEVICES")
    captured_visible = (request_unit.get("env") or {}).get("CUDA_VISIBLE_DEVICES")
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
        placement = gpu_remap(metadata["gpu_uuids"], captured_visible, current, requested)
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

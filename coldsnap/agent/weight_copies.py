"""Recording, while an engine loads its weights its own way, which checkpoint bytes its loaders copy
unchanged into which parameter bytes — the raw material of a recovery plan
(:mod:`coldsnap.hydrate.recovery_plan`). Engine-neutral: it watches ``Tensor.copy_`` through a torch
function mode and the (name, tensor) pairs the engine's safetensors iterator yields.

A copy is recorded only when it is a plain byte copy: same dtype, both sides contiguous, the source a
CPU tensor inside one the iterator yielded (a slice of it: a tensor-parallel shard, a fused projection's
part), the destination inside a parameter's storage. Anything else — a dtype conversion, an in-place
transform after loading, a fill — is left to the recovery gap pack. After placement the plan is checked
against the region: sampled bytes of every planned range must equal the file's, or the range is dropped.
"""

from __future__ import annotations

import collections
import contextlib
import os
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

from coldsnap.hydrate.recovery_plan import PlannedCopy, RecoveryPlan
from coldsnap.hydrate.replay import SafetensorsIndex

__all__ = ["WeightCopyRecorder", "recovery_plan_or_none"]

_SAMPLE_BYTES = 64 << 10


@dataclass(frozen=True)
class _Copy:
    name: str
    source_offset: int  # bytes into the checkpoint tensor
    storage: int  # the destination parameter storage's address at load time
    storage_offset: int
    length: int


class WeightCopyRecorder:
    """Use :meth:`weights` around the engine's (name, tensor) iterator and :meth:`recording` around its
    load; then :meth:`plan` once the model is placed."""

    def __init__(self) -> None:
        self._yielded: collections.deque[tuple[int, int, str]] = collections.deque(maxlen=512)
        self._copies: list[_Copy] = []

    def weights(self, pairs: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        for name, tensor in pairs:
            if getattr(tensor, "device", None) is not None and tensor.device.type == "cpu" and tensor.is_contiguous():
                self._yielded.append((tensor.data_ptr(), tensor.nbytes, name))
            yield name, tensor

    @property
    def recorded(self) -> int:
        return len(self._copies)

    def _note(self, destination: Any, source: Any) -> None:
        if (source.device.type != "cpu" or destination.dtype != source.dtype or destination.nbytes != source.nbytes
                or not destination.is_contiguous() or not source.is_contiguous() or not source.nbytes):
            return
        address = source.data_ptr()
        for start, size, name in reversed(self._yielded):  # the newest first: freed memory is reused
            if start <= address and address + source.nbytes <= start + size:
                storage = destination.untyped_storage().data_ptr()
                self._copies.append(_Copy(name, address - start, storage, destination.data_ptr() - storage, source.nbytes))
                return

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        import torch
        from torch.overrides import TorchFunctionMode

        recorder = self

        class _CopyWatch(TorchFunctionMode):
            def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
                if func is torch.Tensor.copy_ and len(args) >= 2 and isinstance(args[1], torch.Tensor):
                    try:
                        recorder._note(args[0], args[1])
                    except Exception:  # noqa: BLE001 - recording never breaks the engine's load
                        pass
                return func(*args, **(kwargs or {}))

        with _CopyWatch():
            yield

    def plan(self, files: list[str], storage_offsets: dict[int, int], region: Any, layout_digest: str = "") -> RecoveryPlan:
        """The recorded copies as a plan into ``region`` (the ``weights`` region, placed: ``storage_offsets``
        maps each parameter storage's load-time address to its offset there), each range checked on
        sampled bytes against the file; later copies to the same bytes replace earlier ones."""
        index = SafetensorsIndex(files)
        latest: dict[tuple[int, int], PlannedCopy] = {}
        for copy in self._copies:
            entry = index.entries.get(copy.name)
            offset = storage_offsets.get(copy.storage)
            if entry is None or offset is None or copy.source_offset + copy.length > entry.length:
                continue
            target = offset + copy.storage_offset
            latest[(target, copy.length)] = PlannedCopy(str(entry.file), entry.file_offset + copy.source_offset,
                                                        copy.length, region.tag, target)
        kept: list[PlannedCopy] = []
        for planned in sorted(latest.values(), key=lambda c: c.region_offset):
            if kept and kept[-1].region_offset + kept[-1].length > planned.region_offset:
                kept.pop()  # two loads wrote overlapping bytes: neither is a plain copy; the gap has them
                continue
            if planned.region_offset + planned.length <= region.mapped_bytes and _same_bytes(planned, region):
                kept.append(planned)
        return RecoveryPlan(layout_digest=layout_digest, copies=kept)


def recovery_plan_or_none(copies: WeightCopyRecorder, files: list[str], offsets: dict[int, int], region: Any,
                          log: Any, engine: str) -> RecoveryPlan | None:
    """:meth:`WeightCopyRecorder.plan`, logged in the engine's log; None (recovery restores then replay
    through the engine's loaders) when it cannot be made."""
    try:
        plan = copies.plan(files, offsets, region)
    except Exception as exc:  # noqa: BLE001 - without a plan, recovery replays through the engine's loaders
        log.warning("coldsnap: no recovery plan (%s); recovery restores replay through %s's loaders", exc, engine)
        return None
    log.info("coldsnap: recovery plan: %d of the %d copies %s's loaders made land unchanged in the weights region "
             "(%d bytes)", len(plan.copies), copies.recorded, engine, sum(c.length for c in plan.copies))
    return plan


def _same_bytes(planned: PlannedCopy, region: Any) -> bool:
    """The range's first, middle and last bytes (up to 64 KiB each) in the region equal the file's."""
    import torch

    span = min(_SAMPLE_BYTES, planned.length)
    starts = sorted({0, max(0, planned.length // 2 - span // 2), planned.length - span})
    with open(planned.path, "rb") as handle:
        for start in starts:
            expected = os.pread(handle.fileno(), span, planned.file_offset + start)
            placed = region.tensor(torch.uint8, (span,), planned.region_offset + start).cpu().numpy().tobytes()
            if placed != expected:
                return False
    return True

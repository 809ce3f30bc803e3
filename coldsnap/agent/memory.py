"""One process's model memory — its layout and stable regions — released and brought back.

``release`` writes the native pack and residual from the live regions (when asked) and unmaps every
region; ``restore`` maps them again at the same addresses and fills them: chunks another process
already hydrated (adopted), the pack, or recovery replay from safetensors; discarded regions (KV
cache, graph scratch) come back zeroed. The in-process agent does this around a process snapshot,
an engine's sleep backend around sleep/wake; neither owns the mechanics.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

from coldsnap.contracts.layout import MemoryLayout
from coldsnap.memory.regions import DISCARDED_TAGS, StableRegion
from coldsnap.native import native
from coldsnap.timing import timed

if TYPE_CHECKING:
    from coldsnap.hydrate import PinnedPack
    from coldsnap.hydrate.recovery_plan import RecoveryPlan

__all__ = ["ModelMemory", "ModelMemoryError"]


def _pack_ref(pack: Any) -> dict[str, Any]:
    """A written pack as the agent reports it (:class:`coldsnap.agent.protocol.PackRef`'s fields)."""
    return {"path": str(pack.path), "sha256": pack.sha256, "size_bytes": pack.size_bytes}

Progress = Callable[[int, int], None]


class ModelMemoryError(RuntimeError):
    """The request does not fit this process's memory (layout, adopted chunks, missing source)."""


class ModelMemory:
    def __init__(self, layout: MemoryLayout, regions: Mapping[str, StableRegion]):
        self.layout = layout
        self.regions = dict(regions)

    def allocations(self) -> dict[str, list[tuple[int, int]]]:
        """The preserved bytes per region: the allocator's blocks, or the layout's tensors where the
        engine placed tensors itself. Discarded regions preserve nothing."""
        out: dict[str, list[tuple[int, int]]] = {}
        for region_layout in self.layout.regions:
            region = self.regions.get(region_layout.tag)
            if region is None or region_layout.tag in DISCARDED_TAGS:
                continue
            blocks = region.allocations() or [(t.offset, t.length) for t in region_layout.tensors if t.length]
            if blocks:
                out[region_layout.tag] = blocks
        return out

    def pin_pack(self, path: str) -> "PinnedPack":
        """``path`` (a payload pack of the GPU weights region) mapped and pinned for a later :meth:`restore`."""
        from coldsnap.hydrate import PinnedPack

        weights = self.regions.get("weights")
        if weights is None or weights.backend != "cuda":
            raise ModelMemoryError("only a GPU weights region is hydrated from a pinned pack")
        return PinnedPack(path, weights.device)

    def prefill(self, pinned: "PinnedPack", seconds: dict[str, float]) -> dict[str, Any]:
        """Map the weight regions and fill them from ``pinned`` (this process's own payload pack) ahead of
        :meth:`restore`, which is then given the result as ``prefilled``; :meth:`unfill` undoes it."""
        weights = {t: r for t, r in self.regions.items() if t not in DISCARDED_TAGS}
        try:
            for region in weights.values():
                timed(seconds, f"map_{region.tag}", region.map)
            stats = timed(seconds, "hydrate", lambda: pinned.hydrate(weights, layout_digest=self.layout.digest()))
        except BaseException:
            self.unfill()
            raise
        return {"source": "native", "bytes": stats.bytes, "seconds": stats.seconds, "pinned": True,
                "gb_per_s": round(stats.gb_per_s, 3)}

    def unfill(self) -> None:
        """Release what :meth:`prefill` mapped."""
        for tag, region in self.regions.items():
            if tag not in DISCARDED_TAGS and region.mapped_bytes:
                region.unmap()

    def release(self, seconds: dict[str, float], pack_dir: Path | None = None, progress: Progress | None = None,
                before_unmap: Callable[[], None] | None = None, write_payload: bool = True,
                recovery_plan: "RecoveryPlan | None" = None) -> dict[str, Any]:
        """Write the payload (unless not ``write_payload``: recovery will replay the model's tensors) and residual
        packs into ``pack_dir`` (when given), then unmap every region."""
        from coldsnap.hydrate import payload_extents, write_pack_from_regions
        from coldsnap.payload import PackKind, plan_residual

        result: dict[str, Any] = {}
        if pack_dir is not None:
            pack_dir.mkdir(parents=True, exist_ok=True)
            if write_payload:
                payload = timed(seconds, "payload_write", lambda: write_pack_from_regions(
                    pack_dir, self.layout, self.regions, progress=progress))
                result["payload"] = _pack_ref(payload)
            # Planned against the tensors the payload holds, or would: the same residual either way.
            residual_plan = plan_residual(self.allocations(), payload.table if write_payload else payload_extents(self.layout))
            residual = timed(seconds, "residual_write", lambda: write_pack_from_regions(
                pack_dir, self.layout, self.regions, kind=PackKind.RESIDUAL, extents=residual_plan))
            result["residual"] = _pack_ref(residual)
            if recovery_plan is not None and recovery_plan.copies:
                result.update(timed(seconds, "recovery_plan_write", lambda: self._write_recovery_plan(pack_dir, recovery_plan)))
        if before_unmap is not None:
            before_unmap()
        for region in self.regions.values():
            timed(seconds, f"unmap_{region.tag}", region.unmap)
        native().release_pinned()
        return result

    def _write_recovery_plan(self, pack_dir: Path, recorded: "RecoveryPlan") -> dict[str, Any]:
        """The plan, bound to this layout, and its gap pack: the payload's bytes the plan leaves out."""
        import hashlib

        from coldsnap.atomic import write_atomic
        from coldsnap.hydrate import payload_extents, write_pack_from_regions
        from coldsnap.hydrate.recovery_plan import RecoveryPlan, subtract_extents
        from coldsnap.payload import PackKind, PlannedExtent

        planned = recorded.extents()
        gap = [PlannedExtent(region=extent.region, region_offset=offset, length=length)
               for extent in payload_extents(self.layout)
               for offset, length in subtract_extents([(extent.region_offset, extent.length)], planned.get(extent.region, []))]
        gap_pack = write_pack_from_regions(pack_dir, self.layout, self.regions, kind=PackKind.RESIDUAL, extents=gap)
        document = RecoveryPlan(self.layout.digest(), recorded.copies).to_json()
        sha256 = hashlib.sha256(document).hexdigest()
        path = pack_dir / f"{sha256}.recovery.json"
        write_atomic(path, document)
        return {"recovery_plan": {"path": str(path), "sha256": sha256, "size_bytes": len(document)},
                "recovery_gap": _pack_ref(gap_pack)}

    def restore(self, seconds: dict[str, float], *, layout_digest: str | None = None, payload: str | None = None,
                residual: str | None = None, safetensors: list[str] | None = None,
                recovery_plan: str | None = None, recovery_gap: str | None = None,
                replay: Callable[[list[str]], int] | None = None, adopted: dict[str, int] | None = None,
                fds: Sequence[int] = (), staged: dict[str, Any] | None = None, progress: Progress | None = None,
                tags: Iterable[str] | None = None, pinned: "PinnedPack | None" = None,
                prefilled: dict[str, Any] | None = None) -> dict[str, Any]:
        """Map the regions (``tags``, default all) at their addresses and fill them; returns what
        hydrated them. ``adopted`` (tag → chunk count) takes the chunks from ``fds`` in that order.
        Recovery (``safetensors`` without a payload): ``replay`` (the engine's own) or replay by tensor
        name fills the model's tensors, then the residual the bytes around them, as after a pack."""
        from coldsnap.hydrate import hydrate_pack, replay_safetensors

        digest = layout_digest or self.layout.digest()
        if digest != self.layout.digest():
            raise ModelMemoryError(f"layout digest {digest[:12]}… is not this process's {self.layout.digest()[:12]}…")
        selected = {t: r for t, r in self.regions.items() if tags is None or t in set(tags)}
        adopted = adopted or {}
        if sum(adopted.values()) != len(fds) or not set(adopted) <= set(selected):
            raise ModelMemoryError(f"adopted chunks {adopted} do not match the {len(fds)} descriptors sent "
                                   "or this process's regions")
        for tag, count in adopted.items():
            if count * selected[tag].chunk_bytes != selected[tag].high_water:
                raise ModelMemoryError(f"region {tag!r}: {count} adopted chunks do not cover the "
                                       f"{selected[tag].high_water} bytes mapped before the release")
        weight_tags = {t for t in selected if t not in DISCARDED_TAGS}
        if weight_tags and not weight_tags <= set(adopted) and not payload and not safetensors:
            # refused before anything is mapped, as the other refusals are
            raise ModelMemoryError("restoring the weights needs a payload pack or safetensors files")
        taken = 0
        for tag, count in adopted.items():  # descriptors arrive in this order
            timed(seconds, f"adopt_{tag}", lambda: selected[tag].adopt_chunks(list(fds[taken:taken + count])))
            taken += count
        if pinned is not None and prefilled is None and payload and not adopted:  # the pinned pack, not filled ahead
            prefilled = self.prefill(pinned, seconds)
        for region in selected.values():
            if region.tag not in adopted and not (prefilled and region.tag not in DISCARDED_TAGS):
                timed(seconds, f"map_{region.tag}", region.map)
        weights = {t: r for t, r in selected.items() if t not in DISCARDED_TAGS}
        staged_elsewhere = bool(adopted) and set(weights) <= set(adopted)  # another process hydrated payload and residual
        hydrated: dict[str, Any] = {}
        if not weights:
            hydrated = {"source": "none", "bytes": 0}
        elif prefilled:  # mapped and filled from the pinned payload (:meth:`prefill`)
            hydrated = dict(prefilled)
        elif staged_elsewhere:
            hydrated = {"source": "native", "staged": True, **(staged or {})}
        elif payload:
            stats = timed(seconds, "hydrate", lambda: hydrate_pack(payload, weights, layout_digest=digest, progress=progress))
            hydrated = {"source": "native", "bytes": stats.bytes, "seconds": stats.seconds,
                        "gb_per_s": round(stats.gb_per_s, 3), "direct": stats.direct, "cached_fraction": stats.cached_fraction}
        else:  # safetensors: a restore with no source was refused before mapping
            assert safetensors
            if recovery_plan is not None and recovery_gap is not None:  # the files' bytes straight into the layout
                from coldsnap.hydrate.recovery_plan import RecoveryPlan

                plan = RecoveryPlan.read(recovery_plan)
                if plan.layout_digest != digest:
                    raise ModelMemoryError(f"recovery plan {recovery_plan} is for layout {plan.layout_digest[:12]}…")
                read = sum(s.bytes for s in timed(seconds, "hydrate", lambda: plan.apply(weights, safetensors)))
                timed(seconds, "recovery_gap", lambda: hydrate_pack(recovery_gap, weights, layout_digest=digest))
            elif replay is not None:
                read = timed(seconds, "hydrate", lambda: replay(list(safetensors)))
            else:
                read = sum(s.bytes for s in timed(seconds, "hydrate",
                                                  lambda: replay_safetensors(safetensors, self.layout, weights)))
            hydrated = {"source": "recovery", "bytes": read, "seconds": seconds["hydrate"],
                        "planned": recovery_plan is not None and recovery_gap is not None}
        if residual and weights and not staged_elsewhere:  # the bytes around the tensors, whichever filled them
            timed(seconds, "residual", lambda: hydrate_pack(residual, weights, layout_digest=digest))
        for tag in DISCARDED_TAGS:
            if tag in selected:
                timed(seconds, f"zero_{tag}", selected[tag].zero)
        return hydrated

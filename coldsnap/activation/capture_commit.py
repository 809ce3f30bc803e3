"""The capture's last steps: the capsule's activation metadata, the capsule restored once as a check, the
artifact descriptor committed."""

from __future__ import annotations

import platform
import time
from pathlib import Path

from coldsnap.activation.artifact_dir import ArtifactDir, file_ref
from coldsnap.activation.capture_state import CaptureState
from coldsnap.activation.units import artifact_request
from coldsnap.contracts.artifact import (ArtifactDescriptor, CanaryRecord, EnvironmentRecord, PlatformRecord, UnitRecord,
                                        WorkerRecord)
from coldsnap.contracts.capsule import ActivationMetadata, RegionRecord, WorkerActivation
from coldsnap.contracts.base import decode_document
from coldsnap.contracts.canonical import canonical_json
from coldsnap.contracts.profiles import resolve_request
from coldsnap.contracts.request import OperationRequest
from coldsnap.contracts.layout import SemanticManifest
from coldsnap.host import nvidia_kernel_driver
from coldsnap.operation import OperationFailed
from coldsnap.snapshot.host_files import read_only_mtimes
from coldsnap.snapshot.process_tree import kill_tree

__all__ = ["CommitSteps"]

RESTORE_CANARY_TOKENS = 2
"""Tokens a restore generates beside the prompt check: the first comes from the prefill, the second from
one decode step (KV cache read back, the decode CUDA graph replayed)."""


class CommitSteps(CaptureState):
    """The commit steps of :class:`~coldsnap.activation.capture_steps.CaptureSequence`."""

    def activation_metadata(self) -> ActivationMetadata:
        """The capsule's activation metadata: the tree, each rank's agent and memory, how it was dumped."""
        engine, snapshotter = self.engine, self.snapshotter
        assert engine is not None and snapshotter is not None
        return ActivationMetadata(
            control=engine.control, serving_port=self.port, root_pid=engine.pid,
            workers=[WorkerActivation(rank=w.rank, control=c, pid=s.pid, layout=s.layout, layout_digest=p.layout_digest,
                                      regions={tag: RegionRecord(**r.model_dump()) for tag, r in p.regions.items()},
                                      graphs_released=p.graphs_released)
                     for w, c, s, p in zip(self.workers, self.controls, self.statuses, self.prepared)],
            criu_options=snapshotter.options.args(), criu_tcp=self.criu_tcp,
            gpu_pids=self.gpu_pids, gpu_uuids=[d["uuid"] for d in self.gpus],
            host_file_mtimes_ns=read_only_mtimes(self.artifact.images(self.unit.unit_id)), gpu_memory=self.gpu_memory,
            address=self.units.address if self.units is not None else None,
        )

    def commit(self, verify: bool = False) -> None:
        """The capsule manifest, the resolved request, then the descriptor, written atomically last; with
        ``verify``, as a pending descriptor first, committed by one rename once the capture's own restore
        of it served the canary's tokens (:meth:`verify`)."""
        artifact, request_, engine, canary, snapshotter = self.artifact, self.request, self.engine, self.canary, self.snapshotter
        assert engine is not None and canary is not None and snapshotter is not None
        with self.step("capture.commit", "capture.commit"):
            capsule = artifact.write_capsule(self.unit.unit_id, self.activation_metadata())
            worker_records = []
            for w, p in zip(self.workers, self.prepared):
                if p.residual is None:
                    raise OperationFailed("capture.residual", f"the agent of rank {w.rank} wrote no residual pack")
                worker_records.append(WorkerRecord(
                    worker_id=w.worker_id, rank=w.rank, layout_digest=p.layout_digest,
                    residual=file_ref(artifact, Path(p.residual.path), p.residual.sha256),
                    payload=file_ref(artifact, Path(p.payload.path), p.payload.sha256) if p.payload else None,
                    recovery=(pinned := self.pin_recovery(w.rank, p)),
                    recovery_plan=(file_ref(artifact, Path(p.recovery_plan.path), p.recovery_plan.sha256)
                                   if pinned and p.recovery_plan and p.recovery_gap else None),
                    recovery_gap=(file_ref(artifact, Path(p.recovery_gap.path), p.recovery_gap.sha256)
                                  if pinned and p.recovery_plan and p.recovery_gap else None)))
            recorded = artifact_request(request_)  # the whole activation, no unit's selection
            artifact.request_path.write_bytes(canonical_json(recorded.to_json_value()) + b"\n")
            unit_record = UnitRecord(unit_id=self.unit.unit_id, capsule=capsule, workers=worker_records,
                                     environment=EnvironmentRecord(withheld=list(self.engine_env.withheld),
                                                                   held=list(self.engine_env.held)))
            records = [unit_record]
            if self.units is not None:  # every unit's record, in one descriptor: unit 0's, committed by each unit
                records = [UnitRecord.model_validate(r)
                           for r in self.units.every_unit("capture/record", unit_record.to_json_value())]
            descriptor = (self._descriptor(recorded, records) if self.units is None or self.index == 0 else
                          decode_document(ArtifactDescriptor, self.units.get("capture/descriptor"), "unit 0's descriptor"))
            if self.units is not None and self.index == 0:
                self.units.put("capture/descriptor", descriptor.to_json_value())
            elif descriptor.units != records:
                raise OperationFailed("capture.commit", "unit 0's descriptor does not bind this unit's capsule")
            target = artifact.pending() if verify else artifact
            target.commit(descriptor)
        if verify:
            self.verify(target)
            self._units_verified()
            artifact.promote(target)

    def _descriptor(self, recorded: OperationRequest, records: list[UnitRecord]) -> ArtifactDescriptor:
        """The artifact descriptor of this capture (one unit's, or every unit's records from unit 0)."""
        request_, canary, snapshotter = self.request, self.canary, self.snapshotter
        assert canary is not None and snapshotter is not None
        driver = nvidia_kernel_driver()
        return ArtifactDescriptor(
            format=9,
            artifact_id=f"{request_.operation_id}",
            created_unix_ns=time.time_ns(),
            engine=request_.engine,
            snapshot_driver=request_.snapshot_driver,
            request_sha256=recorded.canonical_sha256(),
            semantic_manifest_sha256=SemanticManifest.from_request(recorded).canonical_sha256(),
            model=request_.model,
            graph_policy=request_.policy.graphs.mode or "retain",
            platform=PlatformRecord(
                arch=platform.machine(), kernel=platform.release(), nvidia_driver=driver,
                nvidia_driver_floor=int(driver.split(".")[0]) if driver else None,
                gpu_model=self.gpus[0]["name"] if self.gpus else None,
                compute_capability=self.gpus[0]["compute_capability"] if self.gpus else None,
                criu_version=".".join(map(str, snapshotter.criu.version().numbers)),
            ),
            canary=CanaryRecord(prompt=self.request.policy.validation.prompt or "", expected_response=canary.text,
                                token_ids=canary.token_ids, prompt_argmax=canary.prompt_argmax,
                                restore_tokens=(min(RESTORE_CANARY_TOKENS, len(canary.token_ids))
                                                if canary.prompt_argmax and canary.token_ids else None),
                                probes=self.probes),
            reference=self._reference_record(),
            units=records,
        )

    def _units_verified(self) -> None:
        """One unit of several commits only once every unit's check restore served (all or none)."""
        if self.units is not None:
            with self.timer.span("capture.units.verified"):
                self.units.barrier("capture.verified")

    def verify(self, pending: ArtifactDir) -> None:
        """Restore the capsule once, as ``coldsnap restore`` of it would (same request, same weights policy,
        the captured port), prove it with the canary, then stop it: a capsule that cannot restore is never
        committed (``capture.verify``). ``COLDSNAP_CAPTURE_VERIFY=0`` (``capture --no-verify``) skips it."""
        assert self.check_restore is not None, "a verified commit needs the lifecycle's restore"
        document = self.request.to_json_value()
        document.update(operation="restore", operation_id=f"{self.request.operation_id}-check", prepare_only=False)
        request = resolve_request(decode_document(OperationRequest, canonical_json(document), "the capture's check"))
        check = self.context.nested(request)
        with self.timer.span("capture.verify") as span:
            try:
                with check.held:
                    self.check_restore(check, pending)
            except OperationFailed as exc:
                raise OperationFailed("capture.verify", f"the capsule did not restore: {exc.code}: {exc.message}") from None
            finally:
                restored = [s.attributes.get("pid") for s in check.timer.envelope().spans if s.name.endswith(".criu_restore")]
                if restored and isinstance(restored[0], int):
                    kill_tree(restored[0])
                self.context.warnings.extend(f"capture's check restore: {w}" for w in check.warnings)
            span.update({f"restore.{s.name.split('.', 1)[1]}_ns": s.duration_ns for s in check.timer.envelope().spans
                         if s.name.count(".") == 1 and s.duration_ns is not None})
        self.context.progress("the capture's own restore served the captured canary; committing")

"""The restore steps an admitted restore runs (:class:`RestoreSequence`), shared by the snapshot
drivers that restore a CRIU image of the serving tree (n610: :mod:`coldsnap.activation.n610`; n580's
template restore reuses the unwind and the canary, :mod:`coldsnap.activation.n580`).

Each rank's GPU weights are hydrated by the launcher into shareable chunks (or its payload prefetched
into the page cache) *while* CRIU restores the tree; GPU processes are CUDA-restored (captured GPU UUIDs
remapped onto this host's) and unlocked; every rank's agent then maps its regions at their captured
addresses, fills them and zeroes the KV cache, and the ranks rebuild their NCCL communicators together
through the activation's coordinator; the canary must give the captured tokens exactly. Each step is a
method with its own span and error code (:mod:`coldsnap.contracts.errors`); a driver names the steps it
runs, in order (:meth:`RestoreSequence.run`). Any failure — of any rank, at any step, an interrupt
included — goes through the one :meth:`RestoreSequence.unwind`, which kills what was restored and
leaves the artifact as it was.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from pathlib import Path
from typing import Any, Callable, ContextManager, Sequence

from coldsnap.activation.canary import ask_canary
from coldsnap.activation.canary_probes import ask_probe, first_difference, float_of
from coldsnap.activation.engine_process import use_served_key
from coldsnap.activation.ranks import ActivationCoordinator, call_every_rank, rank_prefix
from coldsnap.activation.restore_place import write_replica_images
from coldsnap.activation.restore_state import RestoreHeld, RestorePlan, Step
from coldsnap.activation.staging import WeightStager, stages_rank
from coldsnap.activation.state import forget_removed_artifacts
from coldsnap.activation.units import moved_addresses
from coldsnap.agent.client import AgentClient, AgentError, KeyGateError, KeyGateMissing, Lease, install_api_key, key_gate
from coldsnap.agent.protocol import Resume, ResumeReply
from coldsnap.contracts.artifact import CanaryProbe, FileRef, WorkerRecord
from coldsnap.contracts.base import ContractError
from coldsnap.host import STATE_DIR_ENV, state_root
from coldsnap.operation import OperationFailed, OperationOutcome, step
from coldsnap.payload.arrival import ArrivalFailed, arrival_for
from coldsnap.payload.errors import PackError
from coldsnap.payload.validation import verify_file
from coldsnap.progress import PhaseProgress
from coldsnap.secrets.served_key import ApiKeyFileError, read_api_key
from coldsnap.snapshot.criu import CriuSnapshotter
from coldsnap.snapshot.criu_binary import CriuError
from coldsnap.snapshot.criu_options import SnapshotOptions
from coldsnap.snapshot.cuda_checkpoint import CudaCheckpointError, TreeCheckpoint, start_cuda_in_background
from coldsnap.snapshot.process_tree import kill_tree
from coldsnap.snapshot.thp import ThpError, host_thp_requested, huge_pages_for_the_fill

__all__ = ["RestoreSequence"]


class RestoreSequence:
    """The steps of one admitted restore, each its own method, span and error code (:meth:`step`), over one
    :class:`RestorePlan` (what they read) and one :class:`RestoreHeld` (what they start and hand on), and
    one :meth:`unwind` for every failure: staging cancelled, handed-over memory closed, whatever CRIU
    restored killed, the lease dropped. The artifact is only read.

    A warm standby runs the same steps in two operations (:mod:`coldsnap.activation.standby`):
    ``warm`` up to the CUDA restore, then parks the ranks (:class:`coldsnap.activation.n610.StandbySequence`);
    ``wake`` takes the parked tree from there (n610's ``WAKE_STEPS``). Spans are named after the operation (``warm.criu_restore``);
    error codes after the step (``restore.criu``). One unit of several waits for the others at the steps'
    barriers (:attr:`Step.barrier`); the ``network_unlock`` barrier is inside the CRIU restore
    (:meth:`restore_tree`)."""

    def __init__(self, plan: RestorePlan, held: RestoreHeld | None = None):
        """``held``: a standby's wake is handed its parked tree (``restored_pid``)."""
        self.plan = plan
        self.held = held or RestoreHeld()
        self.op = plan.context.request.operation
        self.timer = plan.context.timer

    def step(self, span: str, code: str, started_ns: int | None = None) -> ContextManager[dict[str, str | int | bool]]:
        """One step (:func:`coldsnap.operation.step`): a failure of what it calls (CRIU, CUDA, an agent,
        the OS) is reported with its code, the exception's type first."""
        return step(self.timer, span, code, (CriuError, CudaCheckpointError, AgentError, OSError, ContractError),
                    lambda exc: f"{type(exc).__name__}: {exc}", started_ns)

    def run(self, steps: Sequence[Step]) -> OperationOutcome:
        """The driver's steps, in order (:mod:`coldsnap.activation.n610`, :mod:`coldsnap.activation.n580`);
        then the lease is released and the process is on its own. Any failure: :meth:`unwind`. Either way:
        :meth:`release`."""
        plan, held = self.plan, self.held
        try:
            for each in steps:
                if not each.first_unit_only or plan.units is None or plan.first_unit:
                    each.run(self)
                if plan.units is not None and each.barrier is not None:
                    with self.timer.span(f"{self.op}.units.{each.barrier}"):
                        plan.units.barrier(f"{self.op}.{each.barrier}")
            assert held.lease is not None
            held.lease.release()  # the process is on its own now
            self.release_staged()
        except BaseException:
            self.unwind()
            raise
        finally:
            self.release()
        # housekeeping after the canary matched, off the restore's path: the state of artifacts deleted since
        forget_removed_artifacts(plan.artifact.state_path().parent)
        warnings = [f"prefetch failed: {e}" for e in held.prefetch_errors]
        matched = "" if self.op == "warm" else ", canary matched" if plan.first_unit else ", unit 0's canary matched"
        where = f"port {plan.serving_port}" if plan.units is None or plan.first_unit else f"unit {plan.units.index}"
        plan.context.progress(f"{'warm standby' if self.op == 'warm' else 'ready'}: pid {held.restored_pid}, {where}{matched}")
        return OperationOutcome(artifact=str(plan.artifact.root), warnings=warnings)

    def release(self) -> None:
        """What the sequence holds besides the restored tree, let go after success or failure (n580: the
        template's link)."""

    def release_staged(self) -> None:
        """The launcher's own mappings of the weights it staged, let go once the canary matched: each rank
        maps the memory it adopted at resume on its own, so nothing the server reads goes with them, and
        unmapping 16 GB of chunks took 10–16 ms of an 8B restore's resume (H100) when done there. After a
        failure :meth:`unwind` releases them."""
        if any(stager.staged for stager in self.held.stagers.values()):
            with self.timer.span(f"{self.op}.release_staged"):
                for stager in self.held.stagers.values():
                    stager.release()

    def pack(self, ref: FileRef | None) -> Path | None:
        return self.plan.artifact.root / ref.path if ref is not None else None

    def restore_tree(self) -> None:
        """CRIU restores the tree; meanwhile each rank's GPU weights are hydrated by this launcher into
        shareable chunks (handed over at resume), or else its payload is read into the page cache."""
        # (a standby's weights are hydrated at wake, by its own agents: only its pack is read ahead)
        ordinals = self.plan.gpus.launcher_ordinals if self.plan.gpus is not None else {}
        early_staging = self.plan.early.staging if self.plan.early is not None else None  # (started beside CRIU: taken as is)
        for w in self.plan.workers:
            regions = self.plan.records[w.rank].regions
            if w.payload is not None and stages_rank(self.op, self.plan.sources[w.rank], w.payload, regions):
                taken = early_staging.take(w.rank, ordinals) if early_staging is not None else None
                if taken is not None:
                    self.held.early_staged.add(w.rank)
                self.held.stagers[w.rank] = taken or WeightStager(regions, self.plan.artifact.root / w.payload.path,
                                                             self.pack(w.residual), w.layout_digest, self.timer.now_ns,
                                                             ordinals)
        if early_staging is not None:
            early_staging.drop()  # (what admission placed otherwise, or does not stage)
        for w in self.plan.workers:  # a pack still arriving that this launcher does not stage: its agent reads it whole
            arrival = arrival_for(self.plan.artifact.root / w.payload.path) if w.payload is not None else None
            if arrival is not None and w.rank not in self.held.stagers:
                arrival.read_when_whole()
        early = self.plan.early
        with self.step(f"{self.op}.criu_restore", "restore.criu",
                       started_ns=early.criu_started_ns if early is not None else None) as span:
            state_dir = self.state_dir()
            if self.plan.metadata.gpu_pids and early is None:  # the checkpoint API ready when the tree is
                start_cuda_in_background()
            if early is not None:  # CRIU runs since the process's entry
                self.held.criu = early.adopt()
                span["early"] = True
            for stager in self.held.stagers.values():
                stager.start()
            self.held.warmer = threading.Thread(target=self._prefetch, name="coldsnap-prefetch", daemon=True)
            self.held.warmer.start()
            span["state_dir"] = str(state_dir)
            with contextlib.ExitStack() as window:
                if host_thp_requested():  # the operator's choice (--host-thp), checked at admission
                    try:
                        span["host_thp_before"] = window.enter_context(huge_pages_for_the_fill(state_root()))
                    except ThpError as exc:
                        raise OperationFailed("admission.host_thp", str(exc)) from None
                if self.held.criu is None:
                    images = self.replica_images(state_dir)
                    options = SnapshotOptions(tcp=self.plan.metadata.criu_tcp)  # as dumped
                    self.held.criu = CriuSnapshotter(options=options).start_restore(
                        images, state_dir, self.plan.artifact.root, own_images=True, before_unlock=self._network_unlock_barrier())
                result = self.held.criu.finish()
            self.held.restored_pid = span["pid"] = result.pid
            span["thp_fill"] = result.thp_fill  # (CRIU fills huge pages where its build and the host's mode allow)
            span["fill_threads"] = result.fill_threads  # (helpers per process, where CRIU's build has them)
            self.held.host_pids = result.host_pids
        self.plan.context.progress(f"process tree restored (pid {result.pid}) in {result.seconds:.2f} s")

    def _network_unlock_barrier(self) -> Callable[[], None] | None:
        """One unit of several: CRIU holds the restored tree, its connections still in repair mode, until every
        unit's tree is restored (``restore.units.network_unlock``): a connection to another unit's tree then
        finds its peer's socket there, and no rank talks to another host before all are back."""
        units = self.plan.units
        if units is None:
            return None

        def barrier() -> None:
            with self.timer.span(f"{self.op}.units.network_unlock"):
                units.barrier(f"{self.op}.network_unlock")

        return barrier

    def replica_images(self, state_dir: Path) -> Path:
        """The images CRIU restores this replica from: the capture's, with ``files.img`` rewritten for its
        ports and sockets in ``state_dir`` (the artifact is only read)."""
        assert self.plan.replica is not None
        return write_replica_images(self.plan.artifact.images(self.plan.unit.unit_id), state_dir, self.plan.replica,
                                    self.moved_addresses())

    def moved_addresses(self) -> dict[bytes, bytes] | None:
        """One unit of several placed on other hosts: every unit's captured address, packed, onto its new one
        (admission's :meth:`~coldsnap.activation.units.UnitRendezvous.place`), for every socket of the tree
        bound to one or connected to one: its own listeners and the connections between the units' trees."""
        if self.plan.units is None:
            return None
        return moved_addresses(self.plan.units.placed) or None

    def state_dir(self) -> Path:
        """This replica's state directory under the artifact's, made if needed (``restore.state_dir`` when
        it cannot be): restores on other ports share nothing in it."""
        assert self.plan.replica is not None
        try:
            path = self.plan.artifact.state_dir() / self.plan.replica.name
            self.plan.context.hand_over.claim(path)  # (all of it is this replica's: its log, CRIU's files, its images)
            path.mkdir(exist_ok=True, mode=0o700)
            return path
        except OSError as exc:
            raise OperationFailed("restore.state_dir", f"cannot make the state directory under {state_root()}: "
                                  f"{exc} (choose one with --state-dir or {STATE_DIR_ENV})") from None

    def _prefetch(self) -> None:
        from coldsnap.hydrate import prefetch_file

        try:
            for w in self.plan.workers:
                if self.plan.sources[w.rank] == "native" and w.payload is not None and w.rank not in self.held.stagers:
                    if arrival_for(self.plan.artifact.root / w.payload.path) is None:  # (a pull's bytes are cached already)
                        prefetch_file(self.plan.artifact.root / w.payload.path)
                elif self.plan.sources[w.rank] == "recovery" and w.recovery:
                    for pinned in w.recovery:
                        prefetch_file(Path(pinned.path))
        except BaseException as exc:  # only a hint: hydration still reads the file itself
            self.held.prefetch_errors.append(exc)

    def take_lease(self) -> None:
        """Until the canary matches, the restored tree dies with this launcher."""
        with self.step(f"{self.op}.lease", "restore.lease"):
            self.held.lease = Lease([self.plan.controls[w.rank] for w in self.plan.workers])

    def restore_cuda(self) -> None:
        gpu_pids = list(self.plan.metadata.gpu_pids)
        if not gpu_pids:
            return
        with self.step(f"{self.op}.cuda_restore", "restore.cuda") as span:
            # The placed GPUs, by UUID; a replica's processes by their pids on this host.
            pairs = self.plan.gpus.pairs if self.plan.gpus is not None else []
            TreeCheckpoint().restore([self.host_pid(pid) for pid in gpu_pids], pairs)
            span["processes"] = len(gpu_pids)
            if pairs:
                span["gpus_remapped"] = ",".join(f"{old}->{new}" for old, new in pairs)

    def host_pid(self, captured: int) -> int:
        return self.held.host_pids.get(captured, captured)

    def collect_staged_weights(self) -> None:
        """The chunks each stager hydrated, exported for its rank's resume. A failed staging is a warning:
        that rank's agent hydrates from the pack itself."""
        if self.held.stagers:
            with self.timer.span(f"{self.op}.stage_wait"):
                staged = {rank: stager.join() for rank, stager in self.held.stagers.items()}
            for rank, stager in self.held.stagers.items():
                self.timer.add_timeline_span(f"{self.op}.stage_weights" + (f".rank{rank}" if rank else ""),
                                             stager.started_ns, stager.finished_ns,
                                             **{k: v for k, v in stager.stats.items() if isinstance(v, (int, bool, str))},
                                             **({"early": True} if rank in self.held.early_staged else {}))
                if staged[rank]:
                    adopted, self.held.fds_by_rank[rank] = stager.export()
                    self.held.handed_over += self.held.fds_by_rank[rank]
                    self.held.staged[rank] = (adopted, stager.stats)
                else:
                    self.plan.context.warn(f"rank {rank}: staging the weights failed ({stager.error}); "
                                      "the process hydrates them itself")
        if self.held.warmer is not None:
            self.held.warmer.join()

    def _resume_command(self, w: Any, coordinator: ActivationCoordinator) -> Resume:
        if w.rank in self.held.staged:  # the memory rides along with the command
            adopted, stats = self.held.staged[w.rank]
            return Resume(layout_digest=w.layout_digest, coordinator=coordinator.command_field(), adopted=adopted,
                          staged=stats)
        if self.plan.sources[w.rank] == "recovery":
            plan = self._recovery_plan(w)
            return Resume(layout_digest=w.layout_digest, coordinator=coordinator.command_field(),
                          safetensors=[pinned.path for pinned in w.recovery or []], residual=str(self.pack(w.residual)),
                          recovery_plan=plan[0] if plan else None, recovery_gap=plan[1] if plan else None)
        return Resume(layout_digest=w.layout_digest, coordinator=coordinator.command_field(),
                      payload=str(self.pack(w.payload)) if w.payload else None, residual=str(self.pack(w.residual)))

    def _recovery_plan(self, w: WorkerRecord) -> tuple[str, str] | None:
        """The rank's recovery plan and gap pack, verified (stat-bound records: no hashing when unchanged);
        None — the engine's loaders replay the safetensors, with a warning — when it has none or they fail."""
        if w.recovery_plan is None or w.recovery_gap is None:
            return None
        paths = []
        try:
            for ref in (w.recovery_plan, w.recovery_gap):
                path = self.plan.artifact.root / ref.path
                verify_file(path, ref.sha256, self.plan.artifact.record_dir(path))
                paths.append(str(path))
        except (PackError, OSError) as exc:
            self.plan.context.warn(f"rank {w.rank}: the recovery plan is unusable ({exc}); its engine's loaders replay "
                              "the safetensors instead (slower)")
            return None
        return paths[0], paths[1]

    def wait_for_arriving_packs(self) -> None:
        """A pack this restore still pulls (``restore oci://`` on a host that had no copy), which a rank's agent
        reads itself (no staging: a host region, or staging failed): every chunk in and verified first."""
        arriving = [(w.rank, arrival) for w in self.plan.workers if w.payload is not None and w.rank not in self.held.staged
                    and self.plan.sources[w.rank] == "native"
                    and (arrival := arrival_for(self.plan.artifact.root / w.payload.path)) is not None]
        if not arriving:
            return
        with self.step(f"{self.op}.pack_arrival", "restore.pack_arrival") as span:
            for rank, arrival in arriving:
                try:
                    arrival.wait()
                except ArrivalFailed as exc:
                    raise OperationFailed("restore.pack_arrival", f"rank {rank}: {exc}") from None
            span["packs"] = len(arriving)

    def resume_ranks(self) -> None:
        """Every rank at once: map and fill its regions, zero the KV cache, rebuild NCCL, recapture graphs."""
        self.wait_for_arriving_packs()
        with self.step(f"{self.op}.resume", "restore.resume") as span, \
                ActivationCoordinator(len(self.plan.workers), self.plan.units) as coordinator:
            bars = PhaseProgress(f"coldsnap {self.op} [{self.plan.descriptor.engine}/{self.plan.descriptor.snapshot_driver}]: ")

            def resume(w: Any) -> ResumeReply:
                return AgentClient(self.plan.controls[w.rank]).resume(
                    self._resume_command(w, coordinator), on_progress=bars if w.rank == 0 else None,
                    fds=self.held.fds_by_rank.get(w.rank, []))

            try:
                resumed_ranks = call_every_rank([(w.rank, functools.partial(resume, w)) for w in self.plan.workers], coordinator)
            finally:
                bars.finish()
                self._close_handed_over()  # (the launcher's own mappings go after the canary: release_staged)
            for w, resumed in zip(self.plan.workers, resumed_ranks):
                prefix = rank_prefix(w.rank)
                hydrated = resumed.hydrate
                span.update({f"{prefix}bytes": hydrated.bytes, f"{prefix}source": hydrated.source,
                             f"{prefix}staged": hydrated.staged, f"{prefix}pinned": hydrated.stats.get("pinned") is True})
                if hydrated.source == "recovery":  # by the recovery plan, or through the engine's loaders
                    span[f"{prefix}planned"] = hydrated.stats.get("planned") is True
                span.update({f"{prefix}{step}_ns": int(seconds * 1e9) for step, seconds in resumed.seconds.items()})
                if resumed.graphs_recaptured:
                    span[f"{prefix}graphs_recaptured"] = ",".join(resumed.graphs_recaptured)

    def install_served_key(self) -> None:
        """``--api-key-file``: the key into the restored HTTP process's key gate (:mod:`coldsnap.agent.api_key`),
        before the canary, which then asks with it (and so proves the key works). Without it the gate the capture
        held is opened: the server as captured. An engine without a gate (the reference workload, an earlier
        build's capture): nothing to do."""
        path = self.plan.context.request.api_key_file
        control = self.plan.controls[min(self.plan.controls)]
        if path is None:
            try:
                key_gate(control, {"open": True})
            except KeyGateMissing:
                pass
            except KeyGateError as exc:
                raise OperationFailed("restore.api_key", f"the restored server's key gate could not be opened: {exc}") from None
            return
        with self.step(f"{self.op}.api_key", "restore.api_key") as span:
            try:
                key = read_api_key(path)
                reply = install_api_key(control, key)
            except (ApiKeyFileError, KeyGateError) as exc:
                raise OperationFailed("restore.api_key", str(exc)) from None
            span["gates"] = int(reply["gates"])
        use_served_key(self.plan.serving_port, key)
        self.plan.context.progress("the restored server requires the API key from --api-key-file")

    def check_canary(self) -> None:
        """The restored server must answer as the captured one did. Where capture recorded the prefill's
        predictions, one prefill checks them at every prompt position plus the first generated tokens;
        else every token and the text."""
        record = self.plan.descriptor.canary
        quick_tokens = record.restore_tokens if record.prompt_argmax is not None else None
        quick = quick_tokens is not None
        tokens = quick_tokens or len(record.token_ids) or 16
        with self.step(f"{self.op}.canary", "restore.canary") as span:
            # HTTP errors are OSErrors: the restored server did not answer right
            canary = ask_canary(self.plan.serving_port, record.prompt, tokens, prompt_argmax=quick)
            span["tokens"] = len(canary.token_ids)
            span["checked"] = (f"prompt argmax at {len(record.prompt_argmax or [])} positions + {tokens} tokens" if quick
                               else f"{tokens} tokens and the text")
        if quick:
            if canary.prompt_argmax != record.prompt_argmax or canary.token_ids != record.token_ids[:tokens]:
                raise OperationFailed("restore.canary", f"canary predicted {canary.prompt_argmax} over the prompt and "
                                      f"generated {canary.token_ids}; captured {record.prompt_argmax} and "
                                      f"{record.token_ids[:tokens]}")
        elif canary.token_ids != record.token_ids or canary.text != record.expected_response:
            raise OperationFailed("restore.canary", f"canary answered {canary.text!r}, captured {record.expected_response!r}")
        if record.probes:
            self.check_canary_probes(record.probes)

    def check_canary_probes(self, probes: list[CanaryProbe]) -> None:
        """Each recorded probe asked again, in the captured order: the same token ids and logprobs, exactly."""
        with self.step(f"{self.op}.canary_probes", "restore.canary") as span:
            for index, probe in enumerate(probes):
                answer = ask_probe(self.plan.serving_port, probe.prompt_ids, len(probe.token_ids))
                if answer is None:
                    raise OperationFailed("restore.canary", f"canary probe {index} ({len(probe.prompt_ids)} prompt tokens): "
                                          "the restored server refused it or answered without token ids and logprobs")
                difference = first_difference(probe.token_ids, [float_of(b) for b in probe.logprob_bits], answer)
                if difference is not None:
                    raise OperationFailed("restore.canary", f"canary probe {index} ({len(probe.prompt_ids)} prompt tokens): "
                                          f"{difference}; the restored server computes differently from the captured one")
            span["probes"] = len(probes)

    def _close_handed_over(self) -> None:
        for fd in self.held.handed_over:
            os.close(fd)
        self.held.handed_over.clear()

    def unwind(self) -> None:
        """After any failure (an interrupt included): nothing this restore started survives it."""
        for stager in self.held.stagers.values():
            stager.cancel()
        for stager in self.held.stagers.values():
            stager.join()
            stager.release()
        self._close_handed_over()
        if self.held.criu is not None:  # (still restoring: CRIU and what it restored so far; restored: nothing left to do)
            self.held.criu.abandon()
        if self.held.restored_pid is not None:
            kill_tree(self.held.restored_pid)
        if self.held.lease is not None:
            self.held.lease.close()

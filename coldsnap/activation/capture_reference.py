"""The capture's canary and its reference check (:mod:`coldsnap.activation.reference_check`): the captured
engine asked the canary and the probes, a plain start of the command asked the same, the answers compared."""

from __future__ import annotations

import time

from coldsnap.activation.capture_state import CaptureState
from coldsnap.activation.canary import Canary, ask_canary
from coldsnap.activation.canary_probes import ProbeAnswer, bits_of, probe_plan
from coldsnap.activation.engine_process import EngineProcess, LaunchError, wait_for_http
from coldsnap.activation.reference_check import (REFERENCE_ENV, ReferenceAnswers, ReferenceMode, ask_probes, ask_reference,
                                                 reference_mode, reference_plan)
from coldsnap.contracts.artifact import CanaryProbe, ReferenceRecord
from coldsnap.operation import OperationFailed
from coldsnap.settings import SETTINGS

__all__ = ["ReferenceCheckSteps"]


def _probe_record(answer: ProbeAnswer) -> CanaryProbe:
    """A probe's answer as the descriptor keeps it (each logprob as its IEEE bits)."""
    return CanaryProbe(prompt_ids=answer.prompt_ids, token_ids=answer.token_ids,
                       logprob_bits=[bits_of(x) for x in answer.logprobs])


class ReferenceCheckSteps(CaptureState):
    """The canary and reference-check steps of :class:`~coldsnap.activation.capture_steps.CaptureSequence`."""

    def record_canary(self) -> None:
        """The canary's answer, and where the engine gives them, its prefill's top-1 predictions at every
        prompt position: a restore then checks those plus the first :data:`RESTORE_CANARY_TOKENS` tokens."""
        if self.units is not None and self.index != 0:  # unit 0 serves and asks; the others follow its ranks
            with self.step("capture.canary", "capture.canary"):
                shared = self.units.get("capture/canary")
            self.canary = Canary(text=shared["text"], token_ids=shared["token_ids"], seconds=0.0,
                                 prompt_argmax=shared["prompt_argmax"])
            self.probes = [CanaryProbe.model_validate(p) for p in shared["probes"]]
            return
        self._ask_canary()
        if self.units is not None:
            assert self.canary is not None
            self.units.put("capture/canary", {"text": self.canary.text, "token_ids": self.canary.token_ids,
                                              "prompt_argmax": self.canary.prompt_argmax,
                                              "probes": [p.to_json_value() for p in self.probes]})

    def _check_plan(self) -> tuple[tuple[int, int], ...]:
        """The probes the captured engine is asked: the restore's, and with the reference check its own after them."""
        return reference_plan(probe_plan()) if self.reference_mode == "plain" else probe_plan()

    def _ask_canary(self) -> None:
        """The canary, then the probes (:meth:`_check_plan`), one at a time: the same requests in the same order
        as the reference start was asked. The restore's probes are recorded for every restore to check."""
        validation = self.request.policy.validation
        assert validation.prompt is not None and validation.max_tokens is not None  # resolve_request fills both
        restore_lengths = {length for length, _ in probe_plan()}
        with self.step("capture.canary", "capture.canary") as span:
            self.canary = ask_canary(self.port, validation.prompt, validation.max_tokens, prompt_argmax=True)
            span["tokens"] = len(self.canary.token_ids)
        self.context.progress(f"canary answered {self.canary.text!r} ({len(self.canary.token_ids)} tokens)")
        with self.step("capture.canary_probes", "capture.canary") as span:
            answers = self.captured_answers = ReferenceAnswers(self.canary, ask_probes(self.port, self._check_plan()))
            self.probes = [_probe_record(answer) for (length, _), answer in answers.probes
                           if answer is not None and length in restore_lengths]
            lengths = [str(len(p.prompt_ids)) for p in self.probes]
            span["probes"] = ",".join(lengths)
        if self.probes:
            self.context.progress(f"canary probes recorded: {len(self.probes)} prompts of {', '.join(lengths)} tokens, "
                                  "ids and logprobs")
        else:
            self.context.progress("no canary probes: the engine gave no token ids and logprobs for token-id prompts")

    def _reference_mode(self) -> tuple[ReferenceMode, str | None]:
        """This capture's reference mode, and why it is ``none`` where it is."""
        if self.units is not None:
            return "none", ("one launch unit of several: the check would need every unit's plain start at once, "
                            "which this build does not run")
        try:
            mode = reference_mode(self.request.engine)
        except ValueError as exc:
            raise OperationFailed("capture.reference", f"{REFERENCE_ENV}: {exc}") from None
        if mode == "plain":
            return mode, None
        if SETTINGS.text(REFERENCE_ENV):
            return mode, "skipped: --reference none"
        return mode, (f"skipped: not on by default for {self.request.engine} (coldsnap's own deterministic workload); "
                      "--reference plain runs it")

    def start_reference(self) -> None:
        """The plain start of the command (:mod:`coldsnap.activation.reference_check`), before the engine that
        is captured: started as a user starts it, asked the canary and the check's probes, stopped. Skipped,
        and recorded as skipped, with ``--reference none`` and for one launch unit of several."""
        with self.step("capture.reference_start", "capture.reference") as span:
            self.reference_mode, self.reference_note = self._reference_mode()
            span["mode"] = self.reference_mode
            if self.reference_mode == "none":
                self.context.progress(f"reference check {self.reference_note}")
                return
            self.reference_answers = self._plain_start_answers(span)

    def _plain_start_answers(self, span: dict[str, str | int | bool]) -> ReferenceAnswers:
        """One plain start of the command: ready (HTTP ``/health``), asked the check's requests, stopped (its GPU
        memory and the port free again before anything else starts)."""
        validation, unit = self.request.policy.validation, self.unit
        assert validation.prompt is not None and validation.max_tokens is not None  # resolve_request fills both
        self._prepare_output()
        plan = self._check_plan()
        which = "a second plain start" if self.plain_starts else "a plain start"
        self.context.progress(f"reference check: {which} of the command (no coldsnap agent) first; the engine captured "
                              f"after it must give its canary and {len(plan)} probes back exactly, ids and logprob bits")
        started = time.perf_counter()
        engine = self.reference_engine = EngineProcess(list(unit.command), self.artifact.reference_log_path(unit.unit_id),
                                                       self.engine_env.variables, agent=False)
        self.plain_starts += 1
        self._note_environment(span)
        try:
            wait_for_http(self.port, engine.alive, self.ready_timeout)
            ready_s = time.perf_counter() - started
            self.context.progress(f"reference start (pid {engine.pid}) ready after {ready_s:.1f} s; asking it the canary "
                                  f"and {len(plan)} probes")
            answers = ask_reference(self.port, validation.prompt, validation.max_tokens, plan)
        except (LaunchError, OSError) as exc:
            ended = engine.ended()
            # (its log goes with the output directory: its last lines to the progress stream first)
            self.context.progress(f"the plain reference start failed; its last lines:\n{engine.log_tail(20)}")
            if isinstance(exc, LaunchError):
                raise OperationFailed("capture.reference", f"the plain reference start of the command: {exc}"
                                      f"{f' (the command {ended})' if ended else ''}{self._reference_log_tail()}") from None
            raise OperationFailed("capture.reference", "the plain reference start did not answer the canary or a "
                                  f"probe: {exc}{self._reference_log_tail()}") from None
        finally:
            self._stop_reference()
        span[f"plain_start_{self.plain_starts}_ready_ns"] = int(ready_s * 1e9)
        span[f"plain_start_{self.plain_starts}_ns"] = int((time.perf_counter() - started) * 1e9)
        return answers

    def _reference_log_tail(self) -> str:
        engine = self.reference_engine
        last = [line.strip() for line in (engine.log_tail(13) if engine else "").splitlines() if line.strip()][-3:]
        return f" | reference log: {' | '.join(last)}" if last else ""

    def _stop_reference(self) -> None:
        """The reference start stopped (SIGTERM, then SIGKILL), its GPU memory given back and the port free again."""
        engine = self.reference_engine
        if engine is not None and engine.alive():
            self._stop_tree(engine, graceful=True)
        self.sweep_engine_tmp()

    def check_reference(self) -> None:
        """The captured engine's answers must equal the plain start's, every token id and logprob bit. On a
        mismatch, once more: a second plain start (which must agree with one of the two: else plain starts of
        the command disagree on this host, and nothing can be proved), then the engine again, which must answer
        as that second plain start did. ``capture.reference`` otherwise, nothing committed."""
        if self.reference_mode == "none":
            return
        with self.step("capture.reference", "capture.reference") as span:
            assert self.reference_answers is not None and self.captured_answers is not None
            difference = self.reference_answers.difference(self.captured_answers, "the plain start", "the captured engine")
            span["matched_first"] = difference is None
            if difference is not None:
                span["first_difference"] = difference[:500]
                self._check_reference_again(difference, span)
            answers = self.reference_answers
            span.update(plain_starts=self.plain_starts, capture_starts=self.capture_starts,
                        probes=len(answers.answered()), answers_sha256=answers.sha256())
        probes = (f" and {len(answers.answered())} probes" if answers.answered() else
                  " (it answered no probe: no token ids and logprobs for token-id prompts)")
        self.context.progress(f"reference check passed: the captured engine answered a plain start's canary{probes} "
                              "exactly, token ids and logprob bits")

    def _check_reference_again(self, difference: str, span: dict[str, str | int | bool]) -> None:
        first_plain, first_engine = self.reference_answers, self.captured_answers
        assert first_plain is not None and first_engine is not None and self.engine is not None
        self.context.progress(f"reference check: the captured engine answers differently from the plain start: "
                              f"{difference}; trying once more (one more plain start, then the engine again)")
        self._stop_tree(self.engine)
        second = self._plain_start_answers(span)
        against_plain = first_plain.difference(second, "the first plain start", "the second plain start")
        against_engine = first_engine.difference(second, "the first engine start", "the second plain start")
        if against_plain is not None and against_engine is not None:
            raise OperationFailed("capture.reference", "plain starts of the command disagree on this host, so no "
                                  f"capture can be proved equal to one: {against_plain}; and the first captured engine "
                                  f"differed too ({difference}). Nothing was committed; `coldsnap capture --reference "
                                  "none` captures without the check")
        deviant = "the first plain start" if against_plain is not None else "the first start of the captured engine"
        self.reference_note = f"retried: {deviant} answered unlike the other starts ({difference})"
        self.reference_answers = second
        self.launch()
        self.wait_until_ready()
        self.record_canary()
        assert self.captured_answers is not None
        again = second.difference(self.captured_answers, "the plain start", "the captured engine")
        if again is not None:
            raise OperationFailed("capture.reference", "the captured engine answers differently from a plain start of "
                                  f"the same command, twice: {again}. Nothing was committed")

    def _reference_record(self) -> ReferenceRecord:
        """What the descriptor says of the check."""
        answers = self.reference_answers
        if self.reference_mode == "none" or answers is None:
            return ReferenceRecord(mode="none", note=self.reference_note)
        return ReferenceRecord(mode="plain", note=self.reference_note, plain_starts=self.plain_starts,
                               capture_starts=self.capture_starts, canary_token_ids=answers.canary.token_ids,
                               probes=[_probe_record(a) for a in answers.answered()],
                               answers_sha256=answers.sha256())

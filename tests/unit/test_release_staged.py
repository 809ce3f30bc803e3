"""The launcher lets go of its own mappings of the weights it staged after the canary, in a span of its own."""

from __future__ import annotations

from coldsnap.activation.restore_state import RestoreHeld
from coldsnap.activation.restore_steps import RestoreSequence
from coldsnap.timing import OperationTimer


class FakeGpuStager:
    """Stands in for :class:`coldsnap.activation.staging.WeightStager`, whose regions need a GPU."""

    def __init__(self, staged: bool):
        self.staged = {"weights": object()} if staged else {}
        self.released = 0

    def release(self) -> None:
        self.released += 1
        self.staged = {}


def sequence_with(stagers: dict[int, FakeGpuStager]) -> RestoreSequence:
    sequence = object.__new__(RestoreSequence)  # (only what release_staged reads)
    sequence.held, sequence.timer, sequence.op = RestoreHeld(stagers=stagers), OperationTimer(None), "restore"  # type: ignore[arg-type]
    return sequence


def test_staged_weights_are_released_in_their_own_span_once():
    stagers = {0: FakeGpuStager(staged=True), 1: FakeGpuStager(staged=True)}
    sequence = sequence_with(stagers)
    sequence.release_staged()
    sequence.release_staged()  # (nothing left: no second span)
    assert [s.released for s in stagers.values()] == [1, 1]
    assert [span.name for span in sequence.timer.envelope().spans] == ["restore.release_staged"]


def test_nothing_staged_records_nothing():
    sequence = sequence_with({0: FakeGpuStager(staged=False)})
    sequence.release_staged()
    assert sequence.timer.envelope().spans == []

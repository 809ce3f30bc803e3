"""The coldsnap agent's steps, run on SGLang's scheduler thread between two iterations of its loop.

SGLang's scheduler runs its event loop on one thread, and when idle that loop never blocks: it polls its
sockets with ``zmq.NOBLOCK`` again and again. A graph recapture run on the agent's own thread then
fights that loop for the GIL at every CUDA call it makes (each one releases and retakes it, and the loop
holds it for a whole switch interval): on the H200 the recapture after a ``recreate`` restore took 184 s
where SGLang's start-up capture takes seconds. Run by the scheduler thread instead, the work happens on
the thread that captured the graphs at start-up, with the loop paused for exactly as long as the work
takes and no request in between.

The place is the loop's request broadcast (``SchedulerRequestReceiver._broadcast_reqs_across_ranks``,
hooked by :func:`around_broadcast_requests`), because at TP > 1 the steps must also run in lockstep.
There each scheduler's loop broadcasts, every iteration and idle or not, rank 0's requests to the other
ranks over the TP group's gloo group. Gloo matches a group's operations by their order on each rank, so
a gloo call of the agent's thread on that group (the pynccl unique id's broadcast, the custom
all-reduces' handle exchanges and barriers) lands between two of the loop's broadcasts at a different
place on each rank: the sizes do not match and gloo aborts the process (``op.preamble.length <=
op.nbytes``; ``tests/unit/test_sglang_lockstep.py`` shows it with two processes). Nor can the
schedulers be parked at "the same" iteration from outside: whichever rank is stopped second may already
be waiting in the next broadcast. So rank 0 puts a :class:`LockstepMarker` into the requests it
broadcasts, every rank receives it in the same iteration, and each scheduler runs its own agent's step
right after that broadcast, before the next: on every rank at the same point of the group's gloo
sequence. At TP 1 the method broadcasts nothing and the marker just marks the place.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from coldsnap.collective.torch_groups import NcclTeardownError

__all__ = ["ALONE_PICKUP_SECONDS", "LOCKSTEP", "LOCKSTEP_PICKUP_SECONDS", "Lockstep", "LockstepError",
           "LockstepMarker", "around_broadcast_requests", "in_lockstep", "on_scheduler_thread"]

log = logging.getLogger("sglang.coldsnap")  # under SGLang's logger: the lines show in the engine's log

T = TypeVar("T")


class _Job:
    def __init__(self, work: Callable[[], Any]):
        self.work = work
        self.claimed = False
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None

    def claim(self) -> bool:
        """True for the one caller that gets to run the job (the scheduler or, given up on, its submitter)."""
        with self.lock:
            if self.claimed:
                return False
            self.claimed = True
            return True

    def run(self) -> None:
        try:
            self.result = self.work()
        except BaseException as exc:  # noqa: BLE001 - handed to the submitter, which raises it
            self.error = exc
        finally:
            self.done.set()


class LockstepError(NcclTeardownError):
    """A step every rank runs at once did not run on this rank (its scheduler never broadcast, or the
    step came after rank 0's had gone by); reported as ``agent.collectives``."""


@dataclass(frozen=True)
class LockstepMarker:
    """Carried in rank 0's broadcast requests: every rank runs its agent's step ``sequence`` there."""

    sequence: int


LOCKSTEP_PICKUP_SECONDS = 120.0
"""How long a step waits for its scheduler to reach rank 0's marker (every rank's agent is in the same
restore, a barrier apart, and an idle loop broadcasts every few microseconds)."""

ALONE_PICKUP_SECONDS = 10.0
"""A single rank's step: how long it waits for the loop before its caller runs it (the loop is stopped
or busy elsewhere, and with no other rank nothing has to match)."""


class Lockstep:
    """This rank's agent steps, run by its scheduler thread right after the broadcast that carries their
    marker (see the module docstring). Steps are numbered in the order the agent submits them, which is
    the same on every rank (they follow the same restore), so rank r runs its step ``n`` where rank 0
    ran its own."""

    def __init__(self, pickup_seconds: float = LOCKSTEP_PICKUP_SECONDS):
        self.pickup_seconds = pickup_seconds
        self._posted = threading.Condition()
        self._jobs: dict[int, _Job] = {}
        self._submitted = 0  # the last step number this rank's agent handed in
        self._announced = 0  # rank 0: the last step number put into a broadcast
        self._missed: set[int] = set()  # markers that came and went without this rank's step
        self._seen = threading.Event()  # the loop broadcast through the hook at least once

    def around_broadcast(self, original: Callable[..., Any], receiver: Any, *args: Any, **kwargs: Any) -> Any:
        """HookRegistry AROUND hook on ``SchedulerRequestReceiver._broadcast_reqs_across_ranks(recv_reqs, ...)``:
        rank 0 (the rank with requests to send) adds a marker per step waiting, every rank runs its steps
        for the markers it received, and the requests go on without them."""
        if not self._seen.is_set():
            self._seen.set()
        pulled: list[Any] | None = args[0] if args else kwargs.get("recv_reqs")  # by position, today
        markers = self._announce() if pulled is not None else []
        if markers:
            with_markers = [*(pulled or ()), *markers]
            if args:
                args = (with_markers, *args[1:])
            else:
                kwargs = {**kwargs, "recv_reqs": with_markers}
        requests = original(receiver, *args, **kwargs)
        if requests and any(isinstance(item, LockstepMarker) for item in requests):
            for item in [item for item in requests if isinstance(item, LockstepMarker)]:
                self._run(item.sequence)
            requests = [item for item in requests if not isinstance(item, LockstepMarker)]
        return requests

    def submit(self, work: Callable[[], T], alone: bool = False) -> T:
        """``work()`` run by this rank's scheduler at the broadcast that carries its step's marker; its
        result, or its exception raised here. ``alone`` (TP 1): where the loop never broadcast (an SGLang
        without the hook) or does not within :data:`ALONE_PICKUP_SECONDS`, the caller runs it."""
        job = _Job(work)
        if alone and not self._seen.is_set():
            job.claim()
            job.run()
            return self._outcome(job)
        with self._posted:
            self._submitted += 1
            sequence = self._submitted
            if sequence in self._missed:
                raise LockstepError(f"rank 0 ran coldsnap's step {sequence} before this rank's agent reached it")
            self._jobs[sequence] = job
            self._posted.notify_all()
        if not job.done.wait(ALONE_PICKUP_SECONDS if alone else self.pickup_seconds):
            with self._posted:
                given_up = job.claim()
                if given_up:
                    self._jobs.pop(sequence, None)
            if given_up and alone:
                job.run()
            elif given_up:
                raise LockstepError(f"SGLang's scheduler did not reach coldsnap's step {sequence} in its request "
                                    f"broadcast within {self.pickup_seconds:.0f} s")
            job.done.wait()
        return self._outcome(job)

    @staticmethod
    def _outcome(job: _Job) -> Any:
        if job.error is not None:
            raise job.error
        return job.result

    def _announce(self) -> list[LockstepMarker]:
        if self._announced == self._submitted:  # every iteration: no lock while nothing waits
            return []
        with self._posted:
            markers = [LockstepMarker(n) for n in range(self._announced + 1, self._submitted + 1) if n in self._jobs]
            self._announced = self._submitted
        return markers

    def _run(self, sequence: int) -> None:
        with self._posted:
            self._posted.wait_for(lambda: sequence in self._jobs, self.pickup_seconds)
            job = self._jobs.pop(sequence, None)
            if job is None:
                self._missed.add(sequence)
        if job is None:
            log.error("coldsnap: rank 0 ran step %d, which this rank's agent did not hand in within %.0f s; this "
                      "rank's restore will fail", sequence, self.pickup_seconds)
        elif job.claim():
            job.run()


LOCKSTEP = Lockstep()
"""This process's steps (one scheduler per process)."""


def around_broadcast_requests(original: Callable[..., Any], receiver: Any, *args: Any, **kwargs: Any) -> Any:
    """The hook SGLang's registry holds (:meth:`Lockstep.around_broadcast` of :data:`LOCKSTEP`)."""
    return LOCKSTEP.around_broadcast(original, receiver, *args, **kwargs)


def in_lockstep(work: Callable[[], T]) -> T:
    """TP > 1: ``work()`` on this rank's scheduler thread where every rank runs its own (:meth:`Lockstep.submit`)."""
    return LOCKSTEP.submit(work)


def on_scheduler_thread(work: Callable[[], T]) -> T:
    """TP 1: ``work()`` on the scheduler thread between two iterations, or here without one."""
    return LOCKSTEP.submit(work, alone=True)

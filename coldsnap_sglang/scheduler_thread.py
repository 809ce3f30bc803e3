"""Work the coldsnap agent hands to SGLang's scheduler thread, which runs it at its next idle tick.

SGLang's scheduler runs its event loop on one thread, and when idle that loop never blocks: it polls
its sockets with ``zmq.NOBLOCK`` and calls ``Scheduler.on_idle`` again and again. A graph recapture
run on the agent's own thread then fights that loop for the GIL at every CUDA call it makes (each one
releases and retakes it, and the loop holds it for a whole switch interval): on the H200 the
recapture after a ``recreate`` restore took 184 s where SGLang's start-up capture takes seconds. Run
from ``on_idle`` instead (:func:`around_on_idle`), the work happens on the thread that captured the
graphs at start-up, with the loop paused for exactly as long as the work takes and no request in
between (the scheduler does nothing else meanwhile).

Where no idle tick was ever seen (an SGLang without the hook), or none picks a job up within
:data:`PICKUP_SECONDS`, the caller runs the job itself, as before.

At TP > 1 that would deadlock: the ranks' schedulers move in lockstep (rank 0 broadcasts each
iteration's requests to the others over the TP group's gloo group), so a rank whose tick picked the
job up one iteration after its peer's did sits in that broadcast while its peer, inside the job, waits
for it in an NCCL collective. There the agent runs the work on its own thread instead, with the
scheduler held at its idle tick (:func:`with_scheduler_parked`): every scheduler is then either parked
or blocked in a gloo call for its parked peer, neither holding the GIL nor touching the GPU.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from typing import Any, Callable, Iterator, TypeVar

from coldsnap_sglang.process import ProcessState

__all__ = ["PARK_SECONDS", "PICKUP_SECONDS", "around_on_idle", "on_scheduler_thread", "run_pending",
           "with_scheduler_parked"]

T = TypeVar("T")

PICKUP_SECONDS = 10.0
"""How long a job waits for an idle tick before its caller runs it (an idle loop ticks in microseconds)."""


class _Job:
    def __init__(self, work: Callable[[], Any]):
        self.work = work
        self.claimed = False
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None

    def claim(self) -> bool:
        """True for the one caller that gets to run the job (the scheduler's tick or, late, its submitter)."""
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


_pending: deque[_Job] = deque()
_ticked = threading.Event()  # an idle tick ran this module's hook at least once


def run_pending() -> None:
    """Run every job waiting for the scheduler thread (called on that thread; cheap when none waits)."""
    if not _ticked.is_set():
        _ticked.set()
    while _pending:
        job = _pending.popleft()
        if job.claim():
            job.run()


def on_scheduler_thread(work: Callable[[], T], pickup_seconds: float = PICKUP_SECONDS) -> T:
    """``work()`` run on SGLang's scheduler thread at its next idle tick; its result, or its exception
    raised here. Without idle ticks (none seen, or none within ``pickup_seconds``) it runs here."""
    job = _Job(work)
    if _ticked.is_set():
        _pending.append(job)
        if not job.done.wait(pickup_seconds) and job.claim():
            job.run()  # the scheduler did not tick: its loop is stopped or busy elsewhere
        job.done.wait()
    elif job.claim():
        job.run()
    if job.error is not None:
        raise job.error
    return job.result


PARK_SECONDS = 1.0
"""How long :func:`with_scheduler_parked` waits to see the scheduler parked: past it, the scheduler is
blocked elsewhere (at TP > 1, in the gloo broadcast its parked rank 0 never sends), with the GIL released."""


@contextlib.contextmanager
def _scheduler_parked(park_seconds: float) -> Iterator[bool]:
    """The scheduler thread held at its next idle tick while the block runs; yields whether it was seen parked."""
    if not _ticked.is_set():
        yield False
        return
    parked, resume = threading.Event(), threading.Event()

    def park() -> None:
        parked.set()
        resume.wait()

    job = _Job(park)
    _pending.append(job)
    try:
        yield parked.wait(park_seconds)
    finally:
        resume.set()
        job.claim()  # a park no tick picked up is dropped (the tick skips a claimed job)


def with_scheduler_parked(work: Callable[[], T], park_seconds: float = PARK_SECONDS) -> T:
    """``work()`` on the calling thread while SGLang's scheduler thread waits at its idle tick."""
    with _scheduler_parked(park_seconds):
        return work()


def around_on_idle(original: Callable[..., Any], scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """HookRegistry AROUND hook on ``Scheduler.on_idle``: the scheduler noted, the agent's waiting jobs
    run (on the scheduler's thread), then SGLang's idle housekeeping."""
    ProcessState.scheduler = scheduler
    run_pending()
    return original(scheduler, *args, **kwargs)

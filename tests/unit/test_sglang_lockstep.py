"""coldsnap_sglang.scheduler_thread's lockstep steps at TP 2, over a real gloo group between two processes.

SGLang's scheduler loop at TP > 1 broadcasts rank 0's requests to the other ranks every iteration, idle or
not, over the TP group's gloo group (``broadcast_pyobj``: a size, then the pickled requests). The loops
below do exactly that (the same two broadcasts), and each rank's "agent" runs the gloo calls SGLang's
communicators make when coldsnap rebuilds them: a 128-byte unique id broadcast from rank 0 (pynccl), an
object all-gather (the custom all-reduce's handles), a barrier (``CustomAllReduceV2.close``) — first as
bare calls, then through :class:`coldsnap_sglang.distributed.SglangCollectives` with stand-ins for SGLang's
communicators (named *OverGlooForCpuTest) that make those calls in their constructors and ``close``, and
the activation coordinator's barriers. Torch, gloo, the coordinator, the processes and the interleaving
are real; no SGLang (its scheduler needs a GPU).
"""

from __future__ import annotations

import multiprocessing
import pickle
import queue
import threading
import time
from types import SimpleNamespace

import pytest

from coldsnap_sglang.scheduler_thread import Lockstep, LockstepError, LockstepMarker
from tests.helpers import free_port

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
zmq = pytest.importorskip("zmq")  # the activation coordinator's transport

TOKEN = b"sglang-lockstep-test-token-0123!"

STEPS = 3


def broadcast_objects(objects: list | None, rank: int, group) -> list:
    """SGLang's ``broadcast_pyobj`` from rank 0 over a gloo group: the size, then the bytes."""
    if rank == 0:
        data = pickle.dumps(objects)
        dist.broadcast(torch.tensor([len(data) if objects else 0], dtype=torch.long), src=0, group=group)
        if objects:
            dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=0, group=group)
        return objects
    size = torch.tensor([0], dtype=torch.long)
    dist.broadcast(size, src=0, group=group)
    if not int(size.item()):
        return []
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(data, src=0, group=group)
    return pickle.loads(data.numpy().tobytes())


def communicator_step(step: int, rank: int, group) -> tuple[str, object]:
    """One gloo exchange a rebuilt SGLang communicator makes, and the thread it ran on."""
    if step == 0:  # PyNcclCommunicator: rank 0's unique id to every rank
        unique_id = torch.full((128,), 7 if rank == 0 else 0, dtype=torch.uint8)
        dist.broadcast(unique_id, src=0, group=group)
        value: object = int(unique_id.sum())
    elif step == 1:  # CustomAllreduce: every rank's IPC handles to every rank
        handles: list = [None, None]
        dist.all_gather_object(handles, f"handle of rank {rank}", group=group)
        value = handles
    else:  # CustomAllReduceV2.close
        dist.barrier(group=group)
        value = "barrier"
    return threading.current_thread().name, value


def start_scheduler_loop(rank: int, group, lockstep: Lockstep) -> tuple[threading.Event, threading.Thread, list]:
    """SGLang's idle scheduler loop at TP 2 on a thread of its own: rank 0 pulls now and then a request,
    finally "stop" once the returned event is set; every rank broadcasts, every iteration."""
    received: list = []
    stop = threading.Event()

    def event_loop() -> None:
        iteration = 0
        while True:
            iteration += 1
            pulled = None
            if rank == 0:  # the rank that pulls requests from the tokenizer
                pulled = ([f"request {iteration}"] if iteration % 97 == 0 else []) + (["stop"] if stop.is_set() else [])
            requests = lockstep.around_broadcast(lambda receiver, objects: broadcast_objects(objects, rank, group),
                                                 None, pulled)
            received.extend(requests)
            if "stop" in requests:
                return

    loop = threading.Thread(target=event_loop, name=f"scheduler-{rank}", daemon=True)
    loop.start()
    return stop, loop, received


def init_gloo(rank: int, port: int):
    """Two ranks' default group and the TP group's gloo ``cpu_group``."""
    import datetime

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=20))
    return dist.new_group([0, 1], backend="gloo")


def rank_main(rank: int, port: int, in_lockstep: bool, results) -> None:
    """One TP rank: SGLang's idle scheduler loop on its thread, the agent's steps from this one."""
    group = init_gloo(rank, port)
    lockstep = Lockstep(pickup_seconds=60)
    stop, loop, received = start_scheduler_loop(rank, group, lockstep)
    steps = []
    for step in range(STEPS):
        time.sleep(0.03 * (rank + 1))  # the ranks' agents reach each step at different moments
        def work(step: int = step) -> object:
            return communicator_step(step, rank, group)

        steps.append(lockstep.submit(work) if in_lockstep else work())
    time.sleep(0.05)  # the loops go on after the steps
    stop.set()
    loop.join(60)
    results.put((rank, steps, received, loop.is_alive()))
    dist.destroy_process_group()


class NcclLibraryOverGlooForCpuTest:
    """SGLang's ``NCCLLibrary``: ``lib.ncclCommAbort`` (ctypes binds it unasked)."""

    def __init__(self):
        self.lib = SimpleNamespace(ncclCommAbort=lambda comm: 0)

    @staticmethod
    def ncclGetErrorString(result):  # noqa: N802 - SGLang's name
        return "unhandled system error"


class PyNcclOverGlooForCpuTest:
    """SGLang's ``PyNcclCommunicator``: its constructor broadcasts rank 0's unique id on the group's gloo group."""

    def __init__(self, group, device, is_symmetric_memory_enabled=False):
        unique_id = torch.zeros(128, dtype=torch.uint8)
        if dist.get_rank(group) == 0:
            unique_id = torch.randint(0, 256, (128,), dtype=torch.uint8)
        dist.broadcast(unique_id, src=dist.get_process_group_ranks(group)[0], group=group)
        self.unique_id = bytes(unique_id.tolist())
        self.made_on = threading.current_thread().name
        self.nccl = NcclLibraryOverGlooForCpuTest()
        self.comm = f"ncclComm {self.unique_id[:4].hex()}"
        self.available = True
        self.disabled = True


class CustomAllReduceV2OverGlooForCpuTest:
    """SGLang's ``CustomAllReduceV2``: handles all-gathered and a barrier when made, a barrier when closed."""

    def __init__(self, group, device):
        self.group = group
        self.handles: list = [None, None]
        dist.all_gather_object(self.handles, f"ipc handle of rank {dist.get_rank(group)}", group=group)
        dist.barrier(group=group)
        self.made_on = threading.current_thread().name
        self.disabled = False

    def close(self):
        dist.barrier(group=self.group)


def collectives_rank_main(rank: int, port: int, endpoint: str, results) -> None:
    """One TP rank: SglangCollectives' teardown and rebuild in lockstep beside the busy scheduler loop."""
    from coldsnap.coord import CoordinatorClient
    from coldsnap_sglang.distributed import SglangCollectives

    group = init_gloo(rank, port)
    tp = SimpleNamespace(unique_name="tp:0", ranks=[0, 1], rank_in_group=rank, device=SimpleNamespace(index=None),
                         cpu_group=group, device_group=None, torch_symm_mem_comm=None, pymscclpp_comm=None,
                         qr_comm=None)
    tp.pynccl_comm = PyNcclOverGlooForCpuTest(group, tp.device)  # as SGLang made them, before its loop started
    tp.ca_comm = CustomAllReduceV2OverGlooForCpuTest(group, tp.device)
    before = tp.pynccl_comm.unique_id
    lockstep = Lockstep(pickup_seconds=60)
    stop, loop, received = start_scheduler_loop(rank, group, lockstep)
    collectives = SglangCollectives(rank, 2, groups=lambda: [tp], communicator_class=PyNcclOverGlooForCpuTest,
                                    symmetric_memory_enabled=lambda: False, step=lockstep.submit)
    seconds: dict[str, float] = {}
    with CoordinatorClient(endpoint, TOKEN, rank) as client:
        time.sleep(0.05 * rank)
        collectives.teardown(client, seconds)
        torn_down = (tp.pynccl_comm.comm, tp.ca_comm)
        time.sleep(0.05 * (1 - rank))
        collectives.rebuild(client, seconds)
    stop.set()
    loop.join(60)
    results.put((rank, before, torn_down, tp.pynccl_comm.unique_id, tp.pynccl_comm.made_on, tp.ca_comm.handles,
                 tp.ca_comm.made_on, received, loop.is_alive()))
    dist.destroy_process_group()


def run_ranks(main, *args, deadline_s: float = 60) -> tuple[list[int | None], dict[int, tuple]]:
    """``main(rank, port, *args, results)`` in two processes: their exit codes (None: killed at the
    deadline) and what each reported."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=main, args=(rank, port, *args, results)) for rank in range(2)]
    for process in processes:
        process.start()
    reported: dict[int, tuple] = {}
    deadline = time.monotonic() + deadline_s
    # until both reported, or one died (a gloo abort: its peer then waits for it until gloo's timeout)
    while len(reported) < len(processes) and time.monotonic() < deadline:
        if any(process.exitcode not in (None, 0) for process in processes):
            break
        try:
            rank, *rest = results.get(timeout=0.2)
            reported[rank] = tuple(rest)
        except queue.Empty:
            continue
    for process in processes:
        process.join(max(0.1, min(10.0, deadline - time.monotonic())) if len(reported) == len(processes) else 0.1)
    exit_codes = [process.exitcode for process in processes]
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join()
    return exit_codes, reported


def test_steps_run_after_the_same_broadcast_on_every_rank_and_the_loops_go_on():
    exit_codes, reported = run_ranks(rank_main, True)
    assert exit_codes == [0, 0] and set(reported) == {0, 1}, (exit_codes, reported)
    for rank, (steps, received, loop_alive) in reported.items():
        assert not loop_alive
        assert [value for _, value in steps] == [128 * 7, ["handle of rank 0", "handle of rank 1"], "barrier"]
        assert {thread for thread, _ in steps} == {f"scheduler-{rank}"}  # on the scheduler's own thread
        assert received[-1] == "stop" and not any(isinstance(item, LockstepMarker) for item in received)
    assert reported[0][1] == reported[1][1]  # every request rank 0 pulled reached rank 1, in order


def test_without_lockstep_the_same_steps_break_the_ranks_gloo():
    """The failure the lockstep exists for: the steps' gloo calls from the agent's own thread land between
    the loops' broadcasts at different places on each rank, and gloo kills a rank (or the steps see garbage)."""
    exit_codes, reported = run_ranks(rank_main, False, deadline_s=30)
    intact = exit_codes == [0, 0] and len(reported) == 2 and all(
        [value for _, value in steps] == [128 * 7, ["handle of rank 0", "handle of rank 1"], "barrier"]
        for steps, _, _ in reported.values())
    assert not intact, (exit_codes, reported)


def test_a_step_whose_marker_went_by_fails_and_one_never_broadcast_gives_up():
    lockstep = Lockstep(pickup_seconds=0.05)
    lockstep.around_broadcast(lambda receiver, objects: [LockstepMarker(1)], None, None)  # rank 0 ran step 1 alone
    with pytest.raises(LockstepError, match="rank 0 ran coldsnap's step 1 before this rank's agent reached it"):
        lockstep.submit(lambda: "late")
    with pytest.raises(LockstepError, match="did not reach coldsnap's step 2"):  # no broadcast comes at all
        lockstep.submit(lambda: "never")
    assert lockstep.around_broadcast(lambda receiver, objects: objects, None, ["request"]) == ["request"]  # none waits


def test_a_steps_error_is_raised_to_its_agent_and_the_loop_goes_on():
    lockstep = Lockstep(pickup_seconds=5)
    outcome: list = []

    def agent() -> None:
        try:
            lockstep.submit(lambda: (_ for _ in ()).throw(RuntimeError("rebuild failed")))
        except RuntimeError as exc:
            outcome.append(str(exc))

    thread = threading.Thread(target=agent)
    thread.start()
    while not lockstep._submitted:
        time.sleep(0.001)
    assert lockstep.around_broadcast(lambda receiver, objects: objects, None, ["request"]) == ["request"]
    thread.join(5)
    assert outcome == ["rebuild failed"]


def test_sglang_collectives_tear_down_and_rebuild_in_lockstep_beside_the_busy_loop():
    """The real teardown and rebuild sequence (coordinator barriers, SGLang's constructors called again on
    the group's gloo group) with the scheduler loops broadcasting all along: the communicators are remade
    on each rank's scheduler thread, rank 0's new unique id reaches rank 1, and no request is lost."""
    from coldsnap.coord import Coordinator

    server = Coordinator("127.0.0.1:0", TOKEN, 2, ttl=60)
    serving = threading.Thread(target=server.serve, daemon=True)
    serving.start()
    try:
        exit_codes, reported = run_ranks(collectives_rank_main, server.endpoint)
    finally:
        server.stop()
        serving.join(5)
    assert exit_codes == [0, 0] and set(reported) == {0, 1}, (exit_codes, reported)
    for rank, (before, torn_down, unique_id, pynccl_on, handles, custom_on, received, alive) in reported.items():
        assert torn_down == (None, None) and unique_id != before and not alive
        assert pynccl_on == custom_on == f"scheduler-{rank}"
        assert handles == ["ipc handle of rank 0", "ipc handle of rank 1"] and received[-1] == "stop"
    assert reported[0][2] == reported[1][2]  # one new unique id, rank 0's, on both ranks
    assert reported[0][6] == reported[1][6]  # every request rank 0 pulled reached rank 1

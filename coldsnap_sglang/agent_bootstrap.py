"""coldsnap's agent in an SGLang scheduler process: attached once the target model's memory is complete
(weights placed by the load format — a speculative draft's after the target's —, KV cache allocated in
its region), with the graph hooks for a ``recreate`` graph policy.

SGLang runs the model inside each scheduler process (one per TP rank). At TP1 the agent attaches and
the graphs SGLang captured are kept (``retain``) or dropped and captured again after the restore
(``recreate``: ``ModelRunner.init_cuda_graphs`` from the restored runner's own plan, then, with
speculative decoding, the spec worker's ``init_cuda_graphs``: the draft's decode and draft-extend
graphs, as the scheduler's ``init_all_cuda_graphs`` captured them at start; both run on the
scheduler's own thread, :mod:`coldsnap_sglang.scheduler_thread`). The draft's KV cache is
allocated after the agent attached, in the same ``kv_cache`` region, so a release and a restore take
it along.

At TP > 1 every scheduler process runs an agent (rank and world from torch.distributed). The NCCL
communicators inside SGLang's groups are torn down before the CUDA checkpoint and rebuilt after it
(:mod:`coldsnap_sglang.distributed`); the graphs, which hold NCCL kernels, are dropped and recaptured
whatever the graph policy. Those steps, the graph work included, run on each rank's scheduler thread
right after the request broadcast that carries rank 0's marker for them
(:func:`coldsnap_sglang.scheduler_thread.in_lockstep`: the schedulers' gloo broadcasts and the steps'
own gloo calls share the TP group's gloo group, whose order must match on every rank). Pipeline and
data parallelism are not built: no agent attaches there (one warning), so a capture stops at its
readiness check instead of producing an image that cannot be restored.
"""

from __future__ import annotations

import gc
import logging
import threading
from typing import Any, Callable

from coldsnap_sglang.process import ProcessState
from coldsnap_sglang.scheduler_thread import in_lockstep, on_scheduler_thread

__all__ = ["after_alloc_memory_pool", "around_init_all_cuda_graphs", "flush_scheduler_cache", "SglangGraphs"]

log = logging.getLogger("sglang.coldsnap")

GRAPH_RUNNERS = ("decode_cuda_graph_runner", "prefill_cuda_graph_runner")  # a ModelRunner's
DRAFT_GRAPH_RUNNERS = ("cuda_graph_runner", "cuda_graph_runner_for_draft_extend")  # an EagleDraftWorker's


class SglangGraphs:
    """Release and recapture the CUDA graphs of the target ``ModelRunner`` and, with speculative
    decoding, of the draft (``spec_worker``: the scheduler's ``draft_worker``, read when asked)."""

    def __init__(self, runner: Any, spec_worker: Callable[[], Any] = lambda: None,
                 set_graph_pool: Callable[[], Callable[[Any], None]] = lambda: _graph_pool_setter(), world: int = 1):
        self.runner = runner
        self.spec_worker = spec_worker
        self.set_graph_pool = set_graph_pool
        self.world = world  # at TP > 1 the graphs hold NCCL kernels of communicators the snapshot ends

    def _holders(self) -> list[tuple[str, Any, tuple[str, ...]]]:
        """(label, object, graph-runner attributes) of every graph holder in this process."""
        holders: list[tuple[str, Any, tuple[str, ...]]] = [("", self.runner, GRAPH_RUNNERS)]
        spec = self.spec_worker()
        draft = getattr(spec, "draft_worker", None) if spec is not None else None
        if draft is not None and hasattr(draft, "draft_runner"):
            holders += [("draft.", draft, DRAFT_GRAPH_RUNNERS), ("draft.", draft.draft_runner, GRAPH_RUNNERS)]
        return holders

    def release_graphs(self, policy: str) -> list[str]:
        if policy == "retain" and self.world == 1:
            return []
        import torch

        spec = self.spec_worker()
        if getattr(spec, "adaptive_controller", None) is not None:
            # its runtime states hold every step size's graph runners, which init_cuda_graphs would register again
            raise RuntimeError("coldsnap: graph policy 'recreate' (and TP > 1, where graphs are always recaptured) does "
                               "not support SGLang's --speculative-adaptive; capture at TP 1 with graph policy 'retain'")
        set_graph_pool = self.set_graph_pool()  # before anything is dropped: without it, nothing could be recaptured
        released = []
        for label, holder, names in self._holders():
            for name in names:
                if getattr(holder, name, None) is not None:
                    setattr(holder, name, None)
                    released.append(label + name)
        gc.collect()  # the graphs' executables go with their runners
        # Every graph captured into SGLang's one process-wide pool, an id taken once; with all of them gone
        # its use count is 0, yet torch keeps it, and a capture joining it again fails torch's
        # `use_count > 0` assertion (CachingHostAllocator, H200, SGLang 0.5.17). The next capture takes a
        # fresh pool; what is still alive in the old one stays where it is.
        set_graph_pool(None)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return released

    def recapture_graphs(self) -> list[str]:
        """SGLang's own start-up capture, in its order (``Scheduler.init_all_cuda_graphs``): the target's
        graphs, then the spec worker's (the draft's)."""
        self.runner.init_cuda_graphs()
        spec = self.spec_worker()
        if spec is not None:
            spec.init_cuda_graphs()
        return [label + name for label, holder, names in self._holders() for name in names
                if getattr(holder, name, None) is not None]


def _graph_pool_setter() -> Callable[[Any], None]:
    """SGLang's ``set_global_graph_memory_pool``; a recreate cannot run without it."""
    from coldsnap_sglang import compat

    try:
        return compat.lookup(compat.GRAPH_POOL_SETTER)
    except LookupError as exc:
        raise RuntimeError(f"coldsnap: graph policy 'recreate' needs SGLang's {compat.GRAPH_POOL_SETTER} ({exc}); "
                           "capture with graph policy 'retain'") from None


def around_init_all_cuda_graphs(original: Callable[..., Any], scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """HookRegistry AROUND hook on ``Scheduler.init_all_cuda_graphs``: the scheduler noted (its
    ``draft_worker`` holds the draft's graphs), then SGLang's capture."""
    ProcessState.scheduler = scheduler
    return original(scheduler, *args, **kwargs)


def _spec_worker() -> Any:
    return getattr(ProcessState.scheduler, "draft_worker", None)


def flush_scheduler_cache() -> None:
    """Before the regions are released: SGLang's own ``/flush_cache`` (what its
    ``release_memory_occupation`` does). The KV cache comes back zeroed, so the prefix cache's tree, the
    request-to-token table and the KV allocator's free list must start empty too, else the first request
    after a restore would read a cached prefix from zeroed KV. Through the server, so that the scheduler
    flushes on its own thread: called from the agent's thread, ``Scheduler.flush_cache`` raced the
    scheduler's idle checks and killed it (H200, SGLang 0.5.17)."""
    import urllib.error
    import urllib.request

    args = ProcessState.runner.server_args
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    try:
        with urllib.request.urlopen(urllib.request.Request(f"http://{host}:{args.port}/flush_cache", method="POST"),
                                    timeout=60) as response:
            response.read()
    except (OSError, urllib.error.HTTPError) as exc:
        raise RuntimeError(f"coldsnap: SGLang's /flush_cache failed ({exc}); a restore would read cached prefixes "
                           "from zeroed KV") from None


def _attach(runner: Any) -> None:
    from coldsnap.agent import attach
    from coldsnap.agent.memory import ModelMemory
    from coldsnap.agent.placement import layout_for
    from coldsnap.agent.hooks import AgentHooks
    from coldsnap.memory import regions

    placed = ProcessState.placed
    assert placed is not None
    kv = regions().get("kv_cache")
    if kv is None or not kv.mapped_bytes:
        kv = None
        log.warning("coldsnap: SGLang allocated no KV cache in coldsnap's kv_cache region; it stays in ordinary memory "
                    "(and goes into a capture's process image)")
    else:
        log.info("coldsnap: KV cache in the kv_cache region: %d bytes at 0x%x", kv.mapped_bytes, kv.base)
    memory_regions = {"weights": placed.region, **({"kv_cache": kv} if kv is not None else {})}
    ProcessState.memory = ModelMemory(layout_for(placed, kv), memory_regions)
    ProcessState.runner = runner
    rank, world = _distributed_rank()
    graphs = SglangGraphs(runner, _spec_worker, world=world)
    graph_thread = on_scheduler_thread if world == 1 else in_lockstep

    def release_graphs(policy: str) -> list[str]:  # on the scheduler's thread, as SGLang captured them
        return [] if policy == "retain" and world == 1 else graph_thread(lambda: graphs.release_graphs(policy))

    hooks = AgentHooks(recovery_files=list(ProcessState.recovery_files), replay_weights=ProcessState.recovery,
                       recovery_plan=lambda: ProcessState.recovery_plan, release_graphs=release_graphs,
                       recapture_graphs=lambda: graph_thread(graphs.recapture_graphs),
                       before_release=[flush_scheduler_cache])
    collectives = None
    if world > 1:
        from coldsnap_sglang.distributed import SglangCollectives

        collectives = SglangCollectives(rank, world, step=in_lockstep)
    ProcessState.agent = attach(ProcessState.memory, serving_lock=threading.Lock(), rank=rank, world=world, hooks=hooks,
                                collectives=collectives)
    if ProcessState.agent is not None:
        log.info("coldsnap: agent of rank %d/%d listening at %s", rank, world, ProcessState.agent.control)


def _distributed_rank() -> tuple[int, int]:
    """This scheduler's global rank and the world size (0 of 1 without a process group)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def after_alloc_memory_pool(original: Callable[..., Any], runner: Any, *args: Any, **kwargs: Any) -> Any:
    """HookRegistry AROUND hook on ``ModelRunner.alloc_memory_pool``: SGLang's, then (for the target model
    the ``coldsnap`` load format placed) the agent attaches."""
    result = original(runner, *args, **kwargs)
    if (not ProcessState.active or ProcessState.placed is None or ProcessState.memory is not None
            or getattr(runner, "is_draft_worker", False)):
        return result
    server_args = getattr(runner, "server_args", None)
    pp_size = int(getattr(server_args, "pp_size", 1) or 1)
    dp_size = int(getattr(server_args, "dp_size", 1) or 1)
    if pp_size * dp_size > 1:
        log.warning("coldsnap: SGLang at PP %d / DP %d: coldsnap's NCCL teardown and rebuild covers tensor "
                    "parallelism only; no agent attaches, so `coldsnap capture` of this server stops at its readiness "
                    "check", pp_size, dp_size)
        return result
    if int(getattr(runner, "tp_size", 1) or 1) > 1 and not _tensor_parallel_surface():
        return result
    _attach(runner)
    return result


def _tensor_parallel_surface() -> bool:
    """Whether this SGLang has everything :mod:`coldsnap_sglang.distributed` rebuilds (else one warning)."""
    from coldsnap_sglang import compat

    missing = [symbol for symbol in compat.DISTRIBUTED_SURFACE if not compat.exists(symbol)]
    if missing:
        compat.disabled("capture at TP > 1", f"it lacks {', '.join(missing)}; no agent attaches, so `coldsnap "
                        "capture` of this server stops at its readiness check")
    return not missing

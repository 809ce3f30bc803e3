"""vLLM's NCCL state and CUDA graphs around a process snapshot, for TP > 1.

Written against vLLM 0.33's GPU code (``vllm/distributed/parallel_state.py``,
``device_communicators/{cuda_communicator,pynccl}.py``, the elastic-EP graph release in
``distributed/elastic_ep/elastic_execute.py``), with 0.26's differences through
:mod:`coldsnap_vllm.compat` and ``hasattr``: no distributed checkpoint hooks; the NCCL communicator
rebuilt with vLLM's own constructor, which mints and broadcasts the unique id over the group's gloo
group; Model Runner V2's graphs dropped by hand. Run at TP 2 on two H200s with vLLM 0.26 (below); the
0.33 path has not run on a GPU (0.33 pins torch 2.14, the GPU test host has 2.11). On vLLM's CPU build
the same object runs with nothing to tear down, and tests/unit/test_vllm_distributed.py drives the
sequencing with stand-ins for the GPU-only classes.

vLLM's parallel groups (``GroupCoordinator``: ``tp:0``, ``pp:0``, ...) each own a device communicator
whose ``pynccl_comm`` (a ``PyNcclCommunicator``) holds an NCCL communicator, beside IPC-based custom
all-reduce buffers. Rebuilding the groups themselves would give them new names (``tp:1``) that
compiled custom ops do not know (ENGINE-API-FACTS risk 4), so coldsnap keeps every group, its name
and its gloo ``cpu_group``, and replaces only the NCCL communicator inside it:

- ``teardown`` (agent ``prepare``, after the CUDA graphs were released): FlashInfer / all2all
  workspaces through vLLM's own ``checkpoint_prepare_distributed_state`` (0.27+); symmetric memory and
  custom all-reduce closed; every pynccl communicator and torch NCCL group aborted (details below).
- ``rebuild`` (agent ``resume``): torch's NCCL groups made again; per group, in name order, a new pynccl
  communicator: on 0.33 the group's rank 0 mints a unique id and publishes it through the activation's
  coordinator and every member builds ``PyNcclCommunicator.from_unique_id_bytes``, on 0.26 vLLM's
  constructor does the same over the gloo group (symmetric-memory ops registered again when enabled);
  symmetric memory and custom all-reduce made anew; then ``checkpoint_restore_distributed_state`` (0.27+).
- graphs: ``release_graphs`` drops vLLM's CUDA graphs as elastic EP does (they hold NCCL kernels of
  the communicator being destroyed, and ``ncclCommAbort`` can wait for graphs that captured it);
  ``recapture_graphs`` runs the model runner's ``capture_model`` on the rebuilt communicators.

Both ``retain`` and ``recreate`` recapture at TP > 1: stock NCCL cannot rebuild a communicator in
place, so a retained graph would replay kernels of a destroyed one.

What vLLM 0.26 at TP 2 on two H200s showed (``benchmarks/results/2026-11-30-vllm-h200x2-tp2/``): the CUDA checkpoint
API of driver 580 restores a process only once every cross-process GPU mapping is gone; it refuses a live
NCCL communicator and a rendezvoused torch symmetric-memory buffer (``CUDA_ERROR_NOT_SUPPORTED``) and an
open legacy CUDA IPC mapping (``CUDA_ERROR_INVALID_VALUE``), as ``tests/gpu/cuda_checkpoint_limits.py``
shows on bare torch processes. vLLM's workers hold all three, and the teardown ends each:

- **pynccl**, aborted here and waited for: vLLM's own ``destroy`` gives up after 5 s because the abort
  blocks while a CUDA graph holds the communicator's kernels, and Model Runner V2's piecewise graphs
  live in ``CUDAGraphWrapper`` instances inside the compiled model; ``release_graphs`` clears every
  wrapper first, and the capture fails if an abort does not return.
- **torch's NCCL process groups**: every ``GroupCoordinator`` has a ``device_group`` (a
  ``ProcessGroupNCCL``, used beside pynccl for ``gather``, ``broadcast``, the base all-gather). They
  are aborted with the default group's NCCL backend, and the rebuild makes each ``device_group`` again
  with ``new_group(..., use_local_synchronization=True)`` over the default group's store, which the
  snapshot carries (its TCP connections are restored established).
- **custom all-reduce**: ``CustomAllreduce.close()`` never unmaps the peers' buffers it opened with
  ``cudaIpcOpenMemHandle``; the teardown unmaps them, and the rebuild makes a new one over the gloo
  group, so restored ranks all-reduce as before.
- **symmetric memory**: ``SymmMemCommunicator`` rendezvouses its buffer before it checks for NVLS
  multicast, and keeps it when it then disables itself (the H200 pair has no multicast); the buffer is
  dropped, and an enabled communicator is made anew at rebuild.

Graphs recaptured after the rebuild go to a fresh pool (:func:`coldsnap_vllm.compat.move_graphs_to_a_fresh_pool`).
With all of it, capture and two restores at TP 2 gave vLLM's own TP 2 tokens. Not handled: FlashInfer
all-reduce workspaces (0.27+ release them through ``checkpoint_prepare_distributed_state``; on 0.26 they
exist only with the all-reduce fusion, which the H200 pair needs off), pipeline parallelism across hosts.
"""

from __future__ import annotations

import functools
import gc
import logging
from typing import Any, Callable, Iterable

from coldsnap.collective.group import Rendezvous, between_barriers, share_unique_id
from coldsnap.collective.torch_groups import (NcclTeardownError, abort_communicator, abort_torch_nccl_groups,
                                              close_ipc_all_reduce, remake_torch_nccl_groups, torch_nccl_groups)
from coldsnap.memory import engine_graph_pool
from coldsnap_vllm.compat import (clear_every_graph_wrapper, move_graphs_to_a_fresh_pool,
                                  release_model_runner_v2_graphs)

__all__ = ["VllmCollectives", "VllmGraphs", "VllmTeardownError", "vllm_groups"]

log = logging.getLogger("vllm.coldsnap")  # under vLLM's logger: the lines show in the engine's log

ABORT_TIMEOUT_S = 30.0
"""How long one ``ncclCommAbort`` may take once no graph holds the communicator (it returns in
milliseconds then); longer means something still does, and the snapshot would carry the communicator."""

VllmTeardownError = NcclTeardownError
"""vLLM's NCCL state could not be ended before the snapshot (the capture fails rather than keep it)."""


def vllm_groups() -> list[Any]:
    """vLLM's live parallel groups, by unique name (the same order on every rank)."""
    from vllm.distributed import parallel_state

    groups = [(name, ref()) for name, ref in parallel_state._groups.items()]
    return [group for name, group in sorted(groups, key=lambda item: item[0]) if group is not None]


def _names(groups: Iterable[Any]) -> list[str]:
    return [group.unique_name for group in groups]


def _pynccl(group: Any) -> Any:
    communicator = getattr(group, "device_communicator", None)
    return getattr(communicator, "pynccl_comm", None)


def _new_unique_id(pynccl: Any) -> bytes:
    """A fresh NCCL unique id from the library of vLLM's (old) communicator."""
    return bytes(pynccl.nccl.ncclGetUniqueId().internal)


def _abort_pynccl(pynccl: Any, name: str) -> float:
    """``ncclCommAbort`` of a ``PyNcclCommunicator``, waited for (vLLM's own ``destroy`` gives up after 5 s
    and leaves the abort running); marks it disabled as ``destroy`` does. Returns the seconds it took."""
    index = getattr(getattr(pynccl, "device", None), "index", None)
    seconds = abort_communicator(lambda: pynccl.nccl.ncclCommAbort(pynccl.comm), name, index, ABORT_TIMEOUT_S)
    pynccl.available = False
    pynccl.disabled = True
    return seconds


def _device_index(communicator: Any) -> int:
    device = getattr(communicator, "device", None)
    return getattr(device, "index", None) or 0


def _reopen_custom_all_reduce(closed: Any, communicator: Any) -> Any:
    """A new ``CustomAllreduce`` like the closed one, over the group's gloo group (its constructor
    exchanges fresh IPC handles there), so restored ranks all-reduce as fast as before the snapshot."""
    import inspect

    cls = type(closed)
    options: dict[str, Any] = {"max_size": closed.max_size}
    if "symm_mem_enabled" in inspect.signature(cls.__init__).parameters:
        symm_mem = getattr(communicator, "symm_mem_comm", None)
        options["symm_mem_enabled"] = symm_mem is not None and not symm_mem.disabled
    return cls(group=communicator.cpu_group, device=communicator.device, **options)


def _call_if_present(module: Any, name: str) -> None:
    function = getattr(module, name, None)
    if function is not None:
        function()


class VllmCollectives:
    """The agent's ``collectives`` for a vLLM worker: teardown/rebuild of every group's NCCL."""

    def __init__(self, rank: int, world: int, groups: Callable[[], Iterable[Any]] = vllm_groups,
                 communicator_class: Callable[[], Any] | None = None, state: Any = None):
        self.rank = rank
        self.world = world
        self._groups = groups
        self._communicator_class = communicator_class  # PyNcclCommunicator (injectable for the CPU tests)
        self._state = state  # vllm.distributed.parallel_state (injectable likewise)
        self.torn_down: list[Any] = []  # groups whose pynccl was destroyed, in name order
        self.process_groups_aborted: list[Any] = []  # groups whose torch NCCL device_group was aborted
        self.custom_all_reduce: dict[str, Any] = {}  # group name -> its closed CustomAllreduce, made anew at rebuild
        self.symmetric_memory: dict[str, tuple[Any, bool]] = {}  # group name -> (SymmMemCommunicator class, enabled)
        self.generation = 0

    def _parallel_state(self) -> Any:
        if self._state is None:
            from vllm.distributed import parallel_state

            self._state = parallel_state
        return self._state

    def _new_communicator(self) -> Any:
        if self._communicator_class is None:
            from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator

            self._communicator_class = PyNcclCommunicator
        return self._communicator_class

    def teardown(self, rendezvous: Rendezvous, seconds: dict[str, float], timeout: float = 120.0) -> None:
        def release() -> None:
            groups = list(self._groups())
            live = [g for g in groups if (p := _pynccl(g)) is not None and not p.disabled]
            torch_nccl = torch_nccl_groups(groups)
            if not live and not torch_nccl:
                return  # vLLM's CPU build: gloo and shared memory, which the snapshot carries
            _call_if_present(self._parallel_state(), "checkpoint_prepare_distributed_state")  # 0.27+
            released = self._release_symmetric_memory(groups)
            for group in live:
                communicator = group.device_communicator
                custom = getattr(communicator, "ca_comm", None)
                if custom is not None and close_ipc_all_reduce(custom, _device_index(communicator)):
                    self.custom_all_reduce[group.unique_name] = custom
                communicator.ca_comm = None
                seconds[f"abort_{group.unique_name}"] = _abort_pynccl(communicator.pynccl_comm, group.unique_name)
            abort_torch_nccl_groups(torch_nccl)
            self.torn_down = live
            self.process_groups_aborted = torch_nccl
            log.info("coldsnap: NCCL torn down: pynccl %s, custom all-reduce %s, symmetric memory %s, torch groups %s",
                     _names(live), sorted(self.custom_all_reduce), released, _names(torch_nccl))

        between_barriers(rendezvous, seconds, "teardown", ("vllm.teardown", "vllm.torn_down"), timeout, release)

    def rebuild(self, rendezvous: Rendezvous, seconds: dict[str, float], timeout: float = 300.0) -> None:
        def connect() -> None:
            self.generation += 1
            self._new_process_groups()
            if not self.torn_down:
                return
            cls = self._new_communicator()
            for group in self.torn_down:
                old = group.device_communicator.pynccl_comm
                device = group.device_communicator.device
                if hasattr(cls, "from_unique_id_bytes"):  # 0.33: the id goes through coldsnap's coordinator
                    unique_id = share_unique_id(rendezvous, f"vllm/{group.unique_name}/{self.generation}/unique_id",
                                                group.rank_in_group == 0, functools.partial(_new_unique_id, old),
                                                timeout)
                    new = cls.from_unique_id_bytes(unique_id, group.rank_in_group, group.world_size, device)
                    new.group = old.group  # what vLLM's own constructor records
                else:  # 0.26: the constructor mints the id on the group's rank 0 and broadcasts it over gloo
                    new = cls(group=old.group, device=device)
                group.device_communicator.pynccl_comm = new
                self._register_symmetric_ops(new)
                self._reopen_symmetric_memory(group)
                closed = self.custom_all_reduce.pop(group.unique_name, None)
                if closed is not None:
                    group.device_communicator.ca_comm = _reopen_custom_all_reduce(closed, group.device_communicator)
            _call_if_present(self._parallel_state(), "checkpoint_restore_distributed_state")  # 0.27+
            self.torn_down = []

        between_barriers(rendezvous, seconds, "rebuild", ("vllm.rebuild", "vllm.rebuilt"), timeout, connect)

    def _release_symmetric_memory(self, groups: list[Any]) -> list[str]:
        """Drop each group's ``SymmMemCommunicator`` with its buffer, rendezvoused with the peers' (their
        memory mapped here through CUDA IPC; the checkpoint API of driver 580 refuses a process holding
        it: ``CUDA_ERROR_NOT_SUPPORTED`` at restore). vLLM keeps the buffer even when it then disables the
        communicator for want of NVLS multicast, as on the H200 pair; an enabled one is made anew at rebuild."""
        released = []
        for group in groups:
            communicator = getattr(group, "device_communicator", None)
            symmetric = getattr(communicator, "symm_mem_comm", None)
            if communicator is None or symmetric is None or getattr(symmetric, "buffer", None) is None:
                continue
            self.symmetric_memory[group.unique_name] = (type(symmetric), not symmetric.disabled)
            communicator.symm_mem_comm = None
            released.append(group.unique_name)
        if released:
            del symmetric
            gc.collect()  # the buffer's storage and the rendezvous handle go now, and with them the mappings
        return released

    def _reopen_symmetric_memory(self, group: Any) -> None:
        cls, enabled = self.symmetric_memory.pop(group.unique_name, (None, False))
        if enabled:  # a disabled one stays None, which vLLM treats alike
            communicator = group.device_communicator
            communicator.symm_mem_comm = cls(group=communicator.cpu_group, device=communicator.device)

    def _new_process_groups(self) -> None:
        """Each aborted group's torch ``device_group`` made again, in name order, by its members only."""
        if not self.process_groups_aborted:
            return
        remake_torch_nccl_groups(self.process_groups_aborted, self.generation)
        for group in self.process_groups_aborted:  # vLLM's device communicator keeps its own reference
            communicator = getattr(group, "device_communicator", None)
            if communicator is not None and hasattr(communicator, "device_group"):
                communicator.device_group = group.device_group
        self.process_groups_aborted = []

    @staticmethod
    def _register_symmetric_ops(communicator: Any) -> None:
        try:
            from vllm.distributed.device_communicators.pynccl import register_nccl_symmetric_ops
            from vllm.distributed.device_communicators.pynccl_allocator import is_symmetric_memory_enabled
        except ImportError:  # a vLLM without symmetric memory
            return
        if is_symmetric_memory_enabled():
            register_nccl_symmetric_ops(communicator)


class VllmGraphs:
    """The agent's graph hooks for a vLLM model runner (see the module docstring)."""

    def __init__(self, runner: Any, world: int, graph_region: Any = None):
        self.runner = runner
        self.world = world
        self.graph_region = graph_region  # the cudagraph region the graphs' pool lives in (None: torch's own)

    def _graphs_exist(self) -> bool:
        runner = self.runner
        if getattr(runner, "cudagraph_manager", None) is not None:
            return True
        from vllm.compilation.cuda_graph import CUDAGraphWrapper

        return isinstance(getattr(runner, "model", None), CUDAGraphWrapper)

    def release_graphs(self, policy: str) -> list[str]:
        """Drop vLLM's CUDA graphs unless ``retain`` holds and no NCCL kernel is in them (TP = 1)."""
        import torch

        if not torch.cuda.is_available() or not self._graphs_exist() or (policy == "retain" and self.world == 1):
            return []
        from vllm.compilation.cuda_graph import CUDAGraphWrapper
        from vllm.compilation.wrapper import reset_compile_wrapper
        from vllm.config import set_current_vllm_config

        runner = self.runner
        manager = getattr(runner, "cudagraph_manager", None)
        if manager is not None:  # Model Runner V2 captures through its CudaGraphManager
            release_model_runner_v2_graphs(manager)
        elif isinstance(runner.model, CUDAGraphWrapper):
            runner.model.concrete_cudagraph_entries = {}
        clear_every_graph_wrapper()  # piecewise graphs live in wrappers inside the compiled model
        # (a fresh pool in the same region where it served the released graphs)
        move_graphs_to_a_fresh_pool(manager, None if self.graph_region is None else engine_graph_pool(fresh=True))
        torch.compiler.reset()
        with set_current_vllm_config(runner.vllm_config):
            reset_compile_wrapper(runner.get_model())
        gc.collect()
        torch.accelerator.synchronize()
        torch.accelerator.empty_cache()
        return ["model"]

    def recapture_graphs(self) -> list[str]:
        import torch
        from vllm.config import set_current_vllm_config

        with torch.cuda.device(self.runner.device), set_current_vllm_config(self.runner.vllm_config):
            self.runner.capture_model()
        return ["model"]

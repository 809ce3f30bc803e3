"""SGLang's NCCL state around a process snapshot, for TP > 1: torn down inside its groups, rebuilt after.

Written against SGLang 0.5.17's ``sglang/srt/distributed/parallel_state.py`` and
``device_communicators/{pynccl,custom_all_reduce,custom_all_reduce_v2,torch_symm_mem}.py`` (0.5.23: the
same constructors and attributes, plus ``pcie_ipc_comm``). Not run on two GPUs yet: the CPU tests
(``tests/unit/test_sglang_distributed.py``) drive the sequence with stand-ins for the GPU-only classes,
and ``tests/integration/test_sglang_hooks.py`` checks the constructors and attributes used here against
SGLang's real modules.

Every scheduler process (one per TP rank) runs an agent. SGLang's parallel groups (``GroupCoordinator``:
``tp``, ``pp``, ``moe_ep``, ...; ``parallel_state._groups``, by unique name) each keep a gloo
``cpu_group``, a torch NCCL ``device_group`` and, at world size > 1, communicators of their own. Custom
ops find a group by its unique name, so coldsnap keeps every group, its name and its gloo group, and
replaces only what holds NCCL or peers' GPU memory:

- **pynccl** (``PyNcclCommunicator``): SGLang toggles its ``disabled`` flag in place (``change_state``:
  enabled only inside graph capture and some forwards), so a live one is one that is ``available`` with
  a ``comm``, whatever ``disabled`` says now. Its wrapper binds no ``ncclCommAbort``; coldsnap calls it
  from the same library (the communicator may still be referenced by CUDA graphs being dropped, and
  ``ncclCommDestroy`` would wait on them), waited for on a thread. Rebuilt with SGLang's own
  constructor over the group's gloo group (its rank 0 mints the unique id and broadcasts it there), which
  leaves it ``disabled`` as at start-up.
- **custom all-reduce**: the legacy ``CustomAllreduce`` (CUDA IPC; the same class as vLLM's, whose
  ``close`` never unmaps the peers' buffers: coldsnap does) or ``CustomAllReduceV2`` (0.5.17's default on
  CUDA: a torch symmetric-memory workspace and IPC-mapped graph inputs; its ``close`` ends the IPC
  mappings, and dropping the object frees the workspace). Made anew after the restore with SGLang's
  own call, ``cls(group=cpu_group, device=device)``.
- **torch symmetric memory** (``TorchSymmMemCommunicator``, ``--enable-torch-symm-mem``): its
  rendezvoused buffer is dropped and an enabled communicator made anew.
- **torch's NCCL process groups**: every ``device_group`` is aborted, with the default group's NCCL
  backend, and made again over the default group's store (which the snapshot carries).

Refused with a message, before anything is torn down: MSCCL++ (``--enable-mscclpp``), NCCL symmetric
memory (``--enable-symm-mem``: window registrations in SGLang's pool), AMD's quick all-reduce and 0.5.23's
FlashInfer PCIe IPC all-reduce — each holds peers' memory coldsnap does not yet release and rebuild.

Graphs hold NCCL kernels of the communicators being destroyed, so at TP > 1 they are dropped before the
teardown and captured again after the rebuild whatever the graph policy
(:class:`coldsnap_sglang.agent_bootstrap.SglangGraphs`).

In a scheduler process the teardown and the rebuild run as lockstep steps on its thread
(``step=``:func:`coldsnap_sglang.scheduler_thread.in_lockstep`): their gloo calls use the group the
scheduler loops broadcast their requests on.
"""

from __future__ import annotations

import ctypes
import gc
import logging
from typing import Any, Callable, Iterable

from coldsnap.collective.group import Rendezvous, between_barriers
from coldsnap.collective.torch_groups import (NcclTeardownError, abort_communicator, abort_torch_nccl_groups,
                                              close_ipc_all_reduce, on_device, remake_torch_nccl_groups,
                                              torch_nccl_groups)
from coldsnap_sglang import compat

__all__ = ["ABORT_TIMEOUT_S", "SglangCollectives", "UNSUPPORTED_COMMUNICATORS", "sglang_groups"]

log = logging.getLogger("sglang.coldsnap")  # under SGLang's logger: the lines show in the engine's log

ABORT_TIMEOUT_S = 30.0
"""How long one ``ncclCommAbort`` may take once no graph holds the communicator (milliseconds then)."""

UNSUPPORTED_COMMUNICATORS = {
    "pymscclpp_comm": "MSCCL++ all-reduce (--enable-mscclpp)",
    "qr_comm": "quick all-reduce (ROCm)",
    "pcie_ipc_comm": "FlashInfer PCIe IPC all-reduce",
}
"""A group's communicators that hold peers' memory coldsnap cannot yet release and rebuild: their flag."""


def sglang_groups() -> list[Any]:
    """SGLang's live parallel groups, by unique name (the same order on every rank)."""
    groups = [(name, ref()) for name, ref in compat.lookup(compat.PARALLEL_GROUPS).items()]
    return [group for name, group in sorted(groups, key=lambda item: item[0]) if group is not None]


def _symmetric_memory_enabled() -> bool:
    """SGLang's NCCL symmetric memory (``--enable-symm-mem``)."""
    return bool(compat.lookup(compat.SYMMETRIC_MEMORY_ENABLED)())


def _live_pynccl(group: Any) -> Any:
    """The group's ``PyNcclCommunicator`` when it holds an NCCL communicator (``disabled`` aside: SGLang
    toggles it in place), else None."""
    pynccl = getattr(group, "pynccl_comm", None)
    if pynccl is None or not getattr(pynccl, "available", False) or getattr(pynccl, "comm", None) is None:
        return None
    return pynccl


def _abort_call(pynccl: Any) -> Callable[[], None]:
    """``ncclCommAbort(pynccl.comm)`` from the library SGLang's communicator loaded (its wrapper binds
    ``ncclCommDestroy`` only, which would wait for graphs still holding the communicator)."""
    library = pynccl.nccl
    abort = library.lib.ncclCommAbort
    abort.restype, abort.argtypes = ctypes.c_int, [ctypes.c_void_p]

    def call() -> None:
        result = abort(pynccl.comm)
        if result != 0:
            raise RuntimeError(f"NCCL error {result}: {library.ncclGetErrorString(result)}")

    return call


def _device_index(group: Any) -> int:
    return getattr(getattr(group, "device", None), "index", None) or 0


def _close_custom_all_reduce(custom: Any, device: int) -> bool:
    """Close the group's custom all-reduce, legacy or v2, with every peer mapping it made; True if it was open."""
    if hasattr(custom, "meta_ptrs"):  # the legacy CUDA IPC one: SGLang toggles `disabled` around graphs
        custom.disabled = getattr(custom, "original_disabled", custom.disabled)
        return close_ipc_all_reduce(custom, device)
    if getattr(custom, "disabled", True):
        return False
    custom.close()  # v2: the IPC-mapped graph inputs unmapped, the kernel object dropped (a barrier on gloo)
    return True


class SglangCollectives:
    """The agent's ``collectives`` for an SGLang scheduler process at TP > 1 (see the module docstring)."""

    def __init__(self, rank: int, world: int, groups: Callable[[], Iterable[Any]] = sglang_groups,
                 communicator_class: Callable[[], Any] | None = None,
                 symmetric_memory_enabled: Callable[[], bool] = _symmetric_memory_enabled,
                 step: Callable[[Callable[[], None]], None] = lambda work: work()):
        self.rank = rank
        self.world = world
        self._groups = groups
        self._communicator_class = communicator_class  # PyNcclCommunicator (injectable for the CPU tests)
        self._symmetric_memory_enabled = symmetric_memory_enabled
        # where the teardown and the rebuild run: in a scheduler process, its thread, in lockstep with the
        # other ranks' (coldsnap_sglang.scheduler_thread.in_lockstep: they use the TP group's gloo group)
        self._step = step
        self.torn_down: list[Any] = []  # groups whose pynccl was aborted, in name order
        self.process_groups_aborted: list[Any] = []  # groups whose torch NCCL device_group was aborted
        self.custom_all_reduce: list[tuple[Any, type]] = []  # (group, the class of its closed custom all-reduce)
        self.symmetric_memory: list[tuple[Any, type]] = []  # (group, the class of its dropped TorchSymmMemCommunicator)
        self.generation = 0

    def _new_communicator(self) -> Any:
        if self._communicator_class is None:
            self._communicator_class = compat.lookup(compat.PYNCCL)
        return self._communicator_class

    def refused(self, groups: list[Any]) -> str | None:
        """Why this process's collectives cannot go through a snapshot, or None."""
        if self._symmetric_memory_enabled():
            return "NCCL symmetric memory (--enable-symm-mem)"
        for group in groups:
            for attribute, what in UNSUPPORTED_COMMUNICATORS.items():
                communicator = getattr(group, attribute, None)
                if communicator is not None and not getattr(communicator, "disabled", False):
                    return f"{what} in group {group.unique_name}"
        return None

    def teardown(self, rendezvous: Rendezvous, seconds: dict[str, float], timeout: float = 120.0) -> None:
        def release() -> None:
            groups = list(self._groups())
            refused = self.refused(groups)
            if refused is not None:
                raise NcclTeardownError(f"coldsnap cannot yet snapshot SGLang with {refused}: start SGLang without it")
            live = [g for g in groups if _live_pynccl(g) is not None]
            torch_nccl = torch_nccl_groups(groups)
            if not live and not torch_nccl:
                return  # gloo only (a CPU group), which the snapshot carries
            symmetric = self._release_symmetric_memory(groups)
            for group in groups:
                custom = getattr(group, "ca_comm", None)
                with on_device(_device_index(group)):  # its frees and unmaps on the group's GPU
                    closed = custom is not None and _close_custom_all_reduce(custom, _device_index(group))
                if closed:
                    self.custom_all_reduce.append((group, type(custom)))
                    group.ca_comm = None
            custom = None
            if self.custom_all_reduce or symmetric:
                gc.collect()  # v2 workspaces and symmetric buffers go now, and with them the peers' mappings
            for group in live:
                pynccl = group.pynccl_comm
                seconds[f"abort_{group.unique_name}"] = abort_communicator(
                    _abort_call(pynccl), group.unique_name, _device_index(group), ABORT_TIMEOUT_S)
                pynccl.available = False
                pynccl.disabled = True
                pynccl.comm = None
            abort_torch_nccl_groups(torch_nccl)
            self.torn_down = live
            self.process_groups_aborted = torch_nccl
            log.info("coldsnap: NCCL torn down: pynccl %s, custom all-reduce %s, torch symmetric memory %s, "
                     "torch groups %s", _names(live), _names(g for g, _ in self.custom_all_reduce), symmetric,
                     _names(torch_nccl))

        between_barriers(rendezvous, seconds, "teardown", ("sglang.teardown", "sglang.torn_down"), timeout,
                         lambda: self._step(release))

    def rebuild(self, rendezvous: Rendezvous, seconds: dict[str, float], timeout: float = 300.0) -> None:
        def connect() -> None:
            self.generation += 1
            remake_torch_nccl_groups(self.process_groups_aborted, self.generation)
            self.process_groups_aborted = []
            cls = self._new_communicator()
            # SGLang's own constructors, on the group's GPU: the agent's thread starts on device 0, and
            # the legacy custom all-reduce allocates its IPC buffers with cudaMalloc on the current device
            for group in self.torn_down:
                with on_device(_device_index(group)):
                    group.pynccl_comm = cls(group=group.cpu_group, device=group.device, is_symmetric_memory_enabled=False)
            self.torn_down = []
            for group, made in self.custom_all_reduce:
                with on_device(_device_index(group)):
                    group.ca_comm = made(group=group.cpu_group, device=group.device)
            for group, made in self.symmetric_memory:
                with on_device(_device_index(group)):
                    group.torch_symm_mem_comm = made(group=group.cpu_group, device=group.device)
            self.custom_all_reduce, self.symmetric_memory = [], []

        between_barriers(rendezvous, seconds, "rebuild", ("sglang.rebuild", "sglang.rebuilt"), timeout,
                         lambda: self._step(connect))

    def _release_symmetric_memory(self, groups: list[Any]) -> list[str]:
        """Drop each group's enabled ``TorchSymmMemCommunicator`` with its rendezvoused buffer (peers' memory
        mapped here; the checkpoint API of driver 580 refuses it). A disabled one holds no buffer."""
        released = []
        for group in groups:
            symmetric = getattr(group, "torch_symm_mem_comm", None)
            if symmetric is None or getattr(symmetric, "buffer", None) is None:
                continue
            self.symmetric_memory.append((group, type(symmetric)))
            group.torch_symm_mem_comm = None
            released.append(group.unique_name)
        return released


def _names(groups: Iterable[Any]) -> list[str]:
    return [group.unique_name for group in groups]

"""What an engine's torch-based parallel groups hold that a process snapshot cannot carry, and how to end it.

vLLM and SGLang organize tensor parallelism alike (SGLang's ``parallel_state`` began as vLLM's): each
``GroupCoordinator`` keeps a gloo ``cpu_group`` and a torch NCCL ``device_group``, and beside them an
NCCL communicator of the engine's own (``PyNcclCommunicator``, over ``ctypes``) and an IPC-based custom
all-reduce. The CUDA checkpoint API of driver 580 restores a process only once every cross-process GPU
mapping is gone (``tests/gpu/cuda_checkpoint_limits.py``), so the engines' collectives modules
(``coldsnap_vllm.distributed``, ``coldsnap_sglang.distributed``) end all of it with these helpers before
the checkpoint and build it again after the restore. Nothing here imports an engine; torch is imported
when a helper runs.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Callable

__all__ = ["NcclTeardownError", "abort_communicator", "abort_default_nccl_backend", "abort_torch_nccl_groups",
           "close_ipc_all_reduce", "nccl_process_group", "new_nccl_process_group", "on_device", "remake_torch_nccl_groups",
           "torch_nccl_groups"]


class NcclTeardownError(RuntimeError):
    """An engine's NCCL state could not be ended before the snapshot (the capture fails rather than keep it)."""

    failure_code = "agent.collectives"  # how the agent reports it to the launcher (coldsnap.agent.protocol)


def on_device(index: int | None) -> Any:
    """``torch.cuda.device(index)``, or nothing where there is no index or no CUDA."""
    import torch

    if index is None or not torch.cuda.is_available():
        return contextlib.nullcontext()
    return torch.cuda.device(index)


def abort_communicator(abort: Callable[[], None], name: str, device_index: int | None, timeout: float) -> float:
    """``abort()`` (an ``ncclCommAbort``) on the communicator's device, waited for at most ``timeout``
    seconds on a thread of its own: an abort blocks while a CUDA graph still holds the communicator's
    kernels, and a snapshot then would carry the communicator. Returns the seconds it took."""
    finished = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            with on_device(device_index):
                abort()
        except BaseException as exc:  # noqa: BLE001 - reported below, in the calling thread
            failure.append(exc)
        finally:
            finished.set()

    started = time.perf_counter()
    threading.Thread(target=run, name=f"coldsnap-nccl-abort-{name}", daemon=True).start()
    if not finished.wait(timeout):
        raise NcclTeardownError(f"group {name}: ncclCommAbort did not return within {timeout:.0f} s; a CUDA graph "
                                "still holds the communicator's kernels, and a snapshot now would carry it")
    if failure:
        raise NcclTeardownError(f"group {name}: ncclCommAbort failed: {failure[0]}") from failure[0]
    return time.perf_counter() - started


def close_ipc_all_reduce(custom: Any, device: int) -> bool:
    """Close an engine's CUDA-IPC custom all-reduce (vLLM's ``CustomAllreduce``, SGLang's legacy one: the
    same class) and unmap the peers' buffers it mapped; True if it was open.

    Its ``close()`` frees this rank's meta and data buffers and (the C++ ``dispose``) the graph buffers'
    IPC mappings, but never unmaps the peers' meta and data buffers it opened with
    ``cudaIpcOpenMemHandle``; the checkpoint API of driver 580 refuses to restore a process that held
    such a mapping at checkpoint."""
    if getattr(custom, "disabled", True) or not getattr(custom, "_ptr", 0):
        return False
    from coldsnap.native import native

    peers = [pointer for pointers in (custom.meta_ptrs, custom.buffer_ptrs)
             for rank, pointer in enumerate(pointers) if rank != custom.rank]
    custom.close()
    for pointer in peers:
        native().close_ipc_mapping(pointer, device)
    return True


def nccl_process_group(process_group: Any) -> Any:
    """``process_group`` (a group's torch ``device_group``) when NCCL backs it, else None."""
    if process_group is None:
        return None
    import torch.distributed as dist

    try:
        return process_group if dist.get_backend(process_group) == "nccl" else None
    except (RuntimeError, ValueError):  # not a registered group (a stand-in, or already destroyed)
        return None


def abort_default_nccl_backend() -> None:
    """Abort the NCCL backend of torch's default group; the group and its store stay (``new_group``
    needs them). Neither engine makes a collective on the default group after start-up."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_backend() != "nccl":
        return
    try:
        backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cuda"))
    except RuntimeError:
        return
    backend.abort()


def new_nccl_process_group(ranks: list[int], description: str) -> Any:
    """A torch NCCL process group of ``ranks`` made again after a restore, by its members only (over the
    default group's store, which the snapshot carries: its TCP connections are restored established)."""
    import torch.distributed as dist

    return dist.new_group(list(ranks), backend="nccl", use_local_synchronization=True, group_desc=description)


def torch_nccl_groups(groups: list[Any]) -> list[Any]:
    """The engine groups (``GroupCoordinator``s) whose torch ``device_group`` NCCL backs."""
    return [group for group in groups if nccl_process_group(getattr(group, "device_group", None)) is not None]


def abort_torch_nccl_groups(groups: list[Any]) -> None:
    """Abort each group's torch NCCL ``device_group`` (the group object stays, and is made anew by
    :func:`remake_torch_nccl_groups`), then the default group's NCCL backend."""
    for group in groups:
        group.device_group.abort()
    if groups:
        abort_default_nccl_backend()


def remake_torch_nccl_groups(groups: list[Any], generation: int) -> None:
    """Each aborted group's ``device_group`` made again, in the order given (name order: the same on every rank)."""
    for group in groups:
        group.device_group = new_nccl_process_group(group.ranks, f"{group.unique_name}:device:coldsnap{generation}")

"""NCCL communicators through ``coldsnap._C`` (libnccl dlopen'd at run time: the one torch loaded)."""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coldsnap.collective.base import CollectiveError
from coldsnap.native import native

__all__ = ["NcclBackend", "NcclCommunicator", "nccl_library"]

_DTYPES = {"float16": "float16", "bfloat16": "bfloat16", "float32": "float32", "float64": "float64",
           "int32": "int32", "int64": "int64", "uint8": "uint8", "int8": "int8"}


def nccl_library() -> str:
    """Path of the NCCL this process should use: the one already mapped (torch links it), else the
    ``nvidia-nccl`` wheel's, else the loader's ``libnccl.so.2``."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rstrip("\n").split(None, 5)[-1] if line.count(" ") >= 5 else ""
                if "/libnccl.so" in path:
                    return path
    except OSError:
        pass
    spec = importlib.util.find_spec("nvidia.nccl") if importlib.util.find_spec("nvidia") else None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        for candidate in sorted(Path(folder, "lib").glob("libnccl.so*")):
            return str(candidate)
    return ""


@dataclass
class NcclCommunicator:
    handle: int
    rank: int
    world: int
    device: int
    closed: bool = field(default=False)

    def all_reduce(self, tensor: Any) -> None:
        torch = sys.modules["torch"]  # tensors come from the caller's torch; never imported here
        dtype = _DTYPES.get(str(tensor.dtype).removeprefix("torch."))
        if dtype is None or not tensor.is_contiguous():
            raise CollectiveError(f"NCCL all-reduce needs a contiguous tensor of {sorted(_DTYPES)}, not {tensor.dtype}")
        stream = torch.cuda.current_stream(tensor.device).cuda_stream
        C = native()
        try:
            C.nccl_all_reduce(self.handle, tensor.data_ptr(), tensor.data_ptr(), tensor.numel(), dtype, "sum", stream)
        except C.NcclError as exc:
            raise CollectiveError(f"rank {self.rank}: {exc}") from None

    def close(self) -> None:
        if self.closed:
            return
        C = native()
        try:
            C.nccl_comm_finalize(self.handle)
            C.nccl_comm_destroy(self.handle)
        except C.NcclError as exc:
            raise CollectiveError(f"rank {self.rank}: closing the NCCL communicator failed: {exc}") from None
        finally:
            self.closed = True

    def abort(self) -> None:
        if not self.closed:
            self.closed = True
            C = native()
            try:
                C.nccl_comm_abort(self.handle)
            except C.NcclError:
                pass  # already failing; abort is best effort by definition


class NcclBackend:
    """NCCL on one GPU per rank. ``library`` defaults to :func:`nccl_library`; the version is checked
    at load (``coldsnap._C.NCCL_MINIMUM_VERSION``)."""

    name = "nccl"

    def __init__(self, device: int, library: str | None = None):
        self.device = device
        # NCCL's RAS service (2.24+) keeps a thread and TCP connections between the ranks' processes
        # that outlive every communicator: a snapshot would carry connections to peers that a restore
        # replaces. Off unless the operator asked for it (NCCL reads this at its first init).
        os.environ.setdefault("NCCL_RAS_ENABLE", "0")
        C = native()
        try:
            self.loaded = C.nccl_load(nccl_library() if library is None else library)
        except C.NcclError as exc:
            raise CollectiveError(str(exc)) from None

    def relocate(self, address: str) -> None:
        """NCCL's unique id names the interface NCCL picks when it is made: nothing to move."""

    def create_unique_id(self) -> bytes:
        C = native()
        try:
            return C.nccl_unique_id()
        except C.NcclError as exc:
            raise CollectiveError(f"creating an NCCL unique id failed: {exc}") from None

    def connect(self, unique_id: bytes, world: int, rank: int) -> NcclCommunicator:
        C = native()
        try:
            handle = C.nccl_comm_init(unique_id, world, rank, self.device)
        except C.NcclError as exc:
            raise CollectiveError(f"rank {rank} of {world}: {exc}") from None
        return NcclCommunicator(handle, rank, world, self.device)

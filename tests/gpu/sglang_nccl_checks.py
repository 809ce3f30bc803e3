"""SGLang's NCCL state ended and made again on one GPU (run by tests/gpu/test_sglang_nccl_gpu.py in its own process).

Two ranks need two GPUs; what one GPU allows is real here: an NCCL communicator from SGLang's own
``NCCLLibrary`` aborted through :func:`coldsnap_sglang.distributed._abort_call`, and SGLang's real
``GroupCoordinator``s of a one-rank world (``init_distributed_environment`` + ``initialize_model_parallel``
on NCCL) taken through :class:`~coldsnap_sglang.distributed.SglangCollectives`: their torch NCCL groups
aborted with the default group's backend, made again, and all-reducing afterwards."""

from __future__ import annotations

import socket
import sys
from types import SimpleNamespace

SKIP = 77


class OneRankRendezvous:
    """The coordinator of a one-rank world: every barrier is passed at once."""

    def barrier(self, name: str, timeout: float = 60.0) -> None:
        pass

    def put(self, key: str, value: str) -> None:
        raise AssertionError("a one-rank world shares no id")

    def get(self, key: str, timeout: float = 60.0) -> str:
        raise AssertionError("a one-rank world shares no id")


def main() -> int:
    import torch

    try:
        from sglang.srt.distributed import parallel_state
        from sglang.srt.distributed.device_communicators.pynccl_wrapper import NCCLLibrary
    except ImportError as exc:
        print(f"SGLang is not importable: {exc}")
        return SKIP
    if not torch.cuda.is_available():
        print("no GPU")
        return SKIP
    from coldsnap.collective.torch_groups import abort_communicator
    from coldsnap_sglang.distributed import SglangCollectives, _abort_call

    torch.cuda.set_device(0)
    library = NCCLLibrary()
    communicator = library.ncclCommInitRank(1, library.ncclGetUniqueId(), 0)
    seconds = abort_communicator(_abort_call(SimpleNamespace(nccl=library, comm=communicator)), "one-rank", 0, 30)
    print(f"ncclCommAbort through SGLang's NCCL library: {seconds * 1000:.1f} ms")

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    parallel_state.init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                                local_rank=0, backend="nccl")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    tp = parallel_state.get_tp_group()
    before = torch.ones(4, device="cuda")
    torch.distributed.all_reduce(before, group=tp.device_group)  # the group's NCCL communicator exists now
    old_group = tp.device_group
    collectives = SglangCollectives(0, 1)
    steps: dict[str, float] = {}
    collectives.teardown(OneRankRendezvous(), steps)
    assert collectives.process_groups_aborted, "no torch NCCL group was aborted"
    names = [g.unique_name for g in collectives.process_groups_aborted]
    collectives.rebuild(OneRankRendezvous(), steps)
    assert tp.device_group is not old_group
    after = torch.full((4,), 3.0, device="cuda")
    torch.distributed.all_reduce(after, group=tp.device_group)
    torch.cuda.synchronize()
    assert after.tolist() == [3.0] * 4, after
    print(f"torch NCCL groups {names} aborted and made again; the rebuilt tp group all-reduces; "
          f"teardown {steps['teardown'] * 1000:.0f} ms, rebuild {steps['rebuild'] * 1000:.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())

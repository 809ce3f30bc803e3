"""What NCCL leaves in a process's GPU memory after its communicator is destroyed (one rank, one GPU).

    python3 -m benchmarks.nccl_residue          # on the GPU host; also with NCCL_CUMEM_ENABLE=0 or
                                                # CUDA_MODULE_LOADING=EAGER in the environment

The process's device memory (``nvidia-smi``'s per-process use: CUDA context, modules, every allocation)
with torch alone, with a live one-rank NCCL communicator after one all-reduce, after
``destroy_process_group`` and after ``empty_cache``. What stays after the destroy is part of every rank's
device state that the CUDA checkpoint moves into the process image at TP > 1 (the 8b reference
workload's TP 2 image holds ~0.6 GB more per rank than TP 1: docs/engine-images.md).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time


def process_device_mib() -> int | None:
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True).stdout
    for line in out.splitlines():
        pid, mib = (field.strip() for field in line.split(","))
        if int(pid) == os.getpid():
            return int(mib)
    return None


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        raise SystemExit("nccl_residue: needs a CUDA GPU and NCCL (run it on the GPU host)")
    torch.cuda.set_device(0)
    tensor = torch.ones(1 << 20, device="cuda")
    torch.cuda.synchronize()
    print(f"torch only: {process_device_mib()} MiB (torch reserved {torch.cuda.memory_reserved() >> 20} MiB)")
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29533", rank=0, world_size=1,
                            device_id=torch.device("cuda:0"))
    dist.all_reduce(tensor)
    torch.cuda.synchronize()
    print(f"NCCL communicator live (after one all_reduce): {process_device_mib()} MiB")
    started = time.monotonic()
    dist.destroy_process_group()
    torch.cuda.synchronize()
    print(f"after destroy_process_group ({time.monotonic() - started:.2f} s): {process_device_mib()} MiB")
    torch.cuda.empty_cache()
    print(f"after empty_cache: {process_device_mib()} MiB (torch reserved {torch.cuda.memory_reserved() >> 20} MiB)")
    print(f"torch {torch.__version__}, NCCL {torch.cuda.nccl.version()}")


if __name__ == "__main__":
    main()

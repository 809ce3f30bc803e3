"""What the CUDA checkpoint API of this host's driver refuses, one process state at a time.

``python3 -m tests.gpu.cuda_checkpoint_limits`` (two GPUs, ``nvidia-h200-x2``; about a minute; also run by
``scripts/gpu-test.sh`` through tests/gpu/test_cuda_checkpoint_limits.py, skipped with one GPU). Each scenario starts two fresh worker processes, one per GPU, that put themselves in
one state (a live torch NCCL group, an aborted one, a peer's allocation mapped with legacy CUDA IPC,
the same mapping closed again) and wait; this process then runs ``cuCheckpointProcess{Lock,
Checkpoint,Restore,Unlock}`` on both, as ``coldsnap capture`` and ``restore`` do around CRIU, and the
workers compute again on their GPU. It prints one line per scenario and a JSON table (to
``$COLDSNAP_CHECK_LOGS/cuda-checkpoint-limits.json`` when set).

Why: vLLM's TP 2 restore failed in ``cuCheckpointProcessRestore`` with ``CUDA_ERROR_INVALID_VALUE``
(custom all-reduce on) and ``CUDA_ERROR_NOT_SUPPORTED`` (off), and the teardown in
``coldsnap_vllm/distributed.py`` has to end exactly the state the driver refuses. The check fails when a
state coldsnap's teardown leaves behind (aborted NCCL, IPC mappings closed) does not restore; what the
driver does with the states the teardown removes is reported, not asserted (a newer driver may accept
them).
"""

from __future__ import annotations

import ctypes
import json
import multiprocessing
import os
import socket
import sys
import traceback
from pathlib import Path

SCENARIOS = {
    "cuda_only": "a tensor on the GPU, nothing shared",
    "nccl_live": "a torch NCCL group that all-reduced, left alive",
    "nccl_aborted": "the same group (and the default group's NCCL backend) aborted",
    "ipc_open": "the peer's allocation mapped with cuIpcOpenMemHandle, left mapped",
    "ipc_closed": "the same mapping closed again (coldsnap._C.close_ipc_mapping); the exported allocation stays",
    "symm_mem_live": "a torch symmetric-memory buffer rendezvoused over a gloo group (vLLM's SymmMemCommunicator)",
    "symm_mem_released": "the same buffer and its handle dropped",
}
MUST_RESTORE = ("cuda_only", "nccl_aborted", "ipc_closed", "symm_mem_released")  # what the teardown leaves

MIB = 1 << 20
SKIP = 77  # the exit status tests/gpu/test_cuda_checkpoint_limits.py reports as skipped


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]  # CUipcMemHandle


def _driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _check(result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"{what} failed: CUresult {result}")


def _worker(scenario: str, rank: int, port: int, inbox: multiprocessing.Queue, outbox: multiprocessing.Queue) -> None:
    try:
        import torch
        import torch.distributed as dist

        torch.cuda.set_device(rank)
        kept = torch.full((64 * MIB // 4,), float(rank + 1), device="cuda")  # its own cudaMalloc segment
        torch.cuda.synchronize()
        peer_mapping = None
        if scenario.startswith("nccl"):
            dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
            group = dist.new_group([0, 1], backend="nccl")
            summed = torch.ones(1024, device="cuda")
            dist.all_reduce(summed, group=group)
            torch.cuda.synchronize()
            assert summed[0].item() == 2.0
            if scenario == "nccl_aborted":
                group.abort()
                dist.distributed_c10d._get_default_group()._get_backend(torch.device("cuda")).abort()
        elif scenario.startswith("ipc"):
            driver = _driver()
            handle = _IpcHandle()
            _check(driver.cuIpcGetMemHandle(ctypes.byref(handle), ctypes.c_uint64(kept.data_ptr())), "cuIpcGetMemHandle")
            outbox.put(("handle", rank, ctypes.string_at(ctypes.byref(handle), 64)))
            _, peer_handle = inbox.get(timeout=60)
            mapped = ctypes.c_uint64()
            _check(driver.cuIpcOpenMemHandle_v2(ctypes.byref(mapped), _IpcHandle.from_buffer_copy(peer_handle), ctypes.c_uint(1)),
                   "cuIpcOpenMemHandle_v2")
            peer_mapping = mapped.value
            seen = ctypes.c_float()
            _check(driver.cuMemcpyDtoH_v2(ctypes.byref(seen), ctypes.c_uint64(peer_mapping), ctypes.c_size_t(4)),
                   "cuMemcpyDtoH_v2")
            assert seen.value == float(2 - rank), seen.value  # the peer's value, read through the mapping
            if scenario == "ipc_closed":
                from coldsnap.native import native

                native().close_ipc_mapping(peer_mapping, rank)
        elif scenario.startswith("symm_mem"):
            import gc

            import torch.distributed._symmetric_memory as symmetric_memory

            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
            buffer = symmetric_memory.empty(MIB, device="cuda", dtype=torch.bfloat16)
            handle = symmetric_memory.rendezvous(buffer, dist.group.WORLD.group_name)
            torch.cuda.synchronize()
            if scenario == "symm_mem_released":
                del handle, buffer
                gc.collect()
                torch.cuda.synchronize()
        outbox.put(("ready", rank, os.getpid()))
        inbox.get(timeout=300)  # "verify", after the checkpoint round trip
        again = (kept * 2).sum().item()
        assert again == 2.0 * (rank + 1) * kept.numel(), again
        outbox.put(("verified", rank, None))
    except BaseException:  # noqa: BLE001 - reported to the parent, which prints it
        outbox.put(("error", rank, traceback.format_exc()))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _round_trip(pids: list[int]) -> str:
    """lock + checkpoint every pid, then restore + unlock every pid; 'ok' or the first failure."""
    from coldsnap.native import native

    call = native().checkpoint_call
    for op_group in (("lock", "checkpoint"), ("restore", "unlock")):
        for pid in pids:
            for op in op_group:
                try:
                    call(op, pid, 60_000 if op == "lock" else 0)
                except Exception as exc:  # noqa: BLE001 - the finding this check records
                    return f"{op} of pid {pid}: {exc}"
    return "ok"


def run_scenario(scenario: str) -> dict:
    context = multiprocessing.get_context("spawn")
    port = _free_port()
    inboxes = [context.Queue(), context.Queue()]
    outbox = context.Queue()
    workers = [context.Process(target=_worker, args=(scenario, rank, port, inboxes[rank], outbox), daemon=True)
               for rank in (0, 1)]
    for worker in workers:
        worker.start()
    result: dict = {"scenario": scenario, "state": SCENARIOS[scenario]}
    try:
        pids: dict[int, int] = {}
        handles: dict[int, bytes] = {}
        while len(pids) < 2:
            kind, rank, payload = outbox.get(timeout=180)
            if kind == "error":
                result.update(round_trip="setup failed", error=payload)
                return result
            if kind == "handle":
                handles[rank] = payload
                if len(handles) == 2:
                    for peer in (0, 1):
                        inboxes[peer].put(("handle", handles[1 - peer]))
            elif kind == "ready":
                pids[rank] = payload
        result["round_trip"] = _round_trip([pids[0], pids[1]])
        if result["round_trip"] != "ok":
            return result
        for inbox in inboxes:
            inbox.put("verify")
        verified = 0
        while verified < 2:
            kind, rank, payload = outbox.get(timeout=120)
            if kind == "error":
                result["verify"] = f"rank {rank}: {payload}"
                return result
            verified += kind == "verified"
        result["verify"] = "ok"
        return result
    finally:
        for worker in workers:
            worker.kill()
            worker.join(10)


def main() -> int:
    import torch

    if torch.cuda.device_count() < 2:
        print("skipped: needs two GPUs")
        return SKIP
    rows = [run_scenario(name) for name in SCENARIOS]
    for row in rows:
        print(f"{row['scenario']:13s} round trip: {row['round_trip']}; after: {row.get('verify', '-')}")
        if "error" in row:
            print(row["error"])
    logs = os.environ.get("COLDSNAP_CHECK_LOGS")
    if logs:
        Path(logs).mkdir(parents=True, exist_ok=True)
        (Path(logs) / "cuda-checkpoint-limits.json").write_text(json.dumps(rows, indent=1) + "\n")
    failed = [row["scenario"] for row in rows
              if row["scenario"] in MUST_RESTORE and (row["round_trip"] != "ok" or row.get("verify") != "ok")]
    if failed:
        print(f"FAILED: {failed} did not restore")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What a capture's process image holds: its host and device state, mapping by mapping.

    python -m benchmarks.image_attribution --size 8b --device cuda --out attribution.json
    python -m benchmarks.image_attribution --artifact DIR --receipt CAPTURE_RECEIPT.json --out attribution.json

``--artifact``: any engine's committed artifact (vLLM, SGLang, the reference workload), read as it is
(nothing runs): each process of the image by the kind of mapping its pages are in, the zero pages the
capture left out of it, and from the capture's receipt the device state — what torch's caching allocator
held before and after the capture emptied its cache, what live tensors and CUDA-graph pools keep, and
what the CUDA checkpoint moved into the process image (context, modules, workspaces, allocations).
``vllm_startup.py`` and ``sglang_startup.py`` run this after their capture step.

Without ``--artifact``:

Runs the reference workload as `coldsnap capture` would (coldsnap's agent, one canary to warm it up),
lets its agent release the model memory (``prepare``: weights written to a pack, KV cache and graph
regions unmapped, the allocator's cache emptied, the C heap trimmed), and then reads what CRIU would
dump — every private page resident in the tree's mappings (``Anonymous`` in ``/proc/PID/smaps``, shared
anonymous memory by its ``Rss``) — grouped by what the mapping is. For a GPU tree it then takes the
CUDA checkpoint and reads the mappings again: what appeared or grew is the device state the driver
moved into the process (CUDA context, loaded kernels, allocations outside coldsnap's regions), which
it compares with the GPU memory the process held (``nvidia-smi``) and with torch's caching allocator
(``memory_reserved``). Then it unlocks the GPU again and stops the workload; nothing is written but
``--out``. Needs torch; the GPU part needs the CUDA checkpoint API (root).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from coldsnap.secrets.engine_env import engine_environment
from coldsnap.activation.canary import ask_canary
from coldsnap.activation.engine_process import EngineProcess, wait_for_agent, wait_for_http
from coldsnap.activation.ranks import ActivationCoordinator, call_every_rank
from coldsnap.agent.client import AgentClient
from coldsnap.agent.protocol import Prepare, rank_control
from coldsnap.snapshot.cuda_checkpoint import TreeCheckpoint, gpu_processes
from coldsnap.snapshot.process_tree import tree_pids

LARGE = 64 << 20
IN_REGIONS = "of it in coldsnap's regions (unmapped, not in the image)"
"""The torch-allocator row of the segments coldsnap's regions serve: the checkpoint does not copy them."""
_HEADER = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S+) \S+ \S+ \S+\s*(.*)$")


def mappings(pid: int) -> list[dict]:
    """Every mapping of ``pid``: start, end, permissions, path, and the bytes CRIU dumps from it."""
    found: list[dict] = []
    with open(f"/proc/{pid}/smaps") as handle:
        for line in handle:
            header = _HEADER.match(line)
            if header:
                found.append({"start": int(header[1], 16), "end": int(header[2], 16), "perms": header[3],
                              "path": header[4].strip(), "fields": {}})
            elif found and ":" in line:
                key, _, value = line.partition(":")
                parts = value.split()
                if len(parts) == 2 and parts[1] == "kB":
                    found[-1]["fields"][key] = int(parts[0]) * 1024
    for mapping in found:
        fields, shared = mapping["fields"], "s" in mapping["perms"]
        # private pages (anonymous, or file pages written to) are dumped; shared anonymous memory too
        anonymous_shared = shared and (not mapping["path"] or mapping["path"].startswith(("/dev/zero", "/SYSV", "/dev/shm"))
                                       or mapping["path"].endswith("(deleted)"))
        mapping["dumped"] = fields.get("Rss", 0) if anonymous_shared else fields.get("Anonymous", 0)
    return found


def category(mapping: dict) -> str:
    path = mapping["path"]
    size = mapping["end"] - mapping["start"]
    if path == "[heap]":
        return "C heap (brk)"
    if path == "[stack]" or path.startswith("[stack"):
        return "main thread stack"
    if path.startswith("/dev/nvidia"):
        return f"NVIDIA device mappings ({os.path.basename(path).rstrip('0123456789')}*)"
    if path.startswith("["):
        return f"kernel-provided {path}"
    if not path:
        return ("large anonymous mappings (>= 64 MiB: malloc arenas, torch CPU tensors, driver buffers)" if size >= LARGE
                else "small anonymous mappings (thread stacks, malloc arenas, Python objects)")
    name = os.path.basename(path.split(" ")[0])
    if ".so" in name:
        return f"written pages of shared libraries: {_library_family(name)}"
    return f"written pages of other files: {name}"


def _library_family(name: str) -> str:
    for family in ("libtorch_cuda", "libtorch_cpu", "libcublasLt", "libcublas", "libcudnn", "libnccl", "libcuda",
                   "libcudart", "libnvrtc", "libpython", "libc10_cuda", "libc10"):
        if name.startswith(family):
            return family
    return "other .so"


def dumped_by_category(pids: list[int]) -> dict[str, int]:
    totals: dict[str, int] = defaultdict(int)
    for pid in pids:
        for mapping in mappings(pid):
            if mapping["dumped"]:
                totals[category(mapping)] += mapping["dumped"]
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def grown_by_checkpoint(before: dict[int, list[dict]], after: dict[int, list[dict]]) -> dict[str, int]:
    """What the CUDA checkpoint added to the dumped pages, by the kind of mapping that holds it."""
    totals: dict[str, int] = defaultdict(int)
    for pid, mapped in after.items():
        earlier = {(m["start"], m["end"]): m["dumped"] for m in before.get(pid, [])}
        for mapping in mapped:
            grown = mapping["dumped"] - earlier.get((mapping["start"], mapping["end"]), 0)
            if grown > 0:
                new = (mapping["start"], mapping["end"]) not in earlier
                totals[("new " if new else "grown ") + category(mapping)] += grown
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def gpu_memory_by_pid() -> dict[int, int]:
    """GPU memory each process holds, per nvidia-smi (bytes); empty without it."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    held: dict[int, int] = {}
    for line in out.splitlines():
        pid, _, used = line.partition(",")
        if pid.strip().isdigit() and used.strip().isdigit():
            held[int(pid)] = int(used) << 20
    return held


def _span(receipt: dict, name: str) -> dict:
    return next((s.get("attributes", {}) for s in receipt.get("timing", {}).get("spans", []) if s["name"] == name), {})


def capsule_attribution(artifact: Path, receipt: dict) -> dict:
    """What the capture in ``artifact`` holds per process and by kind (see the module docstring)."""
    from coldsnap.snapshot.criu_pages import image_census

    images = next((artifact / "units").glob("*/images"))
    census = image_census(images).to_json_value()
    dump, checkpoint, prepare = (_span(receipt, n) for n in ("capture.criu_dump", "capture.cuda_checkpoint",
                                                              "capture.prepare"))
    dropped = {}
    for item in str(dump.get("image_processes", "")).split(","):
        parts = item.split(":")
        if len(parts) == 3:
            dropped[int(parts[0])] = int(parts[2])
    for process in census["processes"]:
        process["zero_bytes_left_out"] = dropped.get(process["pid"], 0)
    ranks = sorted({k.split(".")[0] for k in prepare if k.startswith("rank")} | {""})
    torch_allocator, context, stack_limits = {}, {}, {}
    for rank in ranks:
        prefix = f"{rank}." if rank else ""
        if f"{prefix}torch_reserved_bytes" in prepare:
            torch_allocator[rank or "rank0"] = {
                "reserved_before_empty": prepare.get(f"{prefix}torch_reserved_before_empty_bytes", 0),
                "reserved_after_empty": prepare[f"{prefix}torch_reserved_bytes"],
                "allocated (graph pools, live buffers)": prepare.get(f"{prefix}torch_allocated_bytes", 0),
                "of it CUDA-graph private pools, reserved": prepare.get(f"{prefix}graph_pool_bytes", 0),
                "of it CUDA-graph private pools, allocated": prepare.get(f"{prefix}graph_pool_allocated_bytes", 0),
                IN_REGIONS: prepare.get(f"{prefix}region_pool_bytes", 0)}
            context[rank or "rank0"] = {
                "local memory freed before the checkpoint (stack limit lowered)":
                    prepare.get(f"{prefix}local_memory_freed_bytes", 0),
                "device memory in use then (cuMemGetInfo, every process)": prepare.get(f"{prefix}device_used_bytes", 0)}
        if f"{prefix}stack_bytes" in prepare:
            stack_limits[rank or "rank0"] = prepare[f"{prefix}stack_bytes"]
    device_state = None
    if checkpoint:
        device_state = checkpoint.get("anonymous_bytes_after", 0) - checkpoint.get("anonymous_bytes_before", 0)
    image_files = sum(f.stat().st_size for f in images.rglob("*") if f.is_file())
    return {"artifact": str(artifact), "image_bytes": image_files, "pages": census,
            "zero_bytes_left_out": sum(dropped.values()), "torch_allocator": torch_allocator,
            "stack_bytes_per_thread": stack_limits, "context": context,
            "device_state_in_image_bytes": device_state,
            "compact_seconds": dump.get("compact_ns", 0) / 1e9}


def render_capsule(document: dict) -> str:
    mib = 2**20
    lines = [f"image of {document['artifact']}: {document['image_bytes'] / mib:.0f} MiB in files, "
             f"{document['zero_bytes_left_out'] / mib:.0f} MiB of zero pages left out at capture "
             f"({document['compact_seconds']:.1f} s)", "",
             "| process | kind of mapping | MiB in the image |", "|---|---|---:|"]
    for process in document["pages"]["processes"]:
        name = f"{process['comm']} ({process['pid']})"
        for kind, value in sorted(process["by_kind"].items(), key=lambda kv: -kv[1]):
            if value >= mib:
                lines.append(f"| {name} | {kind} | {value / mib:.1f} |")
        lines.append(f"| {name} | zero pages left out | ({process['zero_bytes_left_out'] / mib:.1f}) |")
        lines.append(f"| {name} | of the pages, in mappings advised MADV_HUGEPAGE | ({process['huge_pages_advised_bytes'] / mib:.1f}) |")
        lines.append(f"| **{name}** | **total** | **{process['bytes'] / mib:.1f}** |")
    if document["torch_allocator"] or document["device_state_in_image_bytes"] is not None:
        lines += ["", "| device state | MiB |", "|---|---:|"]
        for rank, values in document["torch_allocator"].items():
            lines += [f"| {rank}: torch caching allocator, {k} | {v / mib:.1f} |" for k, v in values.items()]
        for rank, values in document.get("context", {}).items():
            lines += [f"| {rank}: {k} | {v / mib:.1f} |" for k, v in values.items()]
        for rank, stack in document.get("stack_bytes_per_thread", {}).items():
            lines.append(f"| {rank}: per-thread stack limit lowered for the checkpoint, set back at resume | ({stack} bytes) |")
        if document["device_state_in_image_bytes"] is not None:
            # what the checkpoint copies of torch's: its reserved memory less the segments coldsnap's regions serve
            reserved = sum(v["reserved_after_empty"] - v.get(IN_REGIONS, 0)
                           for v in document["torch_allocator"].values())
            total = document["device_state_in_image_bytes"]
            lines.append(f"| moved into the image by the CUDA checkpoint (all GPU processes) | {total / mib:.1f} |")
            if reserved <= total:
                lines.append(f"| of it outside torch's allocator (CUDA context, modules, cuBLAS/NCCL workspaces) | "
                             f"{(total - reserved) / mib:.1f} |")
            else:  # SGLang: torch counts the memory pool coldsnap's regions back (released before the checkpoint)
                lines.append("| of it outside torch's allocator | n/a: torch's count includes memory coldsnap's "
                             "regions released (SGLang's KV pool) |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", help="attribute this committed artifact's image (with --receipt)")
    parser.add_argument("--receipt", help="--artifact: its capture's receipt JSON")
    parser.add_argument("--size", default="tiny", choices=["tiny", "1b", "8b"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--port", type=int, default=18961)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks, one GPU each (default 1)")
    parser.add_argument("--out", default="image_attribution.json")
    args = parser.parse_args()
    if args.artifact:
        receipt = json.loads(Path(args.receipt).read_text()) if args.receipt else {}
        document = capsule_attribution(Path(args.artifact), receipt)
        Path(args.out).write_text(json.dumps(document, indent=2) + "\n")
        print(render_capsule(document))
        return 0
    work = Path(tempfile.mkdtemp(prefix="coldsnap-attribution-"))
    command = [sys.executable, "-m", "coldsnap.workloads.torch_lm", "--size", args.size, "--device", args.device,
               "--port", str(args.port), *(["--tp", str(args.tp)] if args.tp > 1 else [])]
    engine = EngineProcess(command, work / "serve.log", engine_environment({}).variables)
    checkpointed: list[int] = []
    try:
        controls = [rank_control(engine.control, rank) for rank in range(args.tp)]
        for control in controls:
            wait_for_agent(control, engine.alive, 600)
        wait_for_http(args.port, engine.alive, 600)
        ask_canary(args.port, "Warm the server up, as capture's canary does.", 16)
        pids = tree_pids(engine.pid)
        serving_gpu = gpu_memory_by_pid()
        with ActivationCoordinator(args.tp) as coordinator:  # ranks tear NCCL down together, as at capture
            command = Prepare(pack_dir=str(work / "pack"), coordinator=coordinator.command_field())
            replies = call_every_rank([(rank, functools.partial(AgentClient(control).prepare, command))
                                       for rank, control in enumerate(controls)], coordinator)
        released_gpu = gpu_memory_by_pid()
        before = {pid: mappings(pid) for pid in pids}
        host = dumped_by_category(pids)
        document: dict = {"benchmark": "image_attribution", "size": args.size, "device": args.device,
                          "host_dumped_bytes": sum(host.values()), "host_by_category": host,
                          "tp": args.tp, "agent_rss_bytes": sum(r.rss_bytes for r in replies),
                          "torch_reserved_bytes": sum(r.device_bytes for r in replies),
                          "prepare_seconds": [r.seconds for r in replies]}
        gpu_pids = gpu_processes(pids)
        if gpu_pids:
            document["gpu_bytes_serving"] = sum(serving_gpu.get(p, 0) for p in gpu_pids)
            document["gpu_bytes_after_release"] = sum(released_gpu.get(p, 0) for p in gpu_pids)
            TreeCheckpoint().checkpoint(gpu_pids)
            checkpointed = gpu_pids
            after = {pid: mappings(pid) for pid in pids}
            device = grown_by_checkpoint(before, after)
            document["device_state_bytes"] = sum(device.values())
            document["device_state_by_mapping"] = device
            document["device_state_outside_torch_bytes"] = document["device_state_bytes"] - document["torch_reserved_bytes"]
        Path(args.out).write_text(json.dumps(document, indent=2) + "\n")
        print(render(document))
    finally:
        if checkpointed:
            TreeCheckpoint().restore(checkpointed)
        engine.kill()
    return 0


def render(document: dict) -> str:
    mib = 2**20
    tp = f" TP{document['tp']} (all ranks)" if document.get("tp", 1) > 1 else ""
    lines = [f"process image of torch-lm {document['size']}{tp} on {document['device']}, model memory released:",
             "", "| host state (what CRIU dumps) | MiB |", "|---|---:|"]
    lines += [f"| {name} | {value / mib:.1f} |" for name, value in document["host_by_category"].items() if value >= mib]
    lines.append(f"| **host total** | **{document['host_dumped_bytes'] / mib:.1f}** |")
    if "device_state_bytes" in document:
        lines += ["", "| device state (what the CUDA checkpoint moved into the process) | MiB |", "|---|---:|"]
        lines += [f"| {name} | {value / mib:.1f} |" for name, value in document["device_state_by_mapping"].items()
                  if value >= mib]
        lines.append(f"| **device total** | **{document['device_state_bytes'] / mib:.1f}** |")
        lines += ["", f"GPU memory of the process: {document['gpu_bytes_serving'] / mib:.0f} MiB serving, "
                  f"{document['gpu_bytes_after_release'] / mib:.0f} MiB with model memory released; of the device state, "
                  f"torch's caching allocator holds {document['torch_reserved_bytes'] / mib:.1f} MiB (graph pools, "
                  f"activations, cuBLAS workspaces), the rest ({document['device_state_outside_torch_bytes'] / mib:.1f} "
                  "MiB) is the CUDA context, loaded kernels and driver allocations."]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

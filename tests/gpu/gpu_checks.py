"""GPU checks, one per process: ``python -m tests.gpu.gpu_checks NAME`` exits 0 when NAME holds.

tests/gpu/test_memory_gpu.py runs each in a fresh process, so a CUDA fault in one cannot poison the
others and every check starts with a fresh CUDA context.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile

import torch

from coldsnap.hydrate import CopyItem, HydrationError, hydrate_items
from coldsnap.memory import AllocationError, RegionError, reserve, reserve_staging
from tests.processes import group_members, kill_replicas, launched_pid, replica_members, restore_killed_at

MiB = 1 << 20


def vmm_roundtrip() -> None:
    region = reserve("weights", 1 << 30, backend="cuda", chunk_bytes=64 * MiB)
    base = region.base
    region.map()
    assert region.mapped_bytes == 1 << 30
    t = region.tensor(torch.int32, (256, MiB // 4))  # 256 MiB
    t.copy_(torch.arange(t.numel(), device="cuda", dtype=torch.int32).view_as(t))
    assert int(t[255, -1]) == t.numel() - 1
    region.unmap()
    assert region.mapped_bytes == 0 and region.base == base
    free_after_unmap = torch.cuda.mem_get_info()[0]
    region.map()
    assert region.base == base and region.mapped_bytes == 1 << 30
    assert torch.cuda.mem_get_info()[0] <= free_after_unmap - (1 << 30) + 64 * MiB  # physical memory came back
    region.zero()
    again = region.tensor(torch.float32, (256, MiB // 4))
    assert int(torch.count_nonzero(again)) == 0
    again.fill_(3.0)
    assert float(again.sum()) == 3.0 * again.numel()
    print("vmm round trip at", hex(base))


def torch_allocations_land_in_region() -> None:
    region = reserve("weights", 2 << 30, backend="cuda", chunk_bytes=64 * MiB)
    outside = torch.empty(16 * MiB, dtype=torch.uint8, device="cuda")
    from coldsnap.memory import region as use_region

    with use_region("weights"):
        a = torch.empty(300 * MiB, dtype=torch.uint8, device="cuda")
        b = torch.ones(1000, 1000, device="cuda")
    for t in (a, b):
        assert region.base <= t.data_ptr() < region.base + region.size, hex(t.data_ptr())
    assert not region.base <= outside.data_ptr() < region.base + region.size
    assert region.allocations() and region.mapped_bytes >= 300 * MiB
    assert float(b.sum()) == 1e6
    # weights survive an unmap/remap only as addresses: the tensor objects stay valid
    region.unmap()
    region.map()
    b.fill_(2.0)
    assert float(b.sum()) == 2e6
    print("allocations:", region.allocations()[:4])


def allocator_error_is_raised_in_python() -> None:
    reserve("kv_cache", 64 * MiB, backend="cuda", chunk_bytes=32 * MiB)
    from coldsnap.memory import region as use_region

    try:
        with use_region("kv_cache"):
            torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
    except AllocationError as exc:
        assert "exhausted" in str(exc), exc
        print("raised:", exc)
        return
    raise AssertionError("allocating past the region did not raise AllocationError")


def hydration_bit_exact() -> None:
    size = 1 << 30
    with tempfile.TemporaryDirectory(dir=os.environ.get("COLDSNAP_GPU_SCRATCH", "/tmp")) as scratch:
        path = os.path.join(scratch, "source.bin")
        source = torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda")
        source.cpu().numpy().tofile(path)
        expected = hashlib.sha256(source.cpu().numpy().tobytes()).hexdigest()
        region = reserve("weights", 2 << 30, backend="cuda", chunk_bytes=64 * MiB)
        region.map()
        for threads, direct in ((1, False), (8, True), (16, None)):
            region.zero()
            stats = hydrate_items(path, [CopyItem(0, size, region.base)], [region], threads=threads, direct=direct)
            got = region.tensor(torch.uint8, (size,))
            assert torch.equal(got, source), f"mismatch with {threads} threads, direct={direct}"
            print(f"{threads:2d} threads direct={direct}: {stats.gb_per_s:.1f} GB/s, pinned {stats.pinned_bytes >> 20} MiB")
        assert hashlib.sha256(region.tensor(torch.uint8, (size,)).cpu().numpy().tobytes()).hexdigest() == expected
        # odd extents: unaligned file offsets, lengths and destinations
        region.zero()
        items = [CopyItem(4097, 12345, region.base + 3), CopyItem(size - 5000, 5000, region.base + (1 << 30) + 1)]
        hydrate_items(path, items, [region], threads=4)
        flat = region.tensor(torch.uint8, (2 << 30,))
        assert torch.equal(flat[3:3 + 12345], source[4097:4097 + 12345])
        assert torch.equal(flat[(1 << 30) + 1:(1 << 30) + 5001], source[size - 5000:])
        assert int(torch.count_nonzero(flat[:3])) == 0 and int(torch.count_nonzero(flat[12348:(1 << 30)])) == 0
        # never outside the mapped bytes
        try:
            hydrate_items(path, [CopyItem(0, 4096, region.base + region.mapped_bytes - 100)], [region])
        except HydrationError as exc:
            assert "outside" in str(exc)
        else:
            raise AssertionError("out-of-region hydration was not refused")


def concurrent_hydrations_bit_exact() -> None:
    """Two hydrations at once from two threads (the launcher stages every rank's weights in
    parallel), one per GPU when there are two: neither may see the other's staging slots."""
    import threading

    devices = [0, 1] if torch.cuda.device_count() > 1 else [0, 0]
    size = 512 * MiB
    with tempfile.TemporaryDirectory(dir=os.environ.get("COLDSNAP_GPU_SCRATCH", "/tmp")) as scratch:
        sources, paths, regions = [], [], []
        for index, device in enumerate(devices):
            source = torch.randint(0, 256, (size,), dtype=torch.uint8, device=f"cuda:{device}")
            path = os.path.join(scratch, f"source{index}.bin")
            source.cpu().numpy().tofile(path)
            region = reserve_staging(f"staged{index}", size, device=device, chunk_bytes=64 * MiB)
            region.map(size)
            sources.append(source), paths.append(path), regions.append(region)
        for round_ in range(3):
            for region in regions:
                region.zero()
            errors: list[BaseException] = []

            def run(index: int) -> None:
                try:
                    hydrate_items(paths[index], [CopyItem(0, size, regions[index].base)], [regions[index]], threads=8)
                except BaseException as exc:  # collected: the check fails below
                    errors.append(exc)

            threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert not errors, errors
            for index, device in enumerate(devices):
                got = regions[index].tensor(torch.uint8, (size,))
                assert torch.equal(got, sources[index]), f"round {round_}: hydration {index} (cuda:{device}) corrupted"
        print(f"two concurrent hydrations on cuda:{devices[0]} and cuda:{devices[1]}: bit-exact, 3 rounds")


def host_region_tensor_view() -> None:
    region = reserve("weights", 4 * MiB, backend="host")
    region.map()
    t = region.tensor(torch.bfloat16, (1024,), offset=4096)
    t.fill_(1.5)
    assert bytes(region.host_view(4096, 2)) == torch.tensor([1.5], dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()


CHILD = r"""
import sys, torch
x = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
graph, out = torch.cuda.CUDAGraph(), torch.empty_like(x)
with torch.cuda.graph(graph):
    out.copy_(x * 2)
torch.cuda.synchronize()
print("ready", flush=True)
sys.stdin.readline()  # the parent checkpoints and restores us meanwhile
graph.replay()
torch.cuda.synchronize()
print("ok" if torch.equal(out, x * 2) and float(x[-1]) == float((1 << 20) - 1) else "wrong", flush=True)
"""


def cuda_checkpoint_roundtrip() -> None:
    import subprocess

    from coldsnap.snapshot.cuda_checkpoint import NativeCheckpointDriver, TreeCheckpoint, gpu_processes

    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        assert gpu_processes([child.pid]) == [child.pid]
        tree = TreeCheckpoint(NativeCheckpointDriver())
        tree.checkpoint([child.pid])
        assert NativeCheckpointDriver().state(child.pid) == "checkpointed"
        tree.restore([child.pid])
        assert NativeCheckpointDriver().state(child.pid) == "running"
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "ok"  # data and a CUDA graph survive
    finally:
        child.kill()
        child.wait()


TRIM_CHILD = r"""
import json, sys, torch
from coldsnap.agent.device_state import LocalMemoryTrim
from coldsnap.native import native
C = native()
x = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
graph, out = torch.cuda.CUDAGraph(), torch.empty_like(x)
with torch.cuda.graph(graph):
    out.copy_(x * 2)
torch.cuda.synchronize()
C.set_context_limit(0, 0, 4096)  # a stack limit an engine's kernels grew, as vLLM's do
trim = LocalMemoryTrim()
measured = trim.lower([0])
print(json.dumps(measured), flush=True)
sys.stdin.readline()  # the parent checkpoints and restores us meanwhile
trim.restore()
graph.replay()
torch.cuda.synchronize()
ok = torch.equal(out, x * 2) and C.context_limit(0, 0) == 4096
print("ok" if ok else "wrong", flush=True)
"""


def _checkpointed_child(trim: bool) -> dict:
    """TRIM_CHILD checkpointed and restored once; what its stack trim freed, what the checkpoint moved into
    the process's memory (VmRSS grown), and how long the CUDA restore took."""
    import json
    import subprocess
    import time

    from coldsnap.snapshot.cuda_checkpoint import NativeCheckpointDriver, TreeCheckpoint

    def rss(pid: int) -> int:
        with open(f"/proc/{pid}/status") as handle:
            return next(int(line.split()[1]) * 1024 for line in handle if line.startswith("VmRSS:"))

    env = dict(os.environ, COLDSNAP_TRIM_LOCAL_MEMORY="1" if trim else "0")
    child = subprocess.Popen([sys.executable, "-c", TRIM_CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env=env)
    try:
        measured = json.loads(child.stdout.readline())
        tree = TreeCheckpoint(NativeCheckpointDriver())
        before = rss(child.pid)
        tree.checkpoint([child.pid])
        moved = rss(child.pid) - before
        started = time.monotonic()
        tree.restore([child.pid])
        restore_s = time.monotonic() - started
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "ok"  # the graph replays right, the limit is back
        return {"trim": trim, **measured, "moved_bytes": moved, "cuda_restore_s": round(restore_s, 4)}
    finally:
        child.kill()
        child.wait()


def local_memory_trim_around_checkpoint() -> None:
    """Lowering the stack limit before a CUDA checkpoint frees the context's local memory, the checkpoint
    moves that much less, and once the limit is set back a captured graph replays right."""
    plain, trimmed = _checkpointed_child(trim=False), _checkpointed_child(trim=True)
    print(f"local memory: {plain} vs {trimmed}")
    assert trimmed["stack_bytes"] == 4096 and trimmed["local_memory_freed_bytes"] > 64 * MiB
    assert trimmed["moved_bytes"] < plain["moved_bytes"] - 64 * MiB


def engine_graph_pool_scratch_discarded() -> None:
    """As vLLM does with coldsnap's pool: graphs captured later, outside any region block, into the pool
    id :func:`engine_graph_pool` handed out, land in the cudagraph region; with the region unmapped, then
    mapped again and filled with 0xFF (the poison check), the graphs still replay right: their pool
    memory is scratch. A ``region("weights")`` block in between leaves the graph region active after."""
    import torch

    from coldsnap.memory import engine_graph_pool, region, reserve

    graphs = reserve("cudagraph", 4 << 30, backend="cuda", device=0)
    reserve("weights", 64 * MiB, backend="cuda", device=0)
    pool = engine_graph_pool("cudagraph")
    with region("weights") as weights:
        w = torch.randn(1024, 1024, device="cuda")  # a weight in its own region
    assert weights.mapped_bytes >= w.numel() * 4
    x = torch.randn(256, 1024, device="cuda")
    graph = torch.cuda.CUDAGraph()
    for _ in range(2):  # warm-up on a side stream, as capture wants
        (torch.relu(x @ w) @ w).sum()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph, pool=pool):
        hidden = torch.relu(x @ w)  # an intermediate in the pool
        out = hidden @ w
    torch.cuda.synchronize()
    mapped = graphs.mapped_bytes
    assert mapped > 0, "the capture's memory did not come from the cudagraph region"
    assert graphs.base <= out.data_ptr() < graphs.base + graphs.size
    x.copy_(torch.randn_like(x))
    graph.replay()
    expected = torch.relu(x @ w) @ w
    torch.cuda.synchronize()
    assert torch.allclose(out, expected, rtol=1e-3, atol=1e-3)
    graphs.unmap()
    graphs.map()
    graphs.tensor(torch.uint8, (graphs.mapped_bytes,)).fill_(0xFF)  # what COLDSNAP_POISON_GRAPH_MEMORY does
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert graphs.mapped_bytes == mapped and torch.allclose(out, torch.relu(x @ w) @ w, rtol=1e-3, atol=1e-3)
    fresh = engine_graph_pool("cudagraph", fresh=True)  # after graphs are released: a new pool, same region
    assert fresh != pool
    again = torch.cuda.CUDAGraph()
    with torch.cuda.graph(again, pool=fresh):
        out2 = x @ w
    assert graphs.base <= out2.data_ptr() < graphs.base + graphs.size
    print(f"graph pool in the cudagraph region: {mapped >> 20} MiB mapped, replays right after unmap + 0xFF")


def torch_lm_cuda_graph_decode() -> None:
    from coldsnap.workloads.torch_lm import TorchLM

    model = TorchLM("tiny", "cuda")
    assert model._graph is not None
    prompt = "Reply with exactly: coldsnap-cuda-snapshot-ok"
    graphed = model.generate(prompt, 16)
    assert model.generate(prompt, 16) == graphed  # replays are deterministic
    model._graph = None
    eager = model.generate(prompt, 16)
    assert graphed[0] == eager[0]  # the first token comes from the same eager prefill
    print("graph vs eager agree on", sum(a == b for a, b in zip(graphed, eager)), "of 16 tokens")


STAGING_CHILD = """
import socket, sys, torch
from coldsnap.memory import reserve_staging
total = int(sys.argv[3])
staging = reserve_staging("weights", total, device=0, chunk_bytes=int(sys.argv[2]))
staging.map(total)
view = staging.tensor(torch.int32, (total // 4,))
view.copy_(torch.arange(view.numel(), dtype=torch.int32, device="cuda"))
torch.cuda.synchronize()
fds = staging.export_chunks()
socket.send_fds(socket.socket(fileno=int(sys.argv[1])), [b"x"], fds)
staging.release()  # the exporter lets go (and exits) before anyone adopts
"""


def staged_chunks_adopted_by_another_process() -> None:
    """The hand-over restore uses: chunks hydrated in one process, exported as fds, mapped at another
    process's stable address after the exporter exited; a chunk-size mismatch changes nothing."""
    import socket
    import subprocess

    def staged_fds(chunk_bytes: int, total: int = 256 * MiB) -> list[int]:
        parent, child = socket.socketpair()
        with parent, child:
            subprocess.run([sys.executable, "-c", STAGING_CHILD, str(child.fileno()), str(chunk_bytes), str(total)],
                           pass_fds=[child.fileno()], check=True, timeout=120)
            _, fds, _, _ = socket.recv_fds(parent, 16, 64)
        return fds

    region = reserve("weights", 256 * MiB, backend="cuda", chunk_bytes=64 * MiB)
    wrong = staged_fds(32 * MiB, 128 * MiB)  # 4 chunks, each half this region's chunk size
    try:
        region.adopt_chunks(wrong)
        raise AssertionError("chunks of another size were adopted")
    except RegionError as exc:
        print("refused:", exc)
    finally:
        for fd in wrong:
            os.close(fd)
    assert region.mapped_bytes == 0
    fds = staged_fds(64 * MiB)
    region.adopt_chunks(fds)
    for fd in fds:
        os.close(fd)
    assert region.mapped_bytes == 256 * MiB
    t = region.tensor(torch.int32, (64 * MiB,))
    assert torch.equal(t, torch.arange(t.numel(), dtype=torch.int32, device="cuda"))
    region.unmap()
    region.map()  # after an unmap, ordinary chunks again
    assert region.mapped_bytes == 256 * MiB
    print("adopted 4 chunks at", hex(region.base))


GPU_FILLER = """
import sys, torch
held = []
for step in (1 << 30, 64 << 20, 4 << 20):
    while True:
        try:
            held.append(torch.empty(step, dtype=torch.uint8, device="cuda"))
        except torch.OutOfMemoryError:
            break
print("full", torch.cuda.mem_get_info()[0], flush=True)
sys.stdin.readline()
"""


PROMPT_2 = "The second prompt, asked after the restore."


def _complete(port: int) -> list[int]:
    import json
    import urllib.request

    body = json.dumps({"prompt": PROMPT_2, "max_tokens": 12, "temperature": 0}).encode()
    with urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body), timeout=60) as r:
        return json.loads(r.read())["choices"][0]["token_ids"]


def _coldsnap(*args: str, env: dict) -> tuple[int, dict, str]:
    """`coldsnap OP --receipt-json - ...`: status, the receipt (which must pass the strict validator), stderr."""
    import json
    import subprocess

    done = subprocess.run([sys.executable, "-m", "coldsnap", args[0], "--receipt-json", "-", *args[1:]], capture_output=True,
                          text=True, timeout=600, env=env)
    with tempfile.NamedTemporaryFile("w", suffix=".json") as receipt:
        receipt.write(done.stdout)
        receipt.flush()
        assert subprocess.run([sys.executable, "-m", "coldsnap", "validate", "receipt", receipt.name]).returncode == 0
    return done.returncode, json.loads(done.stdout), done.stderr


def _cold_start_tokens(workload: list[str], port: int, env: dict | None = None) -> list[int]:
    """Start ``workload`` plainly, ask PROMPT_2 once it answers, stop it."""
    import subprocess
    import time

    from coldsnap.snapshot.process_tree import kill_tree

    reference = subprocess.Popen(workload, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                return _complete(port)
            except OSError:
                assert time.monotonic() < deadline and reference.poll() is None, "the reference workload did not start"
                time.sleep(0.2)
    finally:
        kill_tree(reference.pid)
        reference.wait()


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def capture_restore_on_gpu() -> None:
    """The n610 sequence end to end on this GPU: capture (CUDA checkpoint + CRIU dump) of the CUDA-graph
    workload, restore twice with the same greedy tokens as a cold start, the driver floor, and a restore
    onto a GPU without room refused at admission (``admission.gpu_memory``), nothing started."""
    import subprocess
    import time

    from coldsnap.activation.qualification import ALLOW_UNQUALIFIED_DRIVER_ENV
    from coldsnap.host import nvidia_kernel_driver

    unqualified = int(nvidia_kernel_driver().split(".")[0]) < 610  # n610's floor (seeds)
    allowed = {**os.environ, ALLOW_UNQUALIFIED_DRIVER_ENV: "1"}
    strict = {k: v for k, v in os.environ.items() if k != ALLOW_UNQUALIFIED_DRIVER_ENV}
    port = _free_port()
    workload = [sys.executable, "-m", "coldsnap.workloads.torch_lm", "--size", "tiny", "--device", "cuda", "--port", str(port)]
    expected = _cold_start_tokens(workload, port)

    def coldsnap(*args: str, env: dict) -> tuple[int, dict, str]:
        return _coldsnap(*args, env=env)

    complete = _complete

    with tempfile.TemporaryDirectory() as scratch:
        artifact = os.path.join(scratch, "artifact")
        if unqualified:
            status, receipt, err = coldsnap("capture", "--out", artifact, "--", *workload, env=strict)
            assert status == 1 and receipt["error"]["code"] == "capture.driver_floor", receipt
            assert group_members(launched_pid(receipt)) == [] and not os.path.exists(os.path.join(artifact, "artifact.json"))
        status, receipt, err = coldsnap("capture", "--out", artifact, "--", *workload, env=allowed)
        print(err[-3000:])
        assert status == 0, receipt
        assert group_members(launched_pid(receipt)) == []  # nothing of the captured command left running
        spans = {s["name"]: s for s in receipt["timing"]["spans"]}
        print("capture phases:", {n: round(s["duration_ns"] / 1e9, 3) for n, s in spans.items()})
        assert "capture.cuda_checkpoint" in spans and spans["capture.cuda_checkpoint"]["attributes"]["processes"] == 1
        assert any("unqualified" in w for w in receipt["warnings"]) == unqualified
        descriptor_bytes = open(os.path.join(artifact, "artifact.json"), "rb").read()

        if unqualified:  # refused at admission without the host owner's override, nothing started
            status, receipt, _ = coldsnap("restore", artifact, "--prepare-only", env=strict)
            assert status == 1 and receipt["error"]["code"] == "admission.driver_floor", receipt
        for attempt in range(2):
            status, receipt, err = coldsnap("restore", artifact, env=allowed)
            print(err[-2000:])
            assert status == 0, receipt
            spans = {s["name"]: s["duration_ns"] / 1e9 for s in receipt["timing"]["spans"]}
            print(f"restore {attempt} phases:", {n: round(v, 3) for n, v in spans.items()})
            assert "restore.cuda_restore" in spans
            resume = next(s for s in receipt["timing"]["spans"] if s["name"] == "restore.resume")["attributes"]
            print("resume:", resume)
            assert resume["staged"] is True and resume["source"] == "native"  # the launcher hydrated, the agent adopted
            assert complete(port) == expected  # same greedy tokens as a cold start, through the CUDA graph
            kill_replicas(artifact)

        # Another process holds all GPU memory: admission refuses (the capsule records what the tree used on
        # the GPU), before CRIU or the CUDA restore runs, prepare-only included
        filler = subprocess.Popen([sys.executable, "-c", GPU_FILLER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            print("filler:", filler.stdout.readline().strip())
            for flags in (("--prepare-only",), ()):
                status, receipt, err = coldsnap("restore", artifact, *flags, env=allowed)
                print(err[-2000:])
                assert status == 1 and receipt["error"]["code"] == "admission.gpu_memory", receipt
                assert not [s for s in receipt["timing"]["spans"] if s["name"] == "restore.criu_restore"], receipt
            print("restore without GPU memory refused with", receipt["error"])
        finally:
            filler.kill()
            filler.wait()
        time.sleep(0.5)
        assert replica_members(artifact) == [], "a restored process was left running after the failed restore"
        assert open(os.path.join(artifact, "artifact.json"), "rb").read() == descriptor_bytes  # artifact untouched



def _gpu_pids() -> set[int]:
    """Processes holding a CUDA context on any GPU here (nvidia-smi's compute apps)."""
    import subprocess

    listed = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"], capture_output=True, text=True)
    return {int(line) for line in listed.stdout.split() if line.strip().isdigit()}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def failure_hygiene_on_gpu() -> None:
    """The trustworthy-core faults on a GPU restore of the CUDA-graph workload: a moved copy and a
    read-only bind mount restore (never written), a pages image corrupted in place is refused at
    admission with nothing started, and a launcher SIGKILLed as CRIU, the CUDA restore, the resume or
    the canary starts leaves no restored process, no CUDA context and no receipt behind."""
    import shutil
    import signal
    import subprocess
    import time

    from coldsnap.activation.qualification import ALLOW_UNQUALIFIED_DRIVER_ENV

    port = _free_port()
    workload = [sys.executable, "-m", "coldsnap.workloads.torch_lm", "--size", "tiny", "--device", "cuda", "--port", str(port)]
    expected = _cold_start_tokens(workload, port)
    with tempfile.TemporaryDirectory() as scratch:
        root = os.path.join(scratch, "root")
        env = {**os.environ, ALLOW_UNQUALIFIED_DRIVER_ENV: "1", "COLDSNAP_STATE_DIR": os.path.join(scratch, "state")}
        captured = os.path.join(scratch, "captured")
        status, receipt, err = _coldsnap("capture", "--out", captured, "--", *workload, env=env)
        assert status == 0, (receipt, err[-3000:])
        os.makedirs(root)
        moved = os.path.join(root, "moved")
        shutil.copytree(captured, moved)  # a copy at a new path, new inodes; the original goes away
        shutil.rmtree(captured)

        def snapshot_bytes(tree: str) -> dict[str, bytes]:
            return {os.path.relpath(os.path.join(d, f), tree): open(os.path.join(d, f), "rb").read()
                    for d, _, files in os.walk(tree) for f in files}

        def restore_and_check(artifact: str, label: str) -> None:
            started = time.perf_counter()
            status, receipt, err = _coldsnap("restore", artifact, env=env)
            try:
                assert status == 0, (label, receipt.get("error"), err[-2000:])
                assert _complete(port) == expected, label
                print(f"{label}: restored in {time.perf_counter() - started:.2f} s, tokens = cold start's")
            finally:
                kill_replicas(artifact)
                time.sleep(0.5)

        before = snapshot_bytes(moved)
        restore_and_check(moved, "moved copy")
        read_only = os.path.join(root, "read-only")
        os.makedirs(read_only)
        if subprocess.run(["mount", "--bind", moved, read_only], capture_output=True).returncode == 0:
            try:
                subprocess.run(["mount", "-o", "remount,ro,bind", read_only], check=True, capture_output=True)
                restore_and_check(read_only, "read-only bind mount")
            finally:
                subprocess.run(["umount", read_only], capture_output=True)
        else:
            print("read-only bind mount: NOT RUN (mount --bind refused here)")
        assert snapshot_bytes(moved) == before, "a restore wrote into the artifact"

        for killed_at in ("restore.criu_restore", "restore.cuda_restore", "restore.resume", "restore.canary"):
            receipt_path = os.path.join(scratch, f"receipt-{killed_at}.json")
            try:
                launcher = restore_killed_at(moved, killed_at, receipt_path, env)
                assert launcher.returncode == -signal.SIGKILL, f"the restore ended before {killed_at} started"
                killed = time.monotonic()
                while (replica_members(moved) or _gpu_pids()) and time.monotonic() < killed + 20:
                    time.sleep(0.1)
                left = replica_members(moved)
                print(f"launcher SIGKILLed as {killed_at} started: restored tree "
                      f"{'STILL RUNNING' if left else f'gone after {time.monotonic() - killed:.2f} s'}, "
                      f"CUDA contexts left {sorted(_gpu_pids())}")
                assert not left and not _gpu_pids()
                assert not os.path.exists(receipt_path)
            finally:
                kill_replicas(moved)
                time.sleep(0.5)

        corrupt = os.path.join(root, "corrupt")
        shutil.copytree(moved, corrupt)
        images = os.path.join(corrupt, "units", "unit-0", "images")
        pages = max((os.path.join(images, n) for n in os.listdir(images) if n.startswith("pages-")), key=os.path.getsize)
        stat = os.stat(pages)
        with open(pages, "r+b") as image:  # one byte flipped in place: same size, same mtime
            image.seek(stat.st_size // 2)
            byte = image.read(1)
            image.seek(stat.st_size // 2)
            image.write(bytes([byte[0] ^ 0xFF]))
        os.utime(pages, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        status, receipt, err = _coldsnap("restore", corrupt, env=env)
        print("corrupted pages image:", receipt.get("error"))
        assert status == 1 and receipt["error"]["code"] == "admission.capsule", receipt
        assert not replica_members(corrupt) and not _gpu_pids()
        assert snapshot_bytes(moved) == before

class NeedsMoreGpus(Exception):
    """The check cannot run on this host (exit status SKIP: reported as skipped, never as passed)."""


SKIP = 77


def _two_gpus() -> None:
    if torch.cuda.device_count() < 2:
        raise NeedsMoreGpus(f"needs 2 GPUs, this host has {torch.cuda.device_count()}")


def _nccl_rank(rank: int, rendezvous_dir: str) -> None:
    """One rank of nccl_bridge_two_ranks: two communicator generations (the second one from a fresh
    unique id, as after a restore), an all-reduce eager and inside a CUDA graph, and an abort."""
    import time

    from coldsnap.collective import NcclBackend

    torch.cuda.set_device(rank)
    backend = NcclBackend(rank)
    print(f"rank {rank}: NCCL {backend.loaded['version']} from {backend.loaded['library']}", flush=True)

    def exchanged(name: str) -> bytes:
        path = os.path.join(rendezvous_dir, name)
        if rank == 0:
            unique_id = backend.create_unique_id()
            with open(path + ".tmp", "wb") as handle:
                handle.write(unique_id)
            os.rename(path + ".tmp", path)
            return unique_id
        deadline = time.monotonic() + 60
        while not os.path.exists(path):
            assert time.monotonic() < deadline, f"no unique id {name} from rank 0"
            time.sleep(0.01)
        return open(path, "rb").read()

    for generation in range(2):
        started = time.perf_counter()
        comm = backend.connect(exchanged(f"id{generation}"), 2, rank)
        joined = time.perf_counter() - started
        values = torch.full((1 << 20,), float(rank + 1), device=f"cuda:{rank}", dtype=torch.bfloat16)
        comm.all_reduce(values)
        torch.cuda.synchronize()
        assert bool((values == 3.0).all()), values[:4]
        graph, x = torch.cuda.CUDAGraph(), torch.ones(4096, device=f"cuda:{rank}", dtype=torch.float32)
        with torch.cuda.graph(graph):
            comm.all_reduce(x)
        graph.replay()
        torch.cuda.synchronize()
        assert bool((x == 2.0).all()), x[:4]  # captured all-reduce replays
        del graph
        started = time.perf_counter()
        comm.close()
        print(f"rank {rank}: generation {generation}: joined in {joined:.3f} s, closed in "
              f"{time.perf_counter() - started:.3f} s", flush=True)
    comm = backend.connect(exchanged("id-abort"), 2, rank)
    comm.abort()
    print(f"rank {rank}: aborted a third communicator", flush=True)


def nccl_bridge_two_ranks() -> None:
    """coldsnap._C's NCCL bridge in two processes, one GPU each (torch's own NCCL, dlopen'd)."""
    import subprocess

    _two_gpus()
    with tempfile.TemporaryDirectory() as rendezvous:
        ranks = [subprocess.Popen([sys.executable, "-m", "tests.gpu.gpu_checks", "_nccl_rank", str(r), rendezvous],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
        outputs = [p.communicate(timeout=240)[0] for p in ranks]
    for rank, (process, output) in enumerate(zip(ranks, outputs)):
        print(output)
        assert process.returncode == 0, f"rank {rank} failed"


def tp2_capture_restore_on_gpu() -> None:
    """torch_lm --tp 2 on two GPUs: NCCL torn down before the CUDA checkpoint and CRIU dump, rebuilt
    through the coordinator after restore, the decode graphs (which hold NCCL kernels) recaptured; the
    same greedy tokens as a cold start, twice (a rank failing is tested on the CPU, where the sequence is
    the same: tests/integration/test_tensor_parallel.py)."""
    import time

    from coldsnap.activation.qualification import ALLOW_UNQUALIFIED_DRIVER_ENV

    _two_gpus()
    env = {**os.environ, ALLOW_UNQUALIFIED_DRIVER_ENV: "1", "NCCL_NVLS_ENABLE": "0"}
    port = _free_port()
    workload = [sys.executable, "-m", "coldsnap.workloads.torch_lm", "--size", "tiny", "--device", "cuda",
                "--tp", "2", "--port", str(port)]
    expected = _cold_start_tokens(workload, port, env)

    def coldsnap(*args: str) -> tuple[int, dict, str]:
        return _coldsnap(*args, env=env)

    complete = _complete

    with tempfile.TemporaryDirectory() as scratch:
        artifact = os.path.join(scratch, "artifact")
        status, receipt, err = coldsnap("capture", "--out", artifact, "--", *workload)
        print(err[-3000:])
        assert status == 0, receipt
        assert group_members(launched_pid(receipt)) == []  # neither the supervisor nor a rank left running
        spans = {s["name"]: s for s in receipt["timing"]["spans"]}
        print("capture phases:", {n: round(s["duration_ns"] / 1e9, 3) for n, s in spans.items()})
        print("prepare:", spans["capture.prepare"]["attributes"])
        assert spans["capture.cuda_checkpoint"]["attributes"]["processes"] == 2
        assert spans["capture.prepare"]["attributes"]["rank1.graphs_released"] == "decode"
        for attempt in range(2):
            status, receipt, err = coldsnap("restore", artifact)
            print(err[-2000:])
            assert status == 0, receipt
            spans = {s["name"]: s for s in receipt["timing"]["spans"]}
            print(f"restore {attempt} phases:", {n: round(s["duration_ns"] / 1e9, 3) for n, s in spans.items()})
            resume = spans["restore.resume"]["attributes"]
            print("resume:", resume)
            assert resume["staged"] is True and resume["rank1.staged"] is True
            assert resume["graphs_recaptured"] == "decode" == resume["rank1.graphs_recaptured"]
            assert complete(port) == expected  # same tokens as the cold start, through the recaptured graphs
            kill_replicas(artifact)
        time.sleep(0.5)
        assert replica_members(artifact) == []


def standby_on_gpu() -> None:
    """Warm standby of the CUDA-graph workload on this GPU: `coldsnap warm` parks it (CUDA restored,
    payload pack pinned, weights not on the GPU), `coldsnap wake` hydrates from the pinned pack and
    serves the cold start's tokens; the same with pinning off (the staging ring); a killed standby and
    an expired one leave no process and no CUDA context behind."""
    import json
    import subprocess
    import time

    from coldsnap.activation.qualification import ALLOW_UNQUALIFIED_DRIVER_ENV

    port = _free_port()
    workload = [sys.executable, "-m", "coldsnap.workloads.torch_lm", "--size", "tiny", "--device", "cuda", "--port", str(port)]
    expected = _cold_start_tokens(workload, port)
    with tempfile.TemporaryDirectory() as scratch:
        env = {**os.environ, ALLOW_UNQUALIFIED_DRIVER_ENV: "1", "COLDSNAP_STATE_DIR": os.path.join(scratch, "state")}
        artifact = os.path.join(scratch, "artifact")
        status, receipt, err = _coldsnap("capture", "--out", artifact, "--", *workload, env=env)
        assert status == 0, (receipt, err[-3000:])

        def standbys() -> list[dict]:
            listed = subprocess.run([sys.executable, "-m", "coldsnap", "status", "--json"], capture_output=True, text=True,
                                    env=env, check=True)
            return json.loads(listed.stdout)["standbys"]

        try:
            for pin in ("1", "0"):
                status, warm, err = _coldsnap("warm", artifact, env={**env, "COLDSNAP_STANDBY_PIN_PACK": pin})
                assert status == 0, (warm.get("error"), err[-2000:])
                parked = next(s for s in warm["timing"]["spans"] if s["name"] == "warm.standby")["attributes"]
                assert (parked["pinned_bytes"] > 0) == (pin == "1"), parked
                assert [s["state"] for s in standbys()] == ["standby"] and set(replica_members(artifact)) & _gpu_pids()
                started = time.perf_counter()
                status, wake, err = _coldsnap("wake", artifact, env=env)
                assert status == 0, (wake.get("error"), err[-2000:])
                resume = next(s for s in wake["timing"]["spans"] if s["name"] == "wake.resume")["attributes"]
                assert resume["source"] == "native" and resume["pinned"] == (pin == "1"), resume
                assert _complete(port) == expected
                print(f"pin {pin}: woken in {time.perf_counter() - started:.2f} s, tokens = cold start's; {resume}")
                kill_replicas(artifact)
            status, _, err = _coldsnap("warm", artifact, env=env)
            assert status == 0, err[-2000:]
            kill_replicas(artifact)  # killed standby: nothing left, and status forgets it
            assert standbys() == [] and not _gpu_pids()
            status, _, err = _coldsnap("warm", artifact, "--ttl", "3", env=env)
            assert status == 0, err[-2000:]
            deadline = time.monotonic() + 20
            while replica_members(artifact) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert replica_members(artifact) == [], "an expired standby was still running"
            time.sleep(1)
            assert not _gpu_pids() and standbys() == []
            print("killed and expired standbys: no process, no CUDA context, no record left")
        finally:
            kill_replicas(artifact)


def replicas_on_gpu() -> None:
    """Replicas of one n610 capsule of the CUDA-graph workload (``COLDSNAP_CHECK_SIZE``, default 8b): one
    restore alone, then two at once on ports P and P+1 — on GPUs 0 and 1 where there are two, else both on
    GPU 0 — each timed from its `coldsnap restore` exec to its exit (the canary matched inside), both
    answering the cold start's greedy tokens. Writes the figures to ``COLDSNAP_CHECK_OUT`` (JSON) if set."""
    import json
    import threading
    import time

    from coldsnap.activation.qualification import ALLOW_UNQUALIFIED_DRIVER_ENV

    size = os.environ.get("COLDSNAP_CHECK_SIZE", "8b")
    port = _free_port()
    workload = [sys.executable, "-m", "coldsnap.workloads.torch_lm", "--size", size, "--device", "cuda", "--port", str(port)]
    expected = _cold_start_tokens(workload, port)
    gpus = ["0", "1"] if len(_cuda_uuids()) > 1 else ["0", "0"]
    figures: dict = {"size": size, "gpus": gpus}
    with tempfile.TemporaryDirectory() as scratch:
        env = {**os.environ, ALLOW_UNQUALIFIED_DRIVER_ENV: "1", "COLDSNAP_STATE_DIR": os.path.join(scratch, "state")}
        artifact = os.path.join(scratch, "artifact")
        started = time.perf_counter()
        status, receipt, err = _coldsnap("capture", "--out", artifact, "--", *workload, env=env)
        assert status == 0, (receipt.get("error"), err[-3000:])
        figures["capture_s"] = round(time.perf_counter() - started, 2)

        def restore(port: int, gpu: str, results: dict) -> None:
            began = time.perf_counter()
            results[port] = (*_coldsnap("restore", artifact, "--port", str(port), "--gpu", gpu, env=env),
                             time.perf_counter() - began, began)

        def phases(receipt: dict) -> dict[str, float]:
            return {s["name"]: round(s["duration_ns"] / 1e9, 3) for s in receipt["timing"]["spans"]}

        try:
            alone: dict = {}
            ports = [_free_port(), _free_port()]
            restore(ports[0], gpus[0], alone)
            status, receipt, err, seconds, _ = alone[ports[0]]
            assert status == 0, (receipt.get("error"), err[-2000:])
            assert _complete(ports[0]) == expected
            figures["one_restore_s"] = round(seconds, 3)
            figures["one_restore_phases_s"] = phases(receipt)
            print(f"one replica: {seconds:.2f} s; phases {phases(receipt)}")
            kill_replicas(artifact)
            time.sleep(1)

            both: dict = {}
            threads = [threading.Thread(target=restore, args=(p, g, both)) for p, g in zip(ports, gpus)]
            began = time.perf_counter()
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            wall = time.perf_counter() - began
            for p, gpu in zip(ports, gpus):
                status, receipt, err, seconds, _ = both[p]
                assert status == 0, (p, receipt.get("error"), err[-2000:])
                spans = {s["name"]: s.get("attributes", {}) for s in receipt["timing"]["spans"]}
                figures[f"replica_port{ports.index(p)}"] = {"gpu": gpu, "restore_s": round(seconds, 3),
                                                             "pid": spans["restore.criu_restore"]["pid"],
                                                             "phases_s": phases(receipt)}
                print(f"replica on port {p}, GPU {gpu}: {seconds:.2f} s; phases {phases(receipt)}")
            for p in ports:
                assert _complete(p) == expected, p
            figures["two_at_once_wall_s"] = round(wall, 3)
            figures["ratio_to_one"] = round(wall / figures["one_restore_s"], 3)
            figures["tokens_match_cold_start"] = True
            print(f"two replicas at once: {wall:.2f} s wall = {figures['ratio_to_one']}x one restore; "
                  f"both answer the cold start's tokens")
        finally:
            kill_replicas(artifact)
    if os.environ.get("COLDSNAP_CHECK_OUT"):
        with open(os.environ["COLDSNAP_CHECK_OUT"], "w") as out:
            json.dump(figures, out, indent=1)


def _cuda_uuids() -> list[str]:
    from coldsnap.snapshot.cuda_checkpoint import cuda_devices

    return [d["uuid"] for d in cuda_devices()]


CHECKS = {f.__name__: f for f in (vmm_roundtrip, torch_allocations_land_in_region, allocator_error_is_raised_in_python,
                                  hydration_bit_exact, host_region_tensor_view, cuda_checkpoint_roundtrip,
                                  torch_lm_cuda_graph_decode, staged_chunks_adopted_by_another_process,
                                  capture_restore_on_gpu, failure_hygiene_on_gpu, nccl_bridge_two_ranks, tp2_capture_restore_on_gpu,
                                  concurrent_hydrations_bit_exact, standby_on_gpu, replicas_on_gpu,
                                  local_memory_trim_around_checkpoint, engine_graph_pool_scratch_discarded)}

if __name__ == "__main__":
    if sys.argv[1] == "_nccl_rank":
        _nccl_rank(int(sys.argv[2]), sys.argv[3])
        sys.exit(0)
    try:
        CHECKS[sys.argv[1]]()
    except NeedsMoreGpus as exc:
        print(f"skipped: {exc}")
        sys.exit(SKIP)

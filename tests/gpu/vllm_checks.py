"""vLLM on the GPU, one check per process: ``python -m tests.gpu.vllm_checks NAME`` exits 0 when it holds.

Needs vLLM importable (on the H200: ``scripts/gpu-vllm.sh install`` and its site on PYTHONPATH); exits
SKIP (77) saying so otherwise. vLLM runs with its default flags (torch.compile, CUDA graphs; Model Runner
V2 on Hopper for dense models) as ``python -m vllm.entrypoints.cli.main serve`` (no console script in a
--target install). Every server's log is kept under ``COLDSNAP_CHECK_LOGS`` (default a temp dir).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

from coldsnap.demo import cold_start, sleep_wake_cycle
from coldsnap.activation.canary import ask_canary
from tests.gpu.gpu_checks import PROMPT_2, SKIP, NeedsMoreGpus, _coldsnap, _free_port

LOGS = Path(os.environ.get("COLDSNAP_CHECK_LOGS") or tempfile.mkdtemp(prefix="coldsnap-vllm-logs-"))
# vLLM 0.26 on the host: both samplers import flashinfer unless told not to; no hub.
VLLM_ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0", "HF_HUB_OFFLINE": "1", "COLDSNAP_ALLOW_UNQUALIFIED_DRIVER": "1",
            "NCCL_NVLS_ENABLE": "0"}
# vLLM 0.26's FlashInfer all-reduce + RMSNorm fusion (backend mnnvl) breaks TP 2 on the H200 pair with
# NVLS off: cuBLAS init failure and an illegal address in the first profile run, with or without
# coldsnap (benchmarks/results/2026-11-30-vllm-h200x2-tp2/). The TP checks turn the fusion off.
TP_FLAGS = ("--tensor-parallel-size", "2", "--compilation-config", '{"pass_config": {"fuse_allreduce_rms": false}}')
KV_LINE = re.compile(r"Available KV cache memory: ([0-9.]+) GiB")


def _complete(port: int) -> list[int]:
    """PROMPT_2's greedy token ids (the model's vocabulary outgrows its tokenizer: ids, not text)."""
    return ask_canary(port, PROMPT_2, 12).token_ids


class NoVllm(Exception):
    pass


def _vllm_serve(model: Path, port: int, *extra: str) -> list[str]:
    """``vllm serve`` of the tiny model; ``COLDSNAP_CHECK_VLLM_ARGS`` adds flags (a host's workarounds)."""
    more = shlex.split(os.environ.get("COLDSNAP_CHECK_VLLM_ARGS", ""))
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model), "--port", str(port),
            "--max-model-len", "256", "--gpu-memory-utilization", "0.3", *extra, *more]


def _env(**more: str) -> dict[str, str]:
    return {**os.environ, **VLLM_ENV, **more}


def _tiny_model() -> Path:
    model = Path(tempfile.gettempdir()) / "coldsnap-vllm-check" / "tiny-llama"
    if not (model / "model.safetensors").exists():
        subprocess.run([sys.executable, "-m", "coldsnap.workloads.tiny_llama", str(model)], check=True)
    return model


def _kv_gib(log: Path) -> float | None:
    found = KV_LINE.findall(log.read_text(errors="replace")) if log.exists() else []
    return float(found[-1]) if found else None


def _serve_and_ask(command: list[str], port: int, log: Path, env: dict[str, str], timeout: float = 480) -> tuple[float, list[int]]:
    """Start ``command`` plainly (output to ``log``), ask PROMPT_2 once it answers, stop it: (seconds to
    the first answer, token ids)."""
    return cold_start(command, port, timeout, env, log, PROMPT_2, 12)


def _require_vllm() -> str:
    try:
        import vllm  # noqa: F401
        import torch

        if not torch.cuda.is_available():
            raise NoVllm("no CUDA device")
    except ImportError as exc:
        raise NoVllm(f"vLLM is not importable here ({exc}); on the H200: scripts/gpu-vllm.sh install") from None
    from coldsnap_vllm.compat import vllm_version

    return vllm_version()


def _capture(artifact: Path, served: list[str], policy: dict | None = None) -> Path:
    """`coldsnap capture` of ``served --load-format coldsnap`` (with ``policy`` through a request file);
    asserts it succeeded and the KV cache was in its region; returns the engine's log."""
    from coldsnap.cli import capture_request

    command = [*served, "--load-format", "coldsnap"]
    if policy is None:
        arguments = ["--out", str(artifact), "--", *command]
    else:
        request = capture_request(["--out", str(artifact), "--operation-id", "gpu-check", "--", *command])
        request["policy"] = policy
        request_file = artifact.parent / "capture-request.json"
        request_file.write_text(json.dumps(request))
        arguments = ["--request-json", str(request_file)]
    started = time.perf_counter()
    status, receipt, err = _coldsnap("capture", *arguments, env=_env())
    engine_log = artifact / "logs" / "unit-0.log"
    if engine_log.exists():
        (LOGS / f"capture-engine{'-' + policy['graphs']['mode'] if policy else ''}.log").write_bytes(engine_log.read_bytes())
    print(err[-3000:])
    assert status == 0, json.dumps(receipt.get("error"), indent=1)
    spans = {s["name"]: s for s in receipt["timing"]["spans"]}
    print(f"capture {time.perf_counter() - started:.1f} s; phases:",
          {n: round(s["duration_ns"] / 1e9, 3) for n, s in spans.items()})
    print("prepare:", spans["capture.prepare"]["attributes"])
    print("dump:", spans["capture.criu_dump"]["attributes"])
    coldsnap_lines = [line for line in engine_log.read_text(errors="replace").splitlines() if "coldsnap" in line]
    print("engine's coldsnap lines:", *coldsnap_lines[-12:], sep="\n  ")
    assert any("KV cache in the kv_cache region" in line for line in coldsnap_lines), "KV cache not in its region"
    return engine_log


def _kill_restored(receipt: dict) -> None:
    """Kill the tree a restore receipt says it restored (its root's pid on this host), if it did."""
    from coldsnap.contracts.receipt import restored_pid
    from coldsnap.snapshot.process_tree import kill_tree

    pid = restored_pid(receipt) if receipt.get("timing") else None
    if pid is not None:
        kill_tree(pid)


def _restore_and_ask(artifact: Path, port: int, attempt: int, *flags: str) -> tuple[list[int], dict]:
    """`coldsnap restore [flags]`, then PROMPT_2's tokens from the restored server, which is stopped after:
    (tokens, the resume span's attributes)."""

    started = time.perf_counter()
    status, receipt, err = _coldsnap("restore", str(artifact), *flags, env=_env())
    seconds = time.perf_counter() - started
    print(err[-2000:])
    try:
        assert status == 0, json.dumps(receipt.get("error"), indent=1)
        spans = {s["name"]: s for s in receipt["timing"]["spans"]}
        print(f"restore {attempt}: {seconds:.2f} s (process); phases:",
              {n: round(s["duration_ns"] / 1e9, 3) for n, s in spans.items()})
        resume = spans["restore.resume"]["attributes"]
        print("resume:", resume)
        assert "restore.canary" in spans
        restored = _complete(port)
        print("restored tokens:", restored)
        return restored, resume
    finally:
        _kill_restored(receipt)
        time.sleep(0.5)


@contextlib.contextmanager
def _scene(*serve_args: str) -> Iterator[tuple[list[str], int, Path]]:
    """vLLM importable, the tiny model, a port: (the `vllm serve` command, its port, an artifact path in a
    scratch folder removed afterwards)."""
    print("vLLM", _require_vllm())
    port = _free_port()
    with tempfile.TemporaryDirectory() as scratch:
        yield _vllm_serve(_tiny_model(), port, *serve_args), port, Path(scratch) / "artifact"


def vllm_capture_restore_on_gpu() -> None:
    """`coldsnap capture -- vllm serve M --load-format coldsnap` (default flags), `coldsnap restore` twice
    from the pack and once with ``--weights recovery``: canary matched, PROMPT_2's greedy tokens = vLLM's
    default loader's, the KV cache in the kv_cache region, graphs retained (policy retain at TP 1),
    vLLM's KV budget with coldsnap's loader within 2 % of the default loader's."""
    with _scene() as (served, port, artifact):
        kv_coldsnap = _kv_gib(_capture(artifact, served))
        first, resume = _restore_and_ask(artifact, port, 0)
        assert not resume.get("graphs_recaptured")  # retain: the captured graphs replay
        again, _ = _restore_and_ask(artifact, port, 1)
        assert again == first
        # recovery: the weights refilled through vLLM's own loaders from the safetensors the capture pinned
        recovered, resume = _restore_and_ask(artifact, port, 2, "--weights", "recovery")
        assert resume["source"] == "recovery" and recovered == first, (resume, recovered)

    default_log = LOGS / "default-loader.log"
    seconds, expected = _serve_and_ask(served, port, default_log, _env())
    kv_default = _kv_gib(default_log)
    print(f"default loader: first answer after {seconds:.1f} s, tokens {expected}")
    print(f"KV budget: default loader {kv_default} GiB, coldsnap loader {kv_coldsnap} GiB")
    assert first == expected, f"restored {first}, vLLM's default loader {expected}"
    assert kv_default and kv_coldsnap and abs(kv_coldsnap - kv_default) <= 0.02 * kv_default


def vllm_recreate_on_gpu() -> None:
    """Graph policy ``recreate``: vLLM's graphs dropped at capture and captured again at restore; the
    restored server gives vLLM's default loader's tokens."""
    with _scene() as (served, port, artifact):
        _capture(artifact, served, policy={"graphs": {"mode": "recreate"}})
        restored, resume = _restore_and_ask(artifact, port, 0)
        assert resume.get("graphs_recaptured"), resume  # recreate: captured again after the restore
    seconds, expected = _serve_and_ask(served, port, LOGS / "default-loader.log", _env())
    assert restored == expected, f"recreate {restored}, default loader {expected}"


def _sleep_cycle(command: list[str], port: int, log: Path, env: dict[str, str]) -> dict:
    """Start ``command`` (with ``--enable-sleep-mode``), ask PROMPT_2, sleep at level 1, wake, ask again."""
    timed = sleep_wake_cycle(command, port, 480, env, log, PROMPT_2, 12)
    cycle = {"start_s": round(timed["start_s"], 1),
             **{k: round(timed[k], 3) for k in ("sleep_s", "wake_s", "first_completion_after_wake_s")},
             "before": timed["before"], "after": timed["after"], "kv_gib": _kv_gib(log)}
    print(log.stem, json.dumps(cycle))
    return cycle


def vllm_sleep_and_native_start_on_gpu() -> None:
    """Sleep level 1 + ``/wake_up`` through coldsnap's sleep backend (``--enable-sleep-mode`` with
    ``COLDSNAP_VLLM_SLEEP_BACKEND=coldsnap``), timed beside vLLM's own (default loader, cumem): the
    same tokens before and after, the default loader's, and KV budgets within 2 %; then a native start
    (``mode: native``) from the pack that coldsnap's sleep wrote: the weights come from the pack and the
    tokens are the default loader's."""
    with _scene("--enable-sleep-mode") as (served, port, artifact):
        packs = artifact.parent / "sleep-packs"
        ours = _sleep_cycle([*served, "--load-format", "coldsnap"], port, LOGS / "sleep-coldsnap.log",
                            _env(COLDSNAP_VLLM_SLEEP_BACKEND="coldsnap", COLDSNAP_SLEEP_PACK_DIR=str(packs)))
        assert ours["before"] == ours["after"], ours

        pack = json.loads((packs / "hibernation-rank0.json").read_text())["payload"]
        native_log = LOGS / "native-start.log"
        config = json.dumps({"mode": "native", "pack": pack})
        awake = [argument for argument in served if argument != "--enable-sleep-mode"]
        seconds, native = _serve_and_ask([*awake, "--load-format", "coldsnap", "--model-loader-extra-config", config],
                                         port, native_log, _env())
        assert "(native)" in native_log.read_text(errors="replace"), "the weights did not come from the pack"
        print(f"native start from {Path(pack).name}: first answer after {seconds:.1f} s, tokens {native}")

        own = _sleep_cycle(served, port, LOGS / "sleep-vllm.log", _env())  # vLLM's own: default loader, cumem
        assert own["before"] == own["after"], own
        assert ours["before"] == native == own["before"], (ours, native, own)
        assert own["kv_gib"] and ours["kv_gib"] and abs(ours["kv_gib"] - own["kv_gib"]) <= 0.02 * own["kv_gib"]
        print(f"wake → first completion: vLLM's cumem {own['wake_s'] + own['first_completion_after_wake_s']:.3f} s, "
              f"coldsnap's {ours['wake_s'] + ours['first_completion_after_wake_s']:.3f} s")


def vllm_tp2_default_start_on_gpu() -> None:
    """vLLM's own TP2 start on this host (default loader, no coldsnap): the baseline the TP2 check needs."""
    from tests.gpu.gpu_checks import _two_gpus

    _two_gpus()
    with _scene(*TP_FLAGS) as (served, port, _):
        seconds, tokens = _serve_and_ask(served, port, LOGS / "default-loader-tp2.log", _env(VLLM_PLUGINS=""), 300)
    print(f"TP2 default loader: first answer after {seconds:.1f} s, tokens {tokens}")


def vllm_tp2_capture_restore_on_gpu() -> None:
    """`--tensor-parallel-size 2` on two GPUs: capture (NCCL torn down inside vLLM's groups, both ranks
    CUDA-checkpointed), restore twice (NCCL rebuilt, graphs recaptured): the TP2 default loader's tokens."""
    from tests.gpu.gpu_checks import _two_gpus

    _two_gpus()
    with _scene(*TP_FLAGS) as (served, port, artifact):
        _capture(artifact, served)
        first, resume = _restore_and_ask(artifact, port, 0)
        assert resume.get("graphs_recaptured") and resume.get("rank1.graphs_recaptured"), resume
        again, _ = _restore_and_ask(artifact, port, 1)
    seconds, expected = _serve_and_ask(served, port, LOGS / "default-loader-tp2.log", _env())
    assert first == again == expected, f"restored {first} then {again}, TP2 default loader {expected}"


def vllm_n580_on_gpu() -> None:
    """`coldsnap capture --driver n580` of `vllm serve M --load-format coldsnap` (default flags): placement
    ABI 1 with vLLM's CLI, server and model code preloaded (a CUDA torch maps libcuda on import), and ABI 2
    with nothing preloaded; `coldsnap restore --port P` of each: the template placed on P, vLLM's own
    startup with its weights from the capture's pack, no unqualified-driver warning on driver 580, and
    PROMPT_2's greedy tokens = vLLM's default loader's."""

    env = {k: v for k, v in _env().items() if k != "COLDSNAP_ALLOW_UNQUALIFIED_DRIVER"}  # n580: 580 qualifies
    restored: dict[str, list[int]] = {}
    with _scene() as (served, port, artifact):
        for abi, preload in (("1", None), ("2", "")):
            capsule = artifact.parent / f"n580-abi{abi}"
            started = time.perf_counter()
            status, receipt, err = _coldsnap("capture", "--driver", "n580", "--placement-abi", abi,
                                             *(["--preload", preload] if preload is not None else []),
                                             "--out", str(capsule), "--", *served, "--load-format", "coldsnap", env=env)
            (LOGS / f"n580-abi{abi}-capture-engine.log").write_bytes((capsule / "logs" / "unit-0.log").read_bytes()
                                                                     if (capsule / "logs" / "unit-0.log").exists() else b"")
            print(err[-2000:])
            assert status == 0 and receipt["warnings"] == [], json.dumps(receipt.get("error") or receipt["warnings"])
            print(f"n580 ABI {abi} capture {time.perf_counter() - started:.1f} s:",
                  {s["name"]: round(s["duration_ns"] / 1e9, 3) for s in receipt["timing"]["spans"]})
            restored_port = _free_port()
            started = time.perf_counter()
            status, receipt, err = _coldsnap("restore", str(capsule), "--port", str(restored_port), env=env)
            seconds = time.perf_counter() - started
            try:
                print(err[-1500:])
                assert status == 0 and receipt["warnings"] == [], json.dumps(receipt.get("error") or receipt["warnings"])
                spans = {s["name"]: s for s in receipt["timing"]["spans"]}
                print(f"n580 ABI {abi} restore {seconds:.2f} s (process); phases:",
                      {n: round(s["duration_ns"] / 1e9, 3) for n, s in spans.items()})
                restored[abi] = _complete(restored_port)
                state_log = Path(spans["restore.criu_restore"]["attributes"]["state_dir"]) / "logs" / "unit-0.log"
                text = state_log.read_text(errors="replace")
                (LOGS / f"n580-abi{abi}-restored-engine.log").write_text(text)
                assert "hydrated from" in text and "(native)" in text, "the weights did not come from the pack"
            finally:
                _kill_restored(receipt)
                time.sleep(0.5)
    seconds, expected = _serve_and_ask(served, port, LOGS / "default-loader-n580.log", _env())
    print(f"default loader: first answer after {seconds:.1f} s, tokens {expected}; n580 restored {restored}")
    assert restored == {"1": expected, "2": expected}


def vllm_replicas_on_gpu() -> None:
    """Replicas of one `vllm serve --load-format coldsnap` capsule (default flags) on this GPU: one
    restore, then two at once on ports of their own (vLLM's API server, engine core and worker each in the
    replica's pid namespaces, its /dev/shm queues private): both canaries matched, both answering
    PROMPT_2 as vLLM's default loader does; each `coldsnap restore` timed from its exec to its exit."""
    import threading

    with _scene() as (served, port, artifact):
        _capture(artifact, served)
        alone_started = time.perf_counter()
        first, _ = _restore_and_ask(artifact, port, 0)
        alone = time.perf_counter() - alone_started
        ports = [_free_port(), _free_port()]
        results: dict[int, tuple[int, dict, str, float]] = {}

        def restore(replica_port: int) -> None:
            began = time.perf_counter()
            status, receipt, err = _coldsnap("restore", str(artifact), "--port", str(replica_port), env=_env())
            results[replica_port] = (status, receipt, err, time.perf_counter() - began)

        threads = [threading.Thread(target=restore, args=(p,)) for p in ports]
        began = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - began
        try:
            for replica_port in ports:
                status, receipt, err, seconds = results[replica_port]
                print(err[-1500:])
                assert status == 0, json.dumps(receipt.get("error"), indent=1)
                print(f"replica on port {replica_port}: {seconds:.2f} s (process)")
            answers = [_complete(p) for p in ports]
            print(f"one restore {alone:.2f} s (with its answer); two at once {wall:.2f} s wall; tokens {answers}")
            assert answers == [first, first]
        finally:
            for status, receipt, _, _ in results.values():
                _kill_restored(receipt)
    seconds, expected = _serve_and_ask(served, port, LOGS / "default-loader-replicas.log", _env())
    print(f"default loader: first answer after {seconds:.1f} s, tokens {expected}")
    assert first == expected, f"restored {first}, vLLM's default loader {expected}"


CHECKS = {f.__name__: f for f in (vllm_capture_restore_on_gpu, vllm_recreate_on_gpu, vllm_n580_on_gpu,
                                  vllm_sleep_and_native_start_on_gpu, vllm_tp2_default_start_on_gpu,
                                  vllm_tp2_capture_restore_on_gpu, vllm_replicas_on_gpu)}

if __name__ == "__main__":
    LOGS.mkdir(parents=True, exist_ok=True)
    try:
        CHECKS[sys.argv[1]]()
    except (NoVllm, NeedsMoreGpus) as exc:
        print(f"skipped: {exc}")
        sys.exit(SKIP)

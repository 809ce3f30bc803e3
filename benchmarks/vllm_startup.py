"""vLLM startup: `vllm serve` cold start vs `coldsnap restore` vs vLLM's sleep-mode wake-up, side by side.

    # GPU (H200 with vLLM 0.26 from scripts/gpu-vllm.sh), an 8B-shaped Llama built on the spot:
    python -m benchmarks.vllm_startup --device cuda --shape 8b --dir /tmp/vbench --out vllm-8b.json
    python -m benchmarks.vllm_startup --device cuda --shape 8b --dir /tmp/vbench --steps restore,cold-warm
    # CPU (vLLM's CPU build in .venv-vllm, tiny Llama): the older side-by-side of restore_latency.py
    python -m benchmarks.vllm_startup --repeat 3 --out vllm.json [--compile]

What is timed is what a user sees: a cold start from `vllm serve`'s exec to its first completion
(vLLM's default loader, safetensors in the page cache), a restore from `coldsnap restore`'s exec to its
exit after the canary matched. vLLM runs with its default flags (torch.compile, CUDA graphs).

Steps (``--steps``, run in the order given; results accumulate in ``DIR/vllm-startup.json``, so a run
can be split over several invocations, e.g. device calls of at most 10 minutes):

  model        write the model (``coldsnap.workloads.tiny_llama --shape``) unless it is there
  cold-empty   cold start with an empty vLLM compile cache (a fresh VLLM_CACHE_ROOT)
  capture      `coldsnap capture -- vllm serve M --load-format coldsnap` (warm compile cache)
  restore      ``--repeat`` restores, each checked: PROMPT_2's greedy token ids = the cold start's
  restore-4k   the same with ``COLDSNAP_CRIU_THP_FILL=0``: CRIU fills 4 KiB pages, as a stock CRIU does
  restore-1t   the same with ``COLDSNAP_CRIU_FILL_THREADS=0``: each process's pages read on one thread
  standby      ``--repeat`` times: `coldsnap warm` (exec → exit: the standby parked, its pack pinned), then
               `coldsnap wake` of it, timed from its exec to the canary's match and checked as a restore is
  restore-late the same with ``COLDSNAP_EARLY_RESTORE=0``: CRIU starts after the launcher's imports and the
               whole admission, not at its entry (coldsnap.activation.early_restore)
  restore-recovery  ``--repeat`` restores with ``--weights recovery``: the weights from the pinned safetensors
               (by the capture's recovery plan where it recorded one), as when the pack is missing or corrupt
  race         ``--repeat`` rounds of two ``coldsnap restore`` of the capsule onto its port at once: which won,
               how the other failed (``admission.port``, naming the winner) and how fast
  gpu-short    another process holds the GPU's memory but half of what the capsule needs: ``restore
               --prepare-only`` and ``restore`` must both be refused at admission (``admission.gpu_memory``);
               then one restore with the GPU free, the launcher's own GPU use sampled (nvidia-smi)
  restore-log  one restore with CRIU's timestamped log (``COLDSNAP_CRIU_LOG_LEVEL=3``), copied to
               ``DIR/criu-restore-v3.log``: where CRIU's step of a restore spends its time
  cold-warm    ``--repeat`` cold starts with the warm compile cache
  equality     restored equals cold: 256 token-id prompts (8 to 1500 tokens), greedy 64 tokens with logprobs,
               one at a time and at concurrency 32, a cold start (two concurrent passes; its answers kept in
               DIR/equality-cold-answers.json for the run's other artifact) and ``--equality-restores``
               restores (default 3, the first also concurrently): prompts that differ, largest logprob
               difference, per restore (benchmarks/equality.py)
  equality-cold    a second cold start of the same command asked the equality prompts one at a time, vs the
               first cold start's kept answers: how far two untouched starts differ
  equality-cold-empty  the same for a cold start that compiles anew (empty vLLM, Inductor and Triton caches, as
               a capture that is a fresh host's first start does), vs the kept cold start and every restore
  equality-native  the same for a plain start with ``--load-format coldsnap`` from the captured pack
  native       a start with ``--load-format coldsnap`` in mode native from the captured pack
  serving      serving speed: a cold-started and a restored server, same flags, ``--repeat`` runs each of
               vLLM's own load client (``vllm bench serve``, random 512-token prompts, 128 tokens out,
               256 prompts at concurrency 64, ignore-eos; one warm-up load first): output throughput,
               TTFT and TPOT medians; and the same greedy token ids over 16 prompts and the same text
               of one streamed completion
  sleep        vLLM's own ``--enable-sleep-mode`` (level 1): /sleep then /wake_up, timed; then the same
               through coldsnap's sleep backend (``COLDSNAP_VLLM_SLEEP_BACKEND=coldsnap``), whose
               /wake_up answers only after the canary matched
  dropped      page cache dropped (root): one restore and one cold start
  fresh-node   a node that holds nothing (benchmarks/fresh_node.py): the disk's O_DIRECT rates, cp of the artifact,
               publish into Debian's docker-registry on loopback (storage in /dev/shm where it fits), ``--repeat``
               pulls, ``--repeat`` `restore oci://` under a new state root with the page cache dropped, ``--repeat``
               cold-disk restores of the local artifact; and vLLM's cold start with the page cache dropped. Every
               restore answers FRESH_NODE_PROMPTS prompts as that cold start did; fresh-node.{json,md} beside --out

``--graphs recreate`` captures into DIR/artifact-recreate with `coldsnap capture --graphs recreate` (the
CUDA graphs dropped before the checkpoint, captured again by every restore); the steps then work on that
artifact and name their runs and results ``graphs=recreate``, beside the default artifact's.

Writes ``--out`` (JSON: every run with its phases), prints a table; ``--png`` draws the chart where
matplotlib is installed (else later, from the JSON, with ``--png-from``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator


from coldsnap.activation.canary import ask_canary  # noqa: E402
from coldsnap.demo import cold_start, first_answer, plain_server, sleep_wake_cycle  # noqa: E402
from coldsnap.atomic import write_atomic  # noqa: E402
from coldsnap.contracts.receipt import restored_pid  # noqa: E402
from coldsnap.snapshot.process_tree import kill_tree  # noqa: E402
from benchmarks.equality import EQUALITY_PROMPTS, EQUALITY_TOKENS, equality_answers, equality_summary, render_summary  # noqa: E402
from benchmarks.image_attribution import capsule_attribution, render_capsule  # noqa: E402
from benchmarks.common import (cold_start_figure, draw_medians, drop_caches, empty_compile_caches, receipt_timeline,  # noqa: E402
                               results_argument, run_folder, write_figures)

STEPS = ("model", "cold-empty", "capture", "restore", "restore-4k", "restore-1t", "restore-late", "standby", "restore-recovery", "restore-log", "race",
         "gpu-short", "cold-warm", "serving", "equality", "equality-cold", "equality-cold-empty", "equality-native", "native", "sleep", "dropped", "fresh-node")
PROMPT = "The second prompt, asked after the restore."
VLLM_ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0", "HF_HUB_OFFLINE": "1", "NCCL_NVLS_ENABLE": "0",
            "COLDSNAP_ALLOW_UNQUALIFIED_DRIVER": "1"}
LOG_PHASES = {  # vLLM 0.26's own log lines → phase names
    "weights load": r"Model loading took [0-9.]+ GiB (?:memory )?and ([0-9.]+) seconds",
    "torch.compile": r"torch\.compile took ([0-9.]+) s in total",
    "init engine (profile, KV cache, warm-up, graphs)": r"init engine .* took ([0-9.]+) s",
}
KV_LINE = r"Available KV cache memory: ([0-9.]+) GiB"


FRESH_NODE_PROMPTS = 8
"""Prompts (of the serving check's) every fresh-node and cold-disk restore answers as vLLM's cold start did."""

SERVE_LOAD = "512,128,256,64"
"""The serving step's load: input tokens, output tokens, prompts, concurrency (``--serve-load``)."""
SERVE_METRICS = ("output_throughput", "median_ttft_ms", "median_tpot_ms")
SERVE_CHECK_PROMPTS = 16
STREAM_PROMPT = "A streamed answer, asked once of each server and of no other request before it."


def serve_load(text: str) -> str:
    """``--serve-load``: four positive integers."""
    parts = text.split(",")
    if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: want input,output,prompts,concurrency (four positive integers)")
    return text


def tokens(port: int) -> list[int]:
    return ask_canary(port, PROMPT, 12).token_ids


def tokens_of(port: int, prompt: str) -> list[int]:
    return ask_canary(port, prompt, 16).token_ids


def serving_prompts() -> list[str]:
    return [f"Prompt {i} of the serving check: the restored server answers {i} like the cold one." for i in
            range(SERVE_CHECK_PROMPTS)]


def streamed_tokens(port: int, prompt: str, max_tokens: int) -> list[str]:
    """A streamed greedy completion (``stream: true``) through the OpenAI API, as its text pieces in order."""
    import urllib.request

    request = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(request).encode(),
                                 headers={"Content-Type": "application/json"})
    pieces = []
    with urllib.request.urlopen(req, timeout=120) as response:
        for line in response:
            line = line.strip()
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                pieces.append(json.loads(line[6:])["choices"][0]["text"])
    return pieces


def serve_command(model: Path, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model), "--port", str(port), *extra]


def parse_log(log: Path) -> dict[str, float]:
    text = log.read_text(errors="replace") if log.exists() else ""
    phases = {}
    for name, pattern in LOG_PHASES.items():
        found = re.findall(pattern, text)
        if found:
            phases[name] = float(found[-1])
    kv = re.findall(KV_LINE, text)
    if kv:
        phases["kv_cache_gib"] = float(kv[-1])
    return phases


class Bench:
    """The steps, for vLLM; an engine's benchmark subclasses it (``sglang_startup.py``)."""

    name = "vllm_startup"
    engine_env = VLLM_ENV
    load_client = "vllm bench serve"
    equality_engine = "vllm"  # how benchmarks/equality.py asks this engine

    def serve_command(self, *extra: str) -> list[str]:
        return serve_command(self.model, self.port, *extra)

    def parse_log(self, log: Path) -> dict[str, float]:
        return parse_log(log)

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.work = Path(args.dir)
        self.work.mkdir(parents=True, exist_ok=True)
        self.state_path = self.work / f"{self.name.replace('_', '-')}.json"
        self.state = json.loads(self.state_path.read_text()) if self.state_path.exists() else {
            "benchmark": self.name, "shape": args.shape, "device": args.device, "runs": []}
        link = self.work / f"llama-{args.shape}"
        # A linked model is served by its own path: every work directory's `vllm serve` (a variant's too) is then
        # the same command, sharing vLLM's compile cache and the kept cold-start answers.
        self.model = link.resolve() if link.is_symlink() else link
        # --graphs recreate: an artifact of its own beside the default's, its runs and results named for it
        self.graphs = getattr(args, "graphs", None)
        self.variant = f" graphs={self.graphs}" if self.graphs else ""
        self.artifact = self.work / ("artifact" if self.graphs is None else f"artifact-{self.graphs}")
        self.port = args.port
        self.cache = self.work / "vllm-cache"  # the warm compile cache every run but cold-empty shares
        self.load = [int(n) for n in args.serve_load.split(",")]

    def save(self) -> None:
        self.state["summary"] = summarize(self.state["runs"])
        document = (json.dumps(self.state, indent=1, sort_keys=True) + "\n").encode()
        write_atomic(self.state_path, document)
        if self.args.out:
            write_atomic(Path(self.args.out), document)

    def env(self, **more: str) -> dict[str, str]:
        """The engine's environment: its temporary files (ZeroMQ sockets a killed server leaves) in the work
        directory, not /tmp."""
        scratch = self.work / "tmp"
        scratch.mkdir(exist_ok=True)
        return {**self.engine_env, "VLLM_CACHE_ROOT": str(self.cache), "TMPDIR": str(scratch), **more}

    def record(self, **run: object) -> None:
        run["at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        self.state["runs"].append(run)
        print(json.dumps(run), flush=True)
        self.save()

    def expected(self) -> list[int] | None:
        return next((r["tokens"] for r in self.state["runs"] if r["kind"].startswith("cold start")), None)

    # steps ---------------------------------------------------------------------------------------

    def step_model(self) -> None:
        if (self.model / "coldsnap-tiny-model.json").exists():  # written last
            return
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "coldsnap.workloads.tiny_llama", str(self.model), "--shape", self.args.shape],
                       check=True)
        self.state["model_write_s"] = round(time.perf_counter() - started, 2)
        self.state["model_bytes"] = sum(p.stat().st_size for p in self.model.glob("*.safetensors"))
        self.save()

    def cold_start(self, kind: str, cache: str, env: dict[str, str], *extra: str) -> None:
        index = len(self.state["runs"])
        log = self.work / f"run{index}-{kind.replace(' ', '-')}.log"
        seconds, answer = cold_start(self.serve_command(*extra), self.port, 900, env, log, PROMPT, 12)
        expected = self.expected()
        self.record(kind=kind, cache=cache, seconds=round(seconds, 3), tokens=answer, phases=self.parse_log(log),
                    same_tokens=expected is None or answer == expected)

    def step_cold_empty(self) -> None:
        empty = self.work / f"vllm-cache-empty-{len(self.state['runs'])}"
        self.cold_start("cold start", "warm", self.env(VLLM_CACHE_ROOT=str(empty)), *self.args.vllm_args)
        self.state["runs"][-1]["compile_cache"] = "empty"
        self.save()

    def step_cold_warm(self) -> None:
        for _ in range(self.args.repeat):
            self.cold_start("cold start", "warm", self.env(), *self.args.vllm_args)
            self.state["runs"][-1]["compile_cache"] = "warm"
            self.save()

    def step_native(self) -> None:
        packs = sorted((self.artifact / "payload").glob("*.pack"))
        if not packs:
            raise SystemExit("native: capture first (no pack in the artifact)")
        config = json.dumps({"mode": "native", "pack": str(packs[0])})
        self.cold_start("native start", "warm", self.env(), *self.args.vllm_args, "--load-format", "coldsnap",
                        "--model-loader-extra-config", config)

    def step_capture(self) -> None:
        if (self.artifact / "artifact.json").exists():
            return
        receipt = self.work / f"capture-receipt{self.variant.replace(' ', '-')}.json"
        command = self.serve_command(*self.args.vllm_args, "--load-format", "coldsnap")
        graphs = ["--graphs", self.graphs] if self.graphs else []
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "coldsnap", "capture", "--out", str(self.artifact),
                               "--receipt-json", str(receipt), *graphs, "--", *command], env={**os.environ, **self.env()})
        seconds = time.perf_counter() - started
        document = json.loads(receipt.read_text())
        if done.returncode != 0:
            raise SystemExit(f"capture failed: {document.get('error')}")
        spans = {s["name"]: s for s in document["timing"]["spans"]}
        dump = spans["capture.criu_dump"]["attributes"]
        log = self.artifact / "logs" / "unit-0.log"
        capture = self.state["capture" + self.variant] = {
            "seconds": round(seconds, 2),
            "phases": {n: round(s["duration_ns"] / 1e9, 3) for n, s in spans.items()},
            "image_bytes": dump["image_bytes"],
            "non_model_bytes": dump["rss_after_release_bytes"] + dump["device_bytes_after_release"],
            "payload_bytes": sum(p.stat().st_size for p in (self.artifact / "payload").glob("*.pack")),
            "engine_log": self.parse_log(log),
        }
        capture["image_to_non_model"] = round(dump["image_bytes"] / capture["non_model_bytes"], 3)
        capture["zero_bytes_left_out"] = dump.get("zero_bytes_dropped", 0)
        attribution = capsule_attribution(self.artifact, document)
        capture["attribution"] = attribution
        print(json.dumps({k: v for k, v in capture.items() if k != "attribution"}), flush=True)
        print(render_capsule(attribution), flush=True)
        self.save()

    def restore(self, cache: str, env: dict[str, str] | None = None, flags: tuple[str, ...] = ()) -> None:
        """One ``coldsnap restore`` timed from its exec to the canary's match; ``env`` (e.g. the 4 KiB
        fill) and ``flags`` are named in the run's kind."""
        index = len(self.state["runs"])
        done, receipt, exec_ns, exit_ns = self.operation("restore", self.work / f"restore-{index}.json", env,
                                                         (*self.args.restore_args, *flags))
        answer = self.answer_then_kill(done, receipt, "restore")
        phases = receipt_timeline(receipt, exec_ns, exit_ns)
        seconds = phases.pop("exec → canary matched")  # the restore as the user sees it
        expected = self.expected()
        kind = " ".join(["restore", *self.args.restore_args, *flags, *(f"{k}={v}" for k, v in (env or {}).items())])
        kind += self.variant
        self.record(kind=kind, cache=cache, seconds=round(seconds, 3), tokens=answer, phases=phases,
                    same_tokens=expected is None or answer == expected, image_bytes=self.image_bytes())

    def operation(self, operation: str, receipt_path: Path, env: dict[str, str] | None = None,
                  flags: tuple[str, ...] = ()) -> tuple[subprocess.CompletedProcess, dict, int, int]:
        """`coldsnap OPERATION` of the capture (restore, warm, wake): the process, its receipt, and the
        wall-clock nanoseconds of its exec and exit."""
        exec_ns = time.time_ns()
        done = subprocess.run([sys.executable, "-m", "coldsnap", operation, str(self.artifact), "--receipt-json",
                               str(receipt_path), *flags], env={**os.environ, **self.env(), **(env or {})},
                              capture_output=True, text=True)
        exit_ns = time.time_ns()
        return done, json.loads(receipt_path.read_text()), exec_ns, exit_ns

    def answer_then_kill(self, done: subprocess.CompletedProcess, receipt: dict, what: str,
                         tree: dict | None = None) -> list[int]:
        """The benchmark prompt's greedy token ids from the server the operation ``what`` made serve
        (SystemExit when it failed); then its tree (the one ``tree``'s receipt restored, default
        ``receipt``'s) is killed."""
        try:
            if done.returncode != 0:
                raise SystemExit(f"{what} failed: {receipt.get('error')}\n{done.stderr[-2000:]}")
            return tokens(self.port)
        finally:
            pid = restored_pid(tree or receipt)
            if pid is not None:
                kill_tree(pid)
            time.sleep(0.5)

    def image_bytes(self) -> int | None:
        images = next((self.artifact / "units").glob("*/images"), None)
        return sum(f.stat().st_size for f in images.rglob("*") if f.is_file()) if images else None

    def step_restore(self) -> None:
        for _ in range(self.args.repeat):
            self.restore("warm")

    def step_restore_log(self) -> None:
        self.restore("warm", env={"COLDSNAP_CRIU_LOG_LEVEL": "3"})
        receipt = json.loads((self.work / f"restore-{len(self.state['runs']) - 1}.json").read_text())
        criu = next(s for s in receipt["timing"]["spans"] if s["name"].endswith(".criu_restore"))
        logs = sorted(Path(criu["attributes"]["state_dir"], "criu").glob("restore-*.log"), key=lambda p: p.stat().st_mtime)
        if logs:
            (self.work / "criu-restore-v3.log").write_bytes(logs[-1].read_bytes())

    def step_restore_4k(self) -> None:
        """Restores whose CRIU fills 4 KiB pages, as a stock CRIU does (the comparison for the huge-page
        fill, in the same run)."""
        for _ in range(self.args.repeat):
            self.restore("warm", env={"COLDSNAP_CRIU_THP_FILL": "0"})

    def step_restore_1t(self) -> None:
        """Restores whose CRIU reads each process's pages on one thread (the comparison for the parallel
        fill, in the same run)."""
        for _ in range(self.args.repeat):
            self.restore("warm", env={"COLDSNAP_CRIU_FILL_THREADS": "0"})

    def step_standby(self) -> None:
        """A warm standby, then its wake, ``--repeat`` times: the wake as the user sees it (exec → canary)."""
        for _ in range(self.args.repeat):
            index = len(self.state["runs"])
            warmed, warm_receipt, warm_exec_ns, warm_exit_ns = self.operation("warm", self.work / f"warm-{index}.json")
            if warmed.returncode != 0:
                raise SystemExit(f"warm failed: {warm_receipt.get('error')}\n{warmed.stderr[-2000:]}")
            woken, receipt, exec_ns, exit_ns = self.operation("wake", self.work / f"wake-{index}.json")
            answer = self.answer_then_kill(woken, receipt, "wake", tree=warm_receipt)
            phases = receipt_timeline(receipt, exec_ns, exit_ns)
            seconds = phases.pop("exec → canary matched")
            expected = self.expected()
            self.record(kind="wake" + self.variant, cache="warm", seconds=round(seconds, 3), tokens=answer,
                        phases=phases, warm_s=round((warm_exit_ns - warm_exec_ns) / 1e9, 3), same_tokens=expected is None or answer == expected)

    def step_restore_late(self) -> None:
        """Restores whose CRIU starts only once the launcher has imported everything and admitted the artifact
        (the comparison for the early start at the program's entry, in the same run)."""
        for _ in range(self.args.repeat):
            self.restore("warm", env={"COLDSNAP_EARLY_RESTORE": "0"})

    def step_restore_recovery(self) -> None:
        """Restores whose weights come from the pinned safetensors (``--weights recovery``), beside the
        native ones of the same run."""
        for _ in range(self.args.repeat):
            self.restore("warm", flags=("--weights", "recovery"))

    def _launch_restore(self, *flags: str) -> tuple[subprocess.Popen, Path, int]:
        receipt = self.work / f"restore-{len(self.state['runs'])}-{time.monotonic_ns()}.json"
        exec_ns = time.time_ns()
        launcher = subprocess.Popen([sys.executable, "-m", "coldsnap", "restore", str(self.artifact), "--receipt-json",
                                     str(receipt), *flags], env={**os.environ, **self.env()},
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        return launcher, receipt, exec_ns

    def step_race(self) -> None:
        """Two restores of the capsule onto its port at once, ``--repeat`` rounds: exactly one may serve."""
        for _ in range(self.args.repeat):
            racers = [self._launch_restore() for _ in range(2)]
            outcomes = []
            for launcher, receipt_path, exec_ns in racers:
                _, err = launcher.communicate(timeout=600)
                receipt = json.loads(receipt_path.read_text()) if receipt_path.exists() else {}
                finished_ns = receipt.get("finished_unix_ns", time.time_ns())  # (waited for in turn: the receipt's)
                outcomes.append({"exit": launcher.returncode, "state": receipt.get("state"), "error": receipt.get("error"),
                                 "seconds": round((finished_ns - exec_ns) / 1e9, 3), "pid": launcher.pid,
                                 "restored_pid": restored_pid(receipt) if receipt else None})
            winners = [o for o in outcomes if o["state"] == "succeeded"]
            answer = tokens(self.port) if winners else None
            for outcome in outcomes:
                if outcome["restored_pid"] is not None:
                    kill_tree(outcome["restored_pid"])
            time.sleep(0.5)
            expected = self.expected()
            self.state.setdefault("race", []).append({
                "winners": len(winners), "outcomes": outcomes,
                "same_tokens": answer is not None and (expected is None or answer == expected)})
            print(json.dumps(self.state["race"][-1]), flush=True)
            self.save()

    def step_gpu_short(self) -> None:
        """A process holds the GPU's memory but half of what the capsule needs: prepare-only and restore must
        be refused at admission; then one restore with the GPU free, the launcher's GPU use sampled."""
        capsule = json.loads(next((self.artifact / "units").glob("*/capsule.json")).read_text())
        need = sum(p["serving_bytes"] for p in capsule["metadata"].get("gpu_memory", []))
        free = int(subprocess.run(["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits", "-i", "0"],
                                  capture_output=True, text=True, check=True).stdout.split()[0]) << 20
        hold = max(0, free - need // 2)
        holder = subprocess.Popen([sys.executable, "-c", "import sys, time, torch\n"
                                   f"x = torch.empty({hold}, dtype=torch.uint8, device='cuda')\n"
                                   "print('held', flush=True)\ntime.sleep(600)"],
                                  stdout=subprocess.PIPE, text=True, env={**os.environ, **self.env()})
        result: dict = {"need_bytes": need, "free_before_bytes": free, "held_bytes": hold}
        try:
            assert holder.stdout is not None
            result["holder"] = holder.stdout.readline().strip()
            for flags in (("--prepare-only",), ()):
                launcher, receipt_path, exec_ns = self._launch_restore(*flags)
                _, err = launcher.communicate(timeout=600)
                receipt = json.loads(receipt_path.read_text()) if receipt_path.exists() else {}
                spans = {s["name"] for s in receipt.get("timing", {}).get("spans", [])}
                result["prepare-only" if flags else "restore"] = {
                    "exit": launcher.returncode, "error": receipt.get("error"),
                    "seconds": round((time.time_ns() - exec_ns) / 1e9, 3), "criu_ran": "restore.criu_restore" in spans}
                if restored_pid(receipt) is not None:
                    kill_tree(restored_pid(receipt))
        finally:
            holder.kill()
            holder.wait()
        # The launcher's own GPU use (its CUDA context: staging), sampled while a restore runs with room
        launcher, receipt_path, exec_ns = self._launch_restore()
        peak = 0
        while launcher.poll() is None:
            apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                                  capture_output=True, text=True).stdout
            for line in apps.splitlines():
                pid, _, used = line.partition(",")
                if pid.strip() == str(launcher.pid):
                    peak = max(peak, int(used.strip()) << 20)
            time.sleep(0.05)
        receipt = json.loads(receipt_path.read_text()) if receipt_path.exists() else {}
        if restored_pid(receipt) is not None:
            kill_tree(restored_pid(receipt))
        result["with_room"] = {"exit": launcher.returncode, "launcher_gpu_peak_bytes": peak}
        self.state["gpu_short"] = result
        print(json.dumps(result), flush=True)
        self.save()

    def step_dropped(self) -> None:
        if not drop_caches():
            print("dropped: cannot drop the page cache (not root): skipped", file=sys.stderr)
            return
        self.restore("cold")
        drop_caches()
        self.cold_start("cold start", "cold", self.env(), *self.args.vllm_args)
        self.state["runs"][-1]["compile_cache"] = "warm"
        self.save()

    def step_fresh_node(self) -> None:
        """A fresh node, beside vLLM's cold start from the same (cold) disk in the same run."""
        from benchmarks.fresh_node import measure, table

        if not (self.artifact / "artifact.json").exists():
            raise SystemExit("fresh-node: capture first")
        if not drop_caches():
            print("fresh-node: cannot drop the page cache (not root): skipped", file=sys.stderr)
            return
        prompts = serving_prompts()[:FRESH_NODE_PROMPTS]
        log = self.work / "fresh-node-cold-start.log"
        with plain_server(self.serve_command(*self.args.vllm_args), self.env(), log) as (process, started):
            cold_seconds, first = first_answer(self.port, started, process, 900, PROMPT, 12, log)
            cold = [tokens_of(self.port, p) for p in prompts]
        time.sleep(1)
        artifact_bytes = sum(f.stat().st_size for f in self.artifact.rglob("*") if f.is_file())
        shm = Path("/dev/shm")
        in_memory = shm.is_dir() and shutil.disk_usage(shm).free > 1.2 * artifact_bytes
        storage = shm / "coldsnap-fresh-registry" if in_memory else self.work / "registry"
        result = measure(self.artifact, self.work, storage, self.args.repeat,
                         lambda: tokens(self.port) == first and [tokens_of(self.port, p) for p in prompts] == cold,
                         env=self.env())
        result.update(cold_start_s=round(cold_seconds, 3), registry_in_memory=in_memory, prompts_checked=len(prompts) + 1)
        self.state["fresh_node"] = result
        self.save()
        out = Path(self.args.out).parent if self.args.out else self.work
        (out / "fresh-node.json").write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
        (out / "fresh-node.md").write_text(table(result) + "\n")
        print(table(result), flush=True)

    # serving speed after a restore ---------------------------------------------------------------

    def serving_load(self, label: str, backend: str = "vllm", env: dict[str, str] | None = None) -> dict[str, float]:
        """One run of vLLM's own load client (``vllm bench serve``) against the server on ``self.port``:
        ``self.load`` (random prompts of that many input tokens, output tokens each with ignore-eos, prompts,
        concurrency). Returns its output throughput (tokens/s) and TTFT / TPOT medians (ms)."""
        result = self.work / f"serve-{label}.json"
        result.unlink(missing_ok=True)
        command = [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve", "--backend", backend,
                   "--base-url", f"http://127.0.0.1:{self.port}", "--model", str(self.model),
                   "--dataset-name", "random", "--random-input-len", str(self.load[0]),
                   "--random-output-len", str(self.load[1]), "--num-prompts", str(self.load[2]),
                   "--max-concurrency", str(self.load[3]), "--ignore-eos", "--seed", "0", "--disable-tqdm",
                   "--save-result", "--result-dir", str(self.work), "--result-filename", result.name]
        with open(self.work / f"serve-{label}.log", "wb") as log:
            subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT,
                           env=env or {**os.environ, **self.env()})
        measured = json.loads(result.read_text())
        return {key: round(float(measured[key]), 3) for key in SERVE_METRICS}

    def serving_runs(self, label: str) -> dict:
        """The greedy token ids of SERVE_CHECK_PROMPTS prompts, one streamed completion's pieces (of a
        prompt neither server was asked before: a prefix cache filled by an earlier request changes the
        arithmetic, and SGLang's, caching prompts with their answers, did), then one warm-up load (a
        server's first load ran ~40 % slower on the H200, cold-started or restored alike: new batch
        shapes) and ``--repeat`` timed load runs."""
        return {"prompt_tokens": [tokens_of(self.port, p) for p in serving_prompts()],
                "streamed_tokens": streamed_tokens(self.port, STREAM_PROMPT, 32),
                "warmup": self.serving_load(f"{label}-warmup"),
                "loads": [self.serving_load(f"{label}-{i}") for i in range(self.args.repeat)]}

    def step_serving(self) -> None:
        """Serving speed and answers of a cold-started and a restored server with the same flags, one
        after the other on this GPU: ``--repeat`` load runs each (vLLM's own client), and the same
        greedy token ids over SERVE_CHECK_PROMPTS prompts and a streamed completion."""
        if not (self.artifact / "artifact.json").exists():
            raise SystemExit("serving: capture first")
        log = self.work / "serving-cold-start.log"
        with plain_server(self.serve_command(*self.args.vllm_args), self.env(), log) as (process, started):
            first_answer(self.port, started, process, 900, PROMPT, 12, log)
            cold = self.serving_runs("cold")
        time.sleep(1)
        with self.restored("serving"):
            restored = self.serving_runs("restored")
        medians = {}
        for key in SERVE_METRICS:
            cold_median = statistics.median(r[key] for r in cold["loads"])
            restored_median = statistics.median(r[key] for r in restored["loads"])
            medians[key] = {"cold start": cold_median, "restored": restored_median,
                            "restored / cold": round(restored_median / cold_median, 4) if cold_median else None}
        self.state["serving"] = {
            "load": {"input_tokens": self.load[0], "output_tokens": self.load[1], "prompts": self.load[2],
                     "concurrency": self.load[3], "repeat": self.args.repeat, "client": self.load_client},
            "cold start": cold["loads"], "restored": restored["loads"], "medians": medians,
            "warmup": {"cold start": cold["warmup"], "restored": restored["warmup"]},
            "same_prompt_tokens": cold["prompt_tokens"] == restored["prompt_tokens"],
            # the text, not its pieces: how a server cuts a stream into chunks depends on timing
            "same_streamed_text": "".join(cold["streamed_tokens"]) == "".join(restored["streamed_tokens"]),
            "streamed_text": {"cold start": "".join(cold["streamed_tokens"]), "restored": "".join(restored["streamed_tokens"])},
            "streamed_chunks": {"cold start": len(cold["streamed_tokens"]), "restored": len(restored["streamed_tokens"])},
            "prompts_checked": len(cold["prompt_tokens"]),
        }
        print(json.dumps(self.state["serving"]["medians"]), flush=True)
        self.save()

    @contextlib.contextmanager
    def restored(self, step: str) -> Iterator[dict[str, float]]:
        """One plain ``coldsnap restore`` of the capture, serving while the block runs, then killed; the block
        gets the restore's timeline (``receipt_timeline``: exec → canary matched and each phase)."""
        receipt_path = self.work / f"{step}-restore-{len(self.state['runs'])}-{time.time_ns()}.json"
        done, receipt, exec_ns, exit_ns = self.operation("restore", receipt_path)
        try:
            if done.returncode != 0:
                raise SystemExit(f"{step}: restore failed: {receipt.get('error')}\n{done.stderr[-2000:]}")
            yield receipt_timeline(receipt, exec_ns, exit_ns)
        finally:
            pid = restored_pid(receipt)
            if pid is not None:
                kill_tree(pid)

    def cold_equality_answers(self) -> dict:
        """A cold start's answers to the equality prompts (one pass one at a time, two concurrent), kept in the
        work directory for the command they came from: the default's and the ``--graphs recreate`` artifact's
        equality steps of one run compare against the same cold start."""
        command = self.serve_command(*self.args.vllm_args)
        kept = self.work / "equality-cold-answers.json"
        if kept.exists():
            document = json.loads(kept.read_text())
            if document["command"] == command and document.get("prompts", EQUALITY_PROMPTS) == self.args.equality_prompts:
                return document["answers"]
        log = self.work / "equality-cold-start.log"
        with plain_server(command, self.env(), log) as (process, started):
            first_answer(self.port, started, process, 900, PROMPT, 12, log)
            cold = equality_answers(self.port, prompts=self.args.equality_prompts, concurrent_passes=2,
                                    engine=self.equality_engine)
        write_atomic(kept, json.dumps({"command": command, "prompts": self.args.equality_prompts, "answers": cold}).encode())
        time.sleep(1)
        return cold

    def step_equality(self) -> None:
        """Restored equals cold on many prompts (:mod:`equality`): EQUALITY_PROMPTS token-id prompts of 8 to 1500
        tokens, greedy EQUALITY_TOKENS tokens with logprobs, one at a time and at concurrency 32, asked of a
        cold start (twice concurrently: the spread batching alone causes) and of ``--equality-restores``
        restores (the first also concurrently), one after the other on this GPU. Prints the prompts that
        differ and the largest logprob difference, per restore. Saved after each restore; a later equality
        step of the same work directory adds its restores to the ones there (device calls of 10 minutes)."""
        if not (self.artifact / "artifact.json").exists():
            raise SystemExit("equality: capture first")
        cold = self.cold_equality_answers()
        key = "equality" + self.variant
        summary = self.state.setdefault(key, {"prompts": self.args.equality_prompts, "tokens": EQUALITY_TOKENS, "restores": 0,
                                             "restore_phases": []})
        for _ in range(self.args.equality_restores):
            first = summary["restores"] == 0
            with self.restored("equality") as phases:
                restored = equality_answers(self.port, prompts=self.args.equality_prompts, engine=self.equality_engine,
                                            concurrent_passes=1 if first else 0)
            answers = self.work / f"equality-restored-answers{self.variant.replace(' ', '-')}-{summary['restores'] + 1}.json"
            write_atomic(answers, json.dumps(restored).encode())  # beside the cold ones: where a prompt diverged, how
            compared = equality_summary(cold, restored)
            summary["prompts"] = compared["one at a time: restored vs cold"]["prompts"]  # as asked
            if first:
                summary.update(compared)
            else:
                summary[f"one at a time: restore {summary['restores'] + 1} vs cold"] = compared["one at a time: restored vs cold"]
            summary["restores"] += 1
            summary["restore_phases"].append(phases)
            self.save()
        print(render_summary({k: v for k, v in summary.items() if isinstance(v, dict)}), flush=True)

    def other_start_equality(self, label: str, *extra: str, env: dict[str, str] | None = None) -> None:
        """Another server started plainly (``extra`` appended to the cold start's command, ``env`` its
        environment) asked the equality prompts one at a time, compared with the kept cold start's answers
        (``cold_equality_answers``): the spread between two starts that coldsnap never touched, the bar a
        restore is held to; and with every restore's answers of this work directory."""
        cold = self.cold_equality_answers()
        log = self.work / f"equality-{label.replace(' ', '-')}.log"
        with plain_server(self.serve_command(*self.args.vllm_args, *extra), env or self.env(), log) as (process, started):
            first_answer(self.port, started, process, 900, PROMPT, 12, log)
            other = equality_answers(self.port, prompts=self.args.equality_prompts, engine=self.equality_engine,
                                     concurrent_passes=0)
        write_atomic(self.work / f"equality-{label.replace(' ', '-')}-answers.json", json.dumps(other).encode())
        compared = equality_summary(cold, other)["one at a time: restored vs cold"]
        starts = self.state.setdefault("equality starts", {})
        starts[f"one at a time: {label} vs cold"] = compared
        for restored in sorted(self.work.glob("equality-restored-answers*.json")):
            # which start a restore answers like: the capture's process was one such start
            versus = equality_summary(json.loads(restored.read_text()), other)["one at a time: restored vs cold"]
            starts[f"one at a time: {label} vs {restored.stem}"] = versus
        self.save()
        print(render_summary({f"one at a time: {label} vs cold": compared}), flush=True)
        time.sleep(1)

    def step_equality_cold(self) -> None:
        """A second cold start (the same command) asked the equality prompts one at a time, vs the first's."""
        self.other_start_equality("second cold start")

    def step_equality_cold_empty(self) -> None:
        """A cold start that compiles anew — an empty vLLM compile cache, Inductor and Triton caches (as a
        capture on a fresh host does, the first start there) — asked the equality prompts one at a time,
        vs the kept cold start's answers (a warm compile cache) and every restore's: does a start that
        compiled and autotuned answer like one that loaded the compiled artifacts?"""
        fresh = self.work / f"compile-empty-{len(self.state.get('equality starts', {}))}"
        self.other_start_equality("cold start, empty compile cache", env=self.env(**empty_compile_caches(fresh)))

    def step_equality_native(self) -> None:
        """A plain start with ``--load-format coldsnap`` from the captured pack (no checkpoint, no restore)
        asked the equality prompts one at a time, vs the default loader's cold start: does the loader alone
        change the numbers?"""
        packs = sorted((self.artifact / "payload").glob("*.pack"))
        if not packs:
            raise SystemExit("equality-native: capture first (no pack in the artifact)")
        config = json.dumps({"mode": "native", "pack": str(packs[0])})
        self.other_start_equality("native start", "--load-format", "coldsnap", "--model-loader-extra-config", config)

    def sleep_cycle(self, kind: str, env: dict[str, str], *extra: str) -> None:
        index = len(self.state["runs"])
        log = self.work / f"run{index}-{kind.replace(' ', '-')}.log"
        command = self.serve_command(*self.args.vllm_args, "--enable-sleep-mode", *extra)
        timed = sleep_wake_cycle(command, self.port, 900, env, log, PROMPT, 12)
        wake, first_token = timed["wake_s"], timed["first_completion_after_wake_s"]
        self.record(kind=kind, cache="warm", seconds=round(wake + first_token, 3), tokens=timed["after"],
                    phases={"sleep (level 1)": round(timed["sleep_s"], 3), "wake_up": round(wake, 3),
                            "first completion after wake": round(first_token, 3),
                            "server start": round(timed["start_s"], 3)},
                    wake_answer=timed["wake_answer"], same_tokens=timed["after"] == timed["before"])

    def step_sleep(self) -> None:
        self.sleep_cycle("vllm sleep wake", self.env())
        packs = self.work / "sleep-pack"
        self.sleep_cycle("coldsnap sleep wake", self.env(VLLM_PLUGINS="coldsnap", COLDSNAP_VLLM_SLEEP_BACKEND="coldsnap",
                                                         COLDSNAP_SLEEP_PACK_DIR=str(packs)),
                         "--load-format", "coldsnap")


def _label(run: dict) -> str:
    compile_cache = f", {run['compile_cache']} compile cache" if "compile_cache" in run else ""
    return f"{run['kind']} ({run['cache']} page cache{compile_cache})"


def summarize(runs: list[dict]) -> dict[str, float]:
    groups: dict[str, list[float]] = {}
    for run in runs:
        groups.setdefault(_label(run), []).append(run["seconds"])
    summary = {label: round(statistics.median(values), 3) for label, values in groups.items()}
    restore = summary.get("restore (warm page cache)")
    for label in list(summary):
        if label.startswith("cold start (warm page cache") and restore:
            n = len(groups[label])  # the ratio names how many cold starts it divides by
            summary[f"speedup vs {label}, ÷ {n} cold start{'s' if n > 1 else ''}"] = round(summary[label] / restore, 1)
    return summary


def _engine(state: dict) -> str:
    return "SGLang " + state["sglang"] if "sglang" in state else f"vLLM {state.get('vllm', '')}"


def render(state: dict) -> str:
    engine = _engine(state)
    lines = [f"{engine} startup, {state['shape']} on {state['device']}: median seconds"]
    for label, value in state.get("summary", {}).items():
        runs = [r["seconds"] for r in state["runs"] if _label(r) == label]
        spread = f"  (n={len(runs)}, {min(runs)}–{max(runs)})" if len(runs) > 1 else "  (n=1)" if runs else "×"
        lines.append(f"  {label:<62} {value:>8}{spread}")
    restores = [r for r in state["runs"] if r["kind"] == "restore" and r["cache"] == "warm"]
    if restores:
        lines.append("  last warm restore's phases: " + ", ".join(f"{k} {v}" for k, v in restores[-1]["phases"].items()))
    budgets = {_label(r): r["phases"]["kv_cache_gib"] for r in state["runs"] if "kv_cache_gib" in r.get("phases", {})}
    for key, capture in state.items():
        if not key.startswith("capture"):
            continue
        lines.append(f"  {key} {capture['seconds']} s; image {capture['image_bytes'] / 2**30:.2f} GiB = "
                     f"{capture['image_to_non_model']}× non-model memory; pack {capture['payload_bytes'] / 2**30:.2f} GiB")
        if "kv_cache_gib" in capture.get("engine_log", {}):
            budgets["coldsnap loader (capture)"] = capture["engine_log"]["kv_cache_gib"]
    if budgets:
        lines.append("  KV cache budget (GiB): " + ", ".join(f"{k}: {v}" for k, v in budgets.items()))
    serving = state.get("serving")
    if serving:
        load = serving["load"]
        lines.append(f"  serving ({load['client']}, {load['prompts']} prompts of {load['input_tokens']} → "
                     f"{load['output_tokens']} tokens at concurrency {load['concurrency']}, median of {load['repeat']}):")
        for key, values in serving["medians"].items():
            lines.append(f"    {key:<20} cold start {values['cold start']:>10}  restored {values['restored']:>10}  "
                         f"restored/cold {values['restored / cold']}")
        lines.append(f"    same greedy token ids over {serving['prompts_checked']} prompts: {serving['same_prompt_tokens']}; "
                     f"same streamed text: {serving.get('same_streamed_text', serving.get('same_streamed_tokens'))}")
    for key, equality in state.items():
        if not key.startswith("equality") or key == "equality starts":
            continue
        lines.append(f"  restored equals cold{key[len('equality'):]} ({equality['prompts']} prompts, "
                     f"{equality['tokens']} greedy tokens, {equality.get('restores', 1)} restore(s)):")
        lines += ["    " + line for line in render_summary({k: v for k, v in equality.items() if isinstance(v, dict)}).splitlines()]
        if equality.get("restore_phases"):
            lines.append("    restores, exec → canary matched (s): " + ", ".join(
                str(round(p["exec → canary matched"], 3)) for p in equality["restore_phases"]))
    if state.get("equality starts"):
        lines.append("  plain starts vs the cold start (equality prompts):")
        lines += ["    " + line for line in render_summary(state["equality starts"]).splitlines()]
    if any(not r.get("same_tokens", True) for r in state["runs"]):
        lines.append("  WARNING: some run's tokens differ from the first cold start's")
    else:
        lines.append(f"  every run's greedy token ids = the first cold start's ({engine.split()[0]}'s default loader)")
    return "\n".join(lines)


def draw(state: dict, png: Path) -> bool:
    summary = {k: v for k, v in state["summary"].items() if not k.startswith("speedup")}
    return draw_medians(summary, f"{_engine(state)} {state['shape']} on {state['device']}: cold start vs coldsnap", png)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cuda: vLLM's GPU build (steps below); cpu: vLLM's CPU build")
    parser.add_argument("--shape", default="8b", choices=["tiny", "8b"], help="cuda: the model's shape (default 8b)")
    parser.add_argument("--steps", default=",".join(s for s in STEPS if s != "native"),
                        help=f"comma-separated, in order (default all but native): {', '.join(STEPS)}")
    parser.add_argument("--repeat", type=int, default=3, help="restores and warm cold starts (default 3)")
    parser.add_argument("--dir", help="work directory (keeps model, artifact, logs, state; default a temporary one)")
    parser.add_argument("--out", help="write the JSON here too")
    parser.add_argument("--png", help="draw the chart here (needs matplotlib)")
    parser.add_argument("--png-from", metavar="JSON", help="only draw --png from an earlier run's JSON")
    parser.add_argument("--port", type=int, default=18231)
    parser.add_argument("--vllm-arg", dest="vllm_args", action="append", default=[],
                        help="extra `vllm serve` argument (repeat; e.g. --vllm-arg=--gpu-memory-utilization=0.5)")
    parser.add_argument("--restore-arg", dest="restore_args", action="append", default=[],
                        help="extra `coldsnap restore` argument for the restore steps (repeat; e.g. --restore-arg=--host-thp)")
    parser.add_argument("--serve-load", default=SERVE_LOAD, type=serve_load,
                        help=f"serving step: input tokens,output tokens,prompts,concurrency (default {SERVE_LOAD})")
    add_variant_arguments(parser)
    parser.add_argument("--compile", action="store_true", help="cpu: keep torch.compile on (default --enforce-eager)")
    args, rest = parser.parse_known_args()
    if args.png_from:
        if not args.png:
            parser.error("--png-from needs --png")
        return 0 if draw(json.loads(Path(args.png_from).read_text()), Path(args.png)) else 1
    if args.device == "cpu":  # the older side-by-side on vLLM's CPU build
        from benchmarks.restore_latency import main as restore_latency_main  # noqa: E402

        sys.argv = [sys.argv[0], "--repeat", str(args.repeat), *(["--out", args.out] if args.out else []),
                    *(["--results", args.results] if args.results else []),
                    *(["--png", args.png] if args.png else []), *(["--compile"] if args.compile else []), *rest]
        return restore_latency_main(engine="vllm")
    if rest:
        parser.error(f"unknown arguments: {' '.join(rest)}")
    from coldsnap_vllm.compat import vllm_version

    return run_steps(Bench, parser, args, STEPS, "vllm", vllm_version())


def add_variant_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments both engines' startup benchmarks take for the artifact they capture and check."""
    results_argument(parser)
    parser.add_argument("--graphs", choices=["retain", "recreate"],
                        help="capture with `coldsnap capture --graphs POLICY` into DIR/artifact-POLICY (runs and results "
                        "named graphs=POLICY); default: the driver's policy, into DIR/artifact")
    parser.add_argument("--equality-restores", type=int, default=3,
                        help="equality step: restores asked the prompts one at a time (default 3; the first also concurrently)")
    parser.add_argument("--equality-prompts", type=int, default=EQUALITY_PROMPTS,
                        help=f"equality steps: how many prompts (default {EQUALITY_PROMPTS}; lengths 8 to 1500 tokens whatever "
                             "the count, the first the shortest and the last the longest)")


def run_steps(bench_class: type[Bench], parser: argparse.ArgumentParser, args: argparse.Namespace,
              known: tuple[str, ...], engine: str, version: str) -> int:
    """Run ``args.steps`` (checked against ``known``) of an engine's benchmark, then print its table."""
    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    unknown = [s for s in steps if s not in known]
    if unknown:
        parser.error(f"unknown step(s) {', '.join(unknown)}; steps are {', '.join(known)}")
    args.dir = args.dir or tempfile.mkdtemp(prefix=f"coldsnap-{engine}-bench-")
    folder = None
    if getattr(args, "results", None):
        try:
            folder = run_folder(engine, args.results)
        except ValueError as error:
            parser.error(str(error))
        args.out = str(folder / Path(args.out or f"{engine}-startup.json").name)
    bench = bench_class(args)
    bench.state[engine] = version
    for step in steps:
        print(f"{bench.name}: step {step}", file=sys.stderr, flush=True)
        getattr(bench, "step_" + step.replace("-", "_"))()
    bench.save()
    if folder:
        runs = bench.state["runs"]
        cold = [r["seconds"] for r in runs if r["kind"] == "cold start" and r["cache"] == "warm"
                and r.get("compile_cache", "warm") == "warm"]
        write_figures(folder, [cold_start_figure(f"{args.shape}-shaped Llama, {engine} {version}", kind,
                                                 [r["seconds"] for r in runs if r["kind"] == kind and r["cache"] == "warm"], cold)
                               for kind in ("restore", "wake") if any(r["kind"] == kind for r in runs)])
    print(render(bench.state))
    if args.png:
        draw(bench.state, Path(args.png))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Why does a restored vLLM server answer differently from a cold start? Answers, logprobs and GPU state
of a cold start, a capture's restores and variants of them, compared on the spot.

    python -m benchmarks.vllm_equality_diagnosis --dir /tmp/diag --model /tmp/coldsnap-llama-8b \\
        --steps cold,capture,restore,restore-recovery,restore-criu-4k,restore-reset-prefix-cache

Every server (the cold start too) runs ``vllm serve MODEL --load-format coldsnap`` with the state probe
(:mod:`benchmarks.vllm_state_probe`, vLLM's dev mode for ``/collective_rpc``). Each is asked the same
requests in the same order: the issue's eight text prompts (16 tokens), then ``--prompts`` token-id
prompts of 8 to 1500 tokens (``--tokens``), one at a time, greedy, with the chosen tokens' logprobs; then
the probe's digest. Steps (results accumulate in ``DIR/diagnosis.json``, so a run can span device calls):

  cold           the reference: a plain start (no capture)
  cold-again     a second plain start like ``cold``: how far two processes of one command differ on their own
  cold-empty     a plain start that compiles anew: empty vLLM compile, Inductor and Triton caches (as a capture
                 that is a fresh host's first vLLM start does), where ``cold`` loaded what an earlier start compiled
  attached       a plain start with coldsnap's agent attached (the capture's process before its snapshot)
  capture        ``coldsnap capture`` of the same command
  restore        ``coldsnap restore``
  restore-recovery   ``--weights recovery`` (the weights from the safetensors, not the pack)
  restore-criu-4k    CRIU's stock page fill (4 KiB pages, one thread: no THP or parallel fill)
  restore-reset-prefix-cache  a restore, then vLLM's ``/reset_prefix_cache``, then the requests
  capture-torch-graph-pool, restore-torch-graph-pool  a capture whose CUDA graphs' memory stays in torch's pool
                 (``COLDSNAP_VLLM_GRAPH_REGION=0``: saved by the checkpoint, not discarded and zeroed) and whose
                 stack limit is not lowered (``COLDSNAP_TRIM_LOCAL_MEMORY=0``), its restore
  capture-again, restore-again  a second capture of the same command into its own artifact, its restore: run
                 after ``capture`` (or ``cold``) it loads the compile cache an earlier start wrote, as ``cold`` does,
                 where a fresh host's first capture compiles
  capture-recreate, restore-recreate  a capture with ``--graphs recreate`` (graphs dropped before the
                 checkpoint, captured again by the restore), its restore

Prints, per server against ``cold``: prompts that differ, the largest logprob difference, and which
parameters, buffers and runner tensors hash differently.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import empty_compile_caches
from benchmarks.equality import (answers_from_json, answers_json, ask, ask_all, compare, equality_answers,
                                 equality_prompts, equality_summary, render_summary)
from coldsnap.activation.canary_probes import PROBES_ENV, ask_probe, float_of, parse_probes, probe_prompt
from coldsnap.activation.engine_process import post_empty, post_json
from coldsnap.agent.protocol import CONTROL_ENV
from coldsnap.atomic import write_atomic
from coldsnap.contracts.profiles import CANARY_PROMPT
from coldsnap.contracts.receipt import restored_pid
from coldsnap.demo import first_answer, plain_server
from coldsnap.snapshot.process_tree import kill_tree

ISSUE_PROMPTS = [f"Prompt number {i}: the history of the {w} is" for i, w in
                 enumerate(["river", "mountain", "city", "engine", "library", "garden", "ocean", "machine"])]
ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0", "HF_HUB_OFFLINE": "1", "NCCL_NVLS_ENABLE": "0",
       "COLDSNAP_ALLOW_UNQUALIFIED_DRIVER": "1", "VLLM_SERVER_DEV_MODE": "1"}
DIAGNOSIS_PROBES = "136:4,600:2,8:32,40:32,100:32,183:32,287:32"
"""The canary probes every diagnosis capture records (``COLDSNAP_CANARY_PROBES``): the default two, and prompts of
the graph sizes and decode lengths where a bad capture parted from the cold start. Every server is asked the
same prompts, so the capture's answers from before its snapshot (in its artifact) compare with the cold start's."""
STEPS = ("cold", "cold-again", "cold-empty", "attached", "capture", "restore", "restore-recovery", "restore-criu-4k", "restore-reset-prefix-cache",
         "capture-keep-prefix-cache", "restore-keep-prefix-cache", "capture-torch-graph-pool", "restore-torch-graph-pool",
         "capture-again", "restore-again", "capture-recreate", "restore-recreate", "equality")


class Diagnosis:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.work = Path(args.dir)
        self.work.mkdir(parents=True, exist_ok=True)
        self.path = self.work / "diagnosis.json"
        self.state: dict[str, Any] = json.loads(self.path.read_text()) if self.path.exists() else {"servers": {}}
        self.artifact = self.work / "artifact"
        self.prompts = equality_prompts(args.prompts, longest=args.longest)
        if "host" not in self.state:  # which GPU: the fault came on some hosts' captures and not on others'
            self.state["host"] = gpu_facts()
            print(f"host: {self.state['host']}", flush=True)

    def env(self, **more: str) -> dict[str, str]:
        scratch = self.work / "tmp"  # the servers' temporary files (ZeroMQ sockets a killed server leaves)
        scratch.mkdir(exist_ok=True)
        return {**os.environ, **ENV, "VLLM_CACHE_ROOT": str(self.work / "vllm-cache"), "TMPDIR": str(scratch), **more}

    def command(self) -> list[str]:
        return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(self.args.model), "--port",
                str(self.args.port), "--load-format", "coldsnap", "--worker-extension-cls",
                "benchmarks.vllm_state_probe.StateProbe", *self.args.vllm_args]

    def save(self) -> None:
        write_atomic(self.path, (json.dumps(self.state) + "\n").encode())

    def observe(self, name: str, **facts: Any) -> None:
        """Ask the requests of a server answering on the port, take its digest, record it."""
        port = self.args.port
        started = time.perf_counter()
        text = [ask(port, p, 16) for p in ISSUE_PROMPTS]
        ids = ask_all(port, self.prompts, self.args.tokens)
        probes = {}  # prompt length → answer (a prompt longer than the context is refused: left out, as a capture does)
        for length, tokens in parse_probes(DIAGNOSIS_PROBES):
            answer = ask_probe(port, probe_prompt(length), tokens)
            if answer is not None:
                probes[str(length)] = {"ids": answer.token_ids, "logprobs": answer.logprobs}
        digest = ask_worker(port, "coldsnap_state_digest")  # (without it there is nothing to compare: fails the step)
        kernels, configs, schedule = (ask_worker(port, method, or_error=True) for method in (
            "coldsnap_kernel_digest", "coldsnap_kernel_configs", "coldsnap_attention_schedule"))
        self.state["servers"][name] = {"text": answers_json(text), "ids": answers_json(ids), "probes": probes,
                                       "digest": digest,
                                       "kernels": kernels, "kernel_configs": configs, "attention_schedule": schedule,
                                       "asked_s": round(time.perf_counter() - started, 2), **facts}
        self.save()
        self.report(name)

    def report(self, name: str) -> None:
        servers = self.state["servers"]
        for other in sorted(set(servers) - {name, "cold"}):  # which server this one answers like (cold: below)
            ids = compare(answers_from_json(servers[other]["ids"]), answers_from_json(servers[name]["ids"]))
            text = compare(answers_from_json(servers[other]["text"]), answers_from_json(servers[name]["text"]))
            print(f"{name} vs {other}: issue prompts differ {text['differing']}/{text['prompts']}; id prompts differ "
                  f"{ids['differing']}/{ids['prompts']} (max {ids['largest_logprob_difference']:.3g})"
                  f"{_config_differences(servers[name], servers[other])}", flush=True)
        if name == "cold" or "cold" not in servers:
            print(f"{name}: recorded", flush=True)
            return
        cold, this = servers["cold"], servers[name]
        text = compare(answers_from_json(cold["text"]), answers_from_json(this["text"]))
        ids = compare(answers_from_json(cold["ids"]), answers_from_json(this["ids"]))
        print(f"{name} vs cold: issue prompts differ {text['differing']}/{text['prompts']} "
              f"(max |dlogprob| {text['largest_logprob_difference']:.3g}) {text['differing_prompts']}; "
              f"id prompts differ {ids['differing']}/{ids['prompts']} (max {ids['largest_logprob_difference']:.3g})",
              flush=True)
        for kind in ("params", "buffers", "runner"):
            a, b = cold["digest"].get(kind, {}), this["digest"].get(kind, {})
            changed = []
            for key in sorted(set(a) | set(b)):
                if a.get(key) != b.get(key):
                    x, y = a.get(key), b.get(key)
                    if kind != "runner" and isinstance(x, list) and isinstance(y, list) and len(x) == len(y):
                        blocks = [i for i, (p, q) in enumerate(zip(x, y)) if p != q]
                        changed.append(f"{key}[blocks {blocks[:6]}{'…' if len(blocks) > 6 else ''} of {len(x)}]")
                    else:
                        changed.append(key)
            print(f"  {kind}: {len(changed)} of {len(set(a) | set(b))} differ: {changed[:40]}", flush=True)
        sa, sb = cold.get("attention_schedule") or {}, this.get("attention_schedule") or {}
        if sa and sb:  # FA3's plans for the same fixed requests, computed in each process
            differing = sorted(k for k in set(sa) | set(sb) if sa.get(k) != sb.get(k))
            print(f"  attention schedule (FA3, fixed requests): {len(differing)} of {len(set(sa) | set(sb))} differ: "
                  f"{[(k, sa.get(k), sb.get(k)) for k in differing[:4]]}", flush=True)
        va, vb = cold["digest"].get("runner_values", {}), this["digest"].get("runner_values", {})
        for key in sorted(k for k in set(va) & set(vb) if va[k] != vb[k]):  # small integer tensors, by value
            print(f"  {key} nonzero [index, value]: cold {va[key][:8]} vs {name} {vb[key][:8]}", flush=True)
        ka, kb = cold.get("kernels", {}), this.get("kernels", {})
        print(f"  kernels: {sum(ka.get(k) != kb.get(k) for k in set(ka) | set(kb))} of {len(set(ka) | set(kb))} differ: "
              f"{[k for k in sorted(set(ka) | set(kb)) if ka.get(k) != kb.get(k)][:20]}{_config_differences(this, cold)}",
              flush=True)
        flags_a, flags_b = cold["digest"].get("flags", {}), this["digest"].get("flags", {})
        env_a, env_b = flags_a.get("env", {}), flags_b.get("env", {})
        print(f"  env differs: {[(k, env_a.get(k), env_b.get(k)) for k in sorted(set(env_a) | set(env_b)) if env_a.get(k) != env_b.get(k)]}")
        print(f"  flags differ: {[k for k in set(flags_a) | set(flags_b) if flags_a.get(k) != flags_b.get(k)]}; "
              f"kv nonzero bytes {cold['digest'].get('kv_nonzero_bytes')} vs {this['digest'].get('kv_nonzero_bytes')}",
              flush=True)

    def report_before_snapshot(self, name: str, artifact: Path) -> None:
        """The capture's own answers to the probes, asked of its process before the snapshot (its artifact's
        canary), against ``cold``'s and this restore's: did the captured process already answer differently,
        or did the snapshot and restore change it?"""
        servers = self.state["servers"]
        recorded = json.loads((artifact / "artifact.json").read_text())["canary"].get("probes") or []
        before = {str(len(p["prompt_ids"])): {"ids": list(p["token_ids"]), "logprobs": [float_of(b) for b in p["logprob_bits"]]}
                  for p in recorded}
        servers[name]["before_snapshot"] = before
        self.save()
        for other in ("cold", name):
            answers = servers.get(other, {}).get("probes") or {}
            lengths = sorted(set(before) & set(answers), key=int)
            if not lengths:
                continue
            result = compare(answers_from_json([before[k] for k in lengths]), answers_from_json([answers[k] for k in lengths]))
            parted = [(lengths[d["prompt"]], d["first_differing_token"]) for d in result["differing_prompts"]]
            print(f"  {artifact.name} before its snapshot vs {other}: probes of {','.join(lengths)} tokens differ "
                  f"{result['differing']}/{result['prompts']} (max {result['largest_logprob_difference']:.3g}) "
                  f"[(prompt tokens, first differing token)]: {parted}", flush=True)

    def plain(self, name: str, env: dict[str, str]) -> None:
        log = self.work / f"{name}.log"
        with plain_server(self.command(), env, log) as (process, started):
            seconds, _ = first_answer(self.args.port, started, process, 900, CANARY_PROMPT, 16, log)
            self.observe(name, start_s=round(seconds, 2))

    def step_cold(self) -> None:
        self.plain("cold", self.env())

    def step_cold_again(self) -> None:
        self.plain("cold-again", self.env())

    def step_cold_empty(self) -> None:
        fresh = self.work / f"compile-empty-{time.time_ns()}"
        self.plain("cold-empty", self.env(**empty_compile_caches(fresh)))

    def step_attached(self) -> None:
        """The agent attaches under ``coldsnap capture`` only (its control socket in the environment)."""
        self.plain("attached", self.env(**{CONTROL_ENV: f"@coldsnap-diagnosis-{os.getpid()}"}))

    def step_capture(self, artifact: Path | None = None, env: dict[str, str] | None = None, flags: tuple[str, ...] = ()) -> None:
        artifact = artifact or self.artifact
        if (artifact / "artifact.json").exists():
            return
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "coldsnap", "capture", "--out", str(artifact), "--receipt-json",
                               str(self.work / f"{artifact.name}-capture-receipt.json"), *flags, "--", *self.command()],
                              env={**self.env(), PROBES_ENV: DIAGNOSIS_PROBES, **(env or {})})
        print(f"capture: exit {done.returncode} in {time.perf_counter() - started:.1f} s", flush=True)
        if done.returncode != 0:
            raise SystemExit(1)

    def restore(self, name: str, flags: tuple[str, ...] = (), env: dict[str, str] | None = None,
                before: Any = None, artifact: Path | None = None, observe: Any = None) -> None:
        receipt_path = self.work / f"{name}-{time.time_ns()}-receipt.json"
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "coldsnap", "restore", str(artifact or self.artifact), "--receipt-json",
                               str(receipt_path), *flags], env={**self.env(), **(env or {})}, capture_output=True, text=True)
        seconds = time.perf_counter() - started
        receipt = json.loads(receipt_path.read_text())
        try:
            if done.returncode != 0:
                raise SystemExit(f"{name}: restore failed: {receipt.get('error')}\n{done.stderr[-3000:]}")
            if before is not None:
                before()
            (observe or self.observe)(name, restore_s=round(seconds, 2))
            self.report_before_snapshot(name, artifact or self.artifact)
        finally:
            pid = restored_pid(receipt)
            if pid is not None:
                kill_tree(pid)
            time.sleep(0.5)

    def step_restore(self) -> None:
        self.restore("restore")

    def step_restore_recovery(self) -> None:
        self.restore("restore-recovery", flags=("--weights", "recovery"))

    def step_restore_criu_4k(self) -> None:
        self.restore("restore-criu-4k", env={"COLDSNAP_CRIU_THP_FILL": "0", "COLDSNAP_CRIU_FILL_THREADS": "0"})

    def step_restore_reset_prefix_cache(self) -> None:
        self.restore("restore-reset-prefix-cache", before=lambda: post_empty(self.args.port, "/reset_prefix_cache"))


    def step_capture_keep_prefix_cache(self) -> None:
        """A capture whose restores keep vLLM's prefix cache (the behaviour before the fix)."""
        self.step_capture(self.work / "artifact-keep-prefix-cache", {"COLDSNAP_VLLM_KEEP_PREFIX_CACHE": "1"})

    def step_restore_keep_prefix_cache(self) -> None:
        self.restore("restore-keep-prefix-cache", artifact=self.work / "artifact-keep-prefix-cache")

    def step_capture_torch_graph_pool(self) -> None:
        self.step_capture(self.work / "artifact-torch-graph-pool", {"COLDSNAP_VLLM_GRAPH_REGION": "0",
                                                                             "COLDSNAP_TRIM_LOCAL_MEMORY": "0"})

    def step_restore_torch_graph_pool(self) -> None:
        self.restore("restore-torch-graph-pool", artifact=self.work / "artifact-torch-graph-pool")

    def step_capture_again(self) -> None:
        self.step_capture(self.work / "artifact-again")

    def step_restore_again(self) -> None:
        self.restore("restore-again", artifact=self.work / "artifact-again")

    def step_capture_recreate(self) -> None:
        self.step_capture(self.work / "artifact-recreate", flags=("--graphs", "recreate"))

    def step_restore_recreate(self) -> None:
        self.restore("restore-recreate", artifact=self.work / "artifact-recreate")

    def step_equality(self) -> None:
        """:mod:`benchmarks.equality`'s prompt set: a cold start (two concurrent passes: the spread that
        batching alone causes) against a restore of the capture."""
        log = self.work / "equality-cold.log"
        with plain_server(self.command(), self.env(), log) as (process, started):
            first_answer(self.args.port, started, process, 900, CANARY_PROMPT, 16, log)
            cold = equality_answers(self.args.port, concurrent_passes=2)
        restored: dict[str, Any] = {}
        self.restore("equality-restore", observe=lambda name, **facts: restored.update(equality_answers(self.args.port)))
        self.state["equality"] = equality_summary(cold, restored)
        self.state["equality_answers"] = {"cold": cold, "restored": restored}
        self.save()
        print(render_summary(self.state["equality"]), flush=True)


def ask_worker(port: int, method: str, or_error: bool = False) -> Any:
    """The serving worker's answer to the state probe's ``method`` (vLLM's ``/collective_rpc``); with ``or_error``,
    ``{"error": ...}`` where it could not answer (an HTTP error included: e.g. the layers could not run eagerly)."""
    try:
        return post_json(port, "/collective_rpc", {"method": method}, 600)["results"][0]
    except OSError as exc:
        if not or_error:
            raise
        return {"error": str(exc)}


GPU_FACTS = "name,uuid,serial,vbios_version,driver_version,clocks.max.sm,clocks.max.mem,ecc.mode.current,pci.bus_id"


def gpu_facts() -> list[str] | str:
    """nvidia-smi's line per GPU (:data:`GPU_FACTS`), or why there is none."""
    try:
        done = subprocess.run(["nvidia-smi", f"--query-gpu={GPU_FACTS}", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"no nvidia-smi: {exc}"
    return done.stdout.strip().splitlines() if done.returncode == 0 else f"nvidia-smi exited {done.returncode}"


def _config_differences(this: dict[str, Any], other: dict[str, Any]) -> str:
    """The Inductor Triton kernels whose chosen launch config differs between two servers (``other``'s,
    ``this``'s), as a clause for a report line; empty when either did not report them."""
    mine, theirs = this.get("kernel_configs") or {}, other.get("kernel_configs") or {}
    if not mine or not theirs or "error" in mine or "error" in theirs:
        return ""
    keys = sorted(set(mine) | set(theirs))
    differing = [(k, theirs.get(k), mine.get(k)) for k in keys if mine.get(k) != theirs.get(k)]
    return f"; Triton kernel configs differ: {len(differing)} of {len(keys)} {differing[:8]}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--steps", default=",".join(STEPS))
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--longest", type=int, default=1500, help="the longest prompt (tokens)")
    parser.add_argument("--port", type=int, default=18251)
    parser.add_argument("--vllm-arg", dest="vllm_args", action="append", default=[])
    args = parser.parse_args()
    diagnosis = Diagnosis(args)
    for step in args.steps.split(","):
        if step not in STEPS:
            parser.error(f"unknown step {step!r}; steps: {', '.join(STEPS)}")
        print(f"== {step}", flush=True)
        started = time.perf_counter()
        try:
            getattr(diagnosis, "step_" + step.replace("-", "_"))()
        except SystemExit as exc:
            print(f"{step} failed: {exc}", flush=True)
        except Exception as exc:  # noqa: BLE001 - the next steps still run; the failure is printed
            print(f"{step} failed: {type(exc).__name__}: {exc}", flush=True)
        print(f"== {step}: {time.perf_counter() - started:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

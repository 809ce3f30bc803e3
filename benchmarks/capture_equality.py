"""Equality across captures: does every capture restore to a server that answers like a plain start of its command?

    # GPU (vLLM 0.26 from scripts/gpu-engine.sh, the 8B-shaped Llama), the host's first vLLM start a capture:
    python -m benchmarks.capture_equality --device cuda --shape 8b --dir /tmp/ceq --steps capture,plain --out ceq.json
    python -m benchmarks.capture_equality --device cuda --shape 8b --dir /tmp/ceq --steps capture,capture
    # vLLM's CPU build (run with .venv-vllm's python), each capture compiling into empty caches:
    python -m benchmarks.capture_equality --dir /tmp/ceq --steps capture-empty,capture-empty,capture-empty,plain \\
        --vllm-arg=--max-model-len=2048

Each ``capture`` is `coldsnap capture -- vllm serve M --load-format coldsnap` as a user runs it (its reference
check on: a plain start of the command first, the captured engine's answers equal to it; what the check met is
recorded: matched, retried, or failed and nothing committed), then one `coldsnap restore` of it (exec → canary),
asked ``--prompts`` token-id prompts of 8 to ``--longest`` tokens (benchmarks/equality.py), greedy ``--tokens``
tokens with every logprob, one at a time, each once, in the same order; then the restored tree is killed and the
artifact removed (the GPU host's disk holds two 8B artifacts at most). ``capture-empty`` does the same into empty
vLLM, Inductor and Triton caches of its own. ``plain`` is a plain start of the same command asked the same
prompts: every capture's restore is compared with it, prompt by prompt, ids and logprobs (no tolerance).

Steps accumulate in ``DIR/capture-equality.json`` across invocations (device calls of ten minutes), so the
captures can come before the plain start: the first capture of a fresh host is then the host's first vLLM start,
as the deviant captures were. Writes ``--out`` and prints a table, one row per capture.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import empty_compile_caches
from benchmarks.equality import answers_from_json, compare, equality_answers
from benchmarks.vllm_startup import VLLM_ENV, serve_command
from coldsnap.atomic import write_atomic
from coldsnap.contracts.receipt import restored_pid
from coldsnap.demo import first_answer, plain_server
from coldsnap.snapshot.process_tree import kill_tree

STEPS = ("capture", "capture-empty", "plain")
CPU_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1"}
CHECK_PROMPT = "A plain start's first request, before the equality prompts."


class CaptureEquality:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.work = Path(args.dir).resolve()
        self.work.mkdir(parents=True, exist_ok=True)
        self.state_path = self.work / "capture-equality.json"
        self.state = json.loads(self.state_path.read_text()) if self.state_path.exists() else {
            "benchmark": "capture_equality", "device": args.device, "shape": args.shape, "prompts": args.prompts,
            "tokens": args.tokens, "longest": args.longest, "captures": []}
        for key in ("prompts", "tokens", "longest"):
            if self.state[key] != getattr(args, key):
                raise SystemExit(f"{self.state_path} was asked {key}={self.state[key]}; this run asks {getattr(args, key)}")
        self.scratch = Path(tempfile.mkdtemp(prefix="ceq-"))
        model = self.work / f"llama-{args.shape}"
        self.model = model.resolve() if model.is_symlink() else model
        self.command = [*serve_command(self.model, args.port, *args.vllm_args), "--load-format", "coldsnap"]

    def env(self, **more: str) -> dict[str, str]:
        """The servers' environment: their temporary files (vLLM's ZeroMQ ipc:// sockets, whose paths must stay
        under 108 bytes) in a short folder of this run's, removed at its end."""
        device_env = VLLM_ENV if self.args.device == "cuda" else CPU_ENV
        return {**os.environ, **device_env, "VLLM_CACHE_ROOT": str(self.work / "vllm-cache"), "TMPDIR": str(self.scratch),
                **more}

    def save(self) -> None:
        self.state["summary"] = summarize(self.state)
        document = (json.dumps(self.state, indent=1, sort_keys=True) + "\n").encode()
        write_atomic(self.state_path, document)
        if self.args.out:
            write_atomic(Path(self.args.out), document)

    def answers(self) -> dict:
        return equality_answers(self.args.port, prompts=self.args.prompts, tokens=self.args.tokens, concurrent_passes=0,
                                longest=self.args.longest)

    def step_plain(self) -> None:
        """A plain start of the captured command, asked the prompts: what every restore must give back."""
        log = self.work / "plain-start.log"
        with plain_server(self.command, self.env(), log) as (process, started):
            seconds, _ = first_answer(self.args.port, started, process, 1800, CHECK_PROMPT, 4, log)
            answers = self.answers()
        write_atomic(self.work / "plain-answers.json", json.dumps(answers).encode())
        self.state["plain"] = {"start_s": round(seconds, 1), "one_at_a_time_s": answers["one_at_a_time_s"],
                               "at": time.strftime("%Y-%m-%dT%H:%M:%S")}
        print(f"plain start: first answer after {seconds:.1f} s", flush=True)
        time.sleep(1)

    def step_capture(self, empty: bool = False) -> None:
        index = len(self.state["captures"]) + 1
        artifact, receipt_path = self.work / f"artifact-{index}", self.work / f"capture-{index}-receipt.json"
        shutil.rmtree(artifact, ignore_errors=True)
        caches = empty_compile_caches(self.work / f"compile-empty-{index}") if empty else {}
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "coldsnap", "capture", "--out", str(artifact), "--receipt-json",
                               str(receipt_path), *self.args.capture_args, "--", *self.command], env=self.env(**caches))
        record: dict = {"capture": index, "compile_caches": "empty" if empty else "shared",
                        "capture_s": round(time.perf_counter() - started, 1), "at": time.strftime("%Y-%m-%dT%H:%M:%S")}
        receipt = json.loads(receipt_path.read_text())
        spans = {s["name"]: s["attributes"] for s in receipt["timing"]["spans"]}
        record["reference"] = {**spans.get("capture.reference_start", {}), **spans.get("capture.reference", {})}
        if done.returncode != 0:
            record["committed"] = False
            record["error"] = receipt.get("error")
        else:
            record["committed"] = True
            record["reference_record"] = {k: v for k, v in json.loads((artifact / "artifact.json").read_text())
                                          ["reference"].items() if k not in ("probes", "canary_token_ids")}
            record.update(self.restore_and_ask(artifact, index))
        shutil.rmtree(artifact, ignore_errors=True)
        shutil.rmtree(self.work / f"compile-empty-{index}", ignore_errors=True)
        self.state["captures"].append(record)
        self.save()
        print(json.dumps({k: v for k, v in record.items() if k != "reference_record"}), flush=True)

    def restore_and_ask(self, artifact: Path, index: int) -> dict:
        """One restore of ``artifact`` (exec → exit, the canary matched), asked the prompts, killed."""
        receipt_path = self.work / f"restore-{index}-receipt.json"
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "coldsnap", "restore", str(artifact), "--receipt-json",
                               str(receipt_path)], env=self.env(), capture_output=True, text=True)
        restore_s = time.perf_counter() - started
        receipt = json.loads(receipt_path.read_text())
        try:
            if done.returncode != 0:
                return {"restored": False, "restore_error": receipt.get("error"), "restore_stderr": done.stderr[-2000:]}
            answers = self.answers()
        finally:
            pid = restored_pid(receipt)
            if pid is not None:
                kill_tree(pid)
            time.sleep(1)
        write_atomic(self.work / f"restore-{index}-answers.json", json.dumps(answers).encode())
        # what the restore's own check costs: its canary and probes (spans on the launcher's clock)
        check = {s["name"]: round(s["duration_ns"] / 1e9, 4) for s in receipt["timing"]["spans"]
                 if s["name"] in ("restore.canary", "restore.canary_probes")}
        return {"restored": True, "restore_s": round(restore_s, 3), "restore_check_s": check,
                "one_at_a_time_s": answers["one_at_a_time_s"]}


def summarize(state: dict) -> dict:
    """The totals the goal names: captures tried, committed, compared with the plain start, equal to it."""
    def equal(capture: dict) -> bool:
        versus = capture.get("versus_plain")
        return versus is not None and versus["differing"] == 0 and versus["largest_logprob_difference"] == 0.0

    captures = state["captures"]
    return {"captures": len(captures), "committed": sum(1 for c in captures if c.get("committed")),
            "compared": sum(1 for c in captures if c.get("versus_plain")), "equal_to_plain": sum(map(equal, captures))}


def compare_all(bench: CaptureEquality) -> None:
    plain_path = bench.work / "plain-answers.json"
    if not plain_path.exists():
        return
    plain = answers_from_json(json.loads(plain_path.read_text())["one_at_a_time"])
    for record in bench.state["captures"]:
        restored = bench.work / f"restore-{record['capture']}-answers.json"
        if record.get("restored") and restored.exists():
            record["versus_plain"] = compare(plain, answers_from_json(json.loads(restored.read_text())["one_at_a_time"]))
    bench.save()


def render(state: dict) -> str:
    rows = [f"{'capture':>7}  {'caches':>6}  {'reference check':<34}  {'restore':>8}  prompts differing from the plain start"]
    for c in state["captures"]:
        reference = c.get("reference", {})
        if not c.get("committed"):
            check = f"failed: {(c.get('error') or {}).get('code')}"
        elif reference.get("mode") == "none":
            check = "skipped"
        else:
            check = ("matched" if reference.get("matched_first") else "matched on the retry") + \
                f" ({reference.get('plain_starts', 0)}+{reference.get('capture_starts', 0)} starts)"
        versus = c.get("versus_plain")
        compared = (f"{versus['differing']}/{versus['prompts']} (largest |logprob difference| "
                    f"{versus['largest_logprob_difference']:.3g})") if versus else "-"
        restore = f"{c['restore_s']:.2f} s" if c.get("restore_s") is not None else "-"
        rows.append(f"{c['capture']:>7}  {c['compile_caches']:>6}  {check:<34}  {restore:>8}  {compared}")
    summary = state.get("summary", {})
    rows.append(f"{summary.get('equal_to_plain', 0)} of {summary.get('compared', 0)} compared captures equal to the plain "
                f"start on every prompt; {summary.get('committed', 0)} of {summary.get('captures', 0)} committed")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.capture_equality", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--shape", default="tiny", help="the model DIR/llama-SHAPE (written with coldsnap.workloads."
                        "tiny_llama --shape SHAPE when missing)")
    parser.add_argument("--dir", required=True, help="work directory (model link, answers, receipts, results)")
    parser.add_argument("--steps", default="capture,plain", help=f"comma-separated, in order: {', '.join(STEPS)}")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--longest", type=int, default=1500, help="longest prompt (tokens); under the served context")
    parser.add_argument("--port", type=int, default=18261)
    parser.add_argument("--vllm-arg", dest="vllm_args", action="append", default=[], metavar="ARG",
                        help="one more `vllm serve` argument (repeatable), e.g. --vllm-arg=--enforce-eager")
    parser.add_argument("--capture-arg", dest="capture_args", action="append", default=[], metavar="ARG",
                        help="one more `coldsnap capture` argument (repeatable), e.g. --capture-arg=--reference=none")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args(argv)
    steps = [s for s in args.steps.split(",") if s]
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        parser.error(f"unknown steps {unknown}: one of {', '.join(STEPS)}")
    bench = CaptureEquality(args)
    if not (bench.model / "coldsnap-tiny-model.json").exists():
        subprocess.run([sys.executable, "-m", "coldsnap.workloads.tiny_llama", str(bench.model), "--shape", args.shape],
                       check=True)
    try:
        for step in steps:
            print(f"== {step}", flush=True)
            if step == "plain":
                bench.step_plain()
            else:
                bench.step_capture(empty=step == "capture-empty")
            compare_all(bench)
    finally:
        shutil.rmtree(bench.scratch, ignore_errors=True)
    bench.save()
    print(render(bench.state), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

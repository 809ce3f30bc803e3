"""SGLang with speculative decoding: `coldsnap restore` of a target with its STANDALONE draft, beside the
same target without speculation and beside SGLang's own cold starts, in one run (GPU).

    # H200 with SGLang 0.5.17 from scripts/gpu-prepare.sh --sglang; an 8B target and its draft built on the spot:
    python -m benchmarks.sglang_speculative --shape 8b-spec --dir /tmp/sspec --out sglang-speculative-8b.json
    python -m benchmarks.sglang_speculative --shape small-spec --policy recreate --steps model,cold,capture,restore,drop

The model (``coldsnap.workloads.tiny_llama --shape 8b-spec``): an 8B-shaped target whose layers after the
second add nothing to the residual stream, and a two-layer draft made of its first layers, embedding and
head, so the draft predicts the target's tokens and its acceptance rate is high; a restore that lost or
misplaced the draft's weights would show as an acceptance rate near zero, one that lost the target's as
other tokens. Variants (``--variants``): ``spec`` (``--speculative-algorithm STANDALONE``, 3 steps, top-k 1,
4 draft tokens) and ``plain`` (the same target, no speculation). For each variant in turn, the steps:

  model     write the target and its draft (once)
  cold      SGLang's own loader: exec → first answer, then the check prompts (greedy token ids, and the
            draft's acceptance from SGLang's ``meta_info``)
  capture   ``coldsnap capture`` with ``--load-format coldsnap`` (graph policy ``--policy``)
  restore   ``--repeat`` restores, each timed from ``coldsnap restore``'s exec to the canary's match, then the
            check prompts: token ids and acceptance must equal the cold start's
  drop      delete the variant's artifact (an 8B artifact is ~20 GB; the host's disk holds one at a time)

The JSON keeps every run; the table (and ``--png``) shows the medians per variant and policy.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


from coldsnap.activation.canary import ask_canary  # noqa: E402
from coldsnap.atomic import write_atomic  # noqa: E402
from coldsnap.contracts.receipt import restored_pid  # noqa: E402
from coldsnap.snapshot.process_tree import kill_tree  # noqa: E402
from benchmarks.common import draw_medians, receipt_timeline  # noqa: E402
from benchmarks.sglang_startup import SGLANG_ARGS, SGLANG_ENV  # noqa: E402

STEPS = ("model", "cold", "capture", "restore", "drop")
VARIANTS = ("spec", "plain")
SPECULATION = ("--speculative-algorithm", "STANDALONE", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
               "--speculative-num-draft-tokens", "4")
FIRST_PROMPT = "The second prompt, asked after the restore."
CHECK_PROMPTS = tuple(f"Check prompt {i}: the restored server and the cold one answer {i} alike." for i in range(4))
CHECK_TOKENS = 48
ACCEPTANCE = ("spec_accept_rate", "spec_accept_length", "spec_verify_ct")


def generate(port: int, prompt: str) -> dict[str, object]:
    """One greedy ``/generate`` (SGLang's native API): the token ids and the draft's acceptance meta."""
    body = {"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": CHECK_TOKENS, "ignore_eos": True}}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        answer = json.loads(response.read())
    meta = answer.get("meta_info", {})
    return {"tokens": list(answer.get("output_ids") or []), **{k: meta[k] for k in ACCEPTANCE if k in meta}}


def memory_release_answer(port: int) -> dict[str, object]:
    """SGLang's ``/release_memory_occupation`` asked of a coldsnap-loaded server: its HTTP status and message
    (coldsnap refuses it), and whether the server still answers the first prompt afterwards."""
    import urllib.error

    request = urllib.request.Request(f"http://127.0.0.1:{port}/release_memory_occupation", data=b"{}",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            status, body = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, body = exc.code, exc.read()
    return {"status": status, "answer": body.decode(errors="replace")[:600],
            "serves_after": ask_canary(port, FIRST_PROMPT, 12).token_ids}


def check(port: int) -> dict[str, object]:
    """The check prompts' answers: token ids per prompt and, with speculation, acceptance per prompt."""
    answers = [generate(port, prompt) for prompt in CHECK_PROMPTS]
    checked: dict[str, object] = {"tokens": [a["tokens"] for a in answers]}
    for key in ACCEPTANCE:
        if all(key in a for a in answers):
            checked[key] = [round(float(a[key]), 4) for a in answers]  # type: ignore[arg-type]
    return checked


class SpeculativeBench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.work = Path(args.dir)
        self.work.mkdir(parents=True, exist_ok=True)
        self.state_path = self.work / "sglang-speculative.json"
        self.state = json.loads(self.state_path.read_text()) if self.state_path.exists() else {
            "benchmark": "sglang_speculative", "shape": args.shape, "speculation": list(SPECULATION), "runs": [],
            "captures": {}}
        self.model = self.work / f"llama-{args.shape}"
        self.draft = Path(f"{self.model}-draft")
        self.port = args.port
        self.variant = VARIANTS[0]

    # bookkeeping -------------------------------------------------------------------------------------

    @property
    def key(self) -> str:
        return f"{self.variant} {self.args.policy}"

    @property
    def artifact(self) -> Path:
        return self.work / f"artifact-{self.variant}-{self.args.policy}"

    def serve_command(self, *extra: str) -> list[str]:
        speculation = (*SPECULATION, "--speculative-draft-model-path", str(self.draft)) if self.variant == "spec" else ()
        return [sys.executable, "-m", "sglang.launch_server", "--model-path", str(self.model), "--port", str(self.port),
                *SGLANG_ARGS, *speculation, *self.args.sglang_args, *extra]

    def env(self) -> dict[str, str]:
        return {**os.environ, **SGLANG_ENV}

    def save(self) -> None:
        self.state["summary"] = summarize(self.state["runs"])
        document = (json.dumps(self.state, indent=1, sort_keys=True) + "\n").encode()
        write_atomic(self.state_path, document)
        if self.args.out:
            write_atomic(Path(self.args.out), document)

    def cold_reference(self) -> dict | None:
        return next((r for r in self.state["runs"] if r["variant"] == self.variant and r["kind"] == "cold start"), None)

    def record(self, kind: str, seconds: float, checked: dict, **more: object) -> None:
        reference = self.cold_reference()
        run = {"variant": self.variant, "policy": self.args.policy if kind != "cold start" else None, "kind": kind,
               "seconds": round(seconds, 3), **checked, **more, "at": time.strftime("%Y-%m-%dT%H:%M:%S")}
        if reference is not None:
            run["same_tokens"] = run["tokens"] == reference["tokens"]
            if "spec_accept_rate" in reference:
                run["same_acceptance"] = all(run.get(k) == reference[k] for k in ACCEPTANCE)
        plain = next((r for r in self.state["runs"] if r["variant"] == "plain" and r["kind"] == "cold start"), None)
        if self.variant == "spec" and plain is not None:
            run["same_tokens_as_plain_cold_start"] = run["tokens"] == plain["tokens"]
        self.state["runs"].append(run)
        print(json.dumps({k: v for k, v in run.items() if k != "tokens"}), flush=True)
        self.save()

    # steps -------------------------------------------------------------------------------------------

    def step_model(self) -> None:
        if (self.model / "coldsnap-tiny-model.json").exists() and (self.draft / "coldsnap-tiny-model.json").exists():
            return
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "coldsnap.workloads.tiny_llama", str(self.model), "--shape", self.args.shape],
                       check=True)
        self.state["model_write_s"] = round(time.perf_counter() - started, 2)
        self.state["model_bytes"] = {"target": sum(p.stat().st_size for p in self.model.glob("*.safetensors")),
                                     "draft": sum(p.stat().st_size for p in self.draft.glob("*.safetensors"))}
        self.save()

    def step_cold(self) -> None:
        log = self.work / f"cold-{self.variant}-{len(self.state['runs'])}.log"
        from coldsnap.demo import plain_server, first_answer

        with plain_server(self.serve_command(), self.env(), log) as (process, started):
            seconds, _ = first_answer(self.port, started, process, 900, FIRST_PROMPT, 12, log)
            checked = check(self.port)
        self.record("cold start", seconds, checked)

    def step_capture(self) -> None:
        if (self.artifact / "artifact.json").exists():
            return
        from coldsnap.cli import capture_request

        request = capture_request(["--out", str(self.artifact), "--operation-id", f"bench-{self.variant}", "--",
                                   *self.serve_command("--load-format", "coldsnap")])
        request["policy"] = {"graphs": {"mode": self.args.policy}}
        request_path = self.work / f"capture-request-{self.variant}-{self.args.policy}.json"
        request_path.write_text(json.dumps(request))
        receipt_path = self.work / f"capture-receipt-{self.variant}-{self.args.policy}.json"
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "coldsnap", "capture", "--request-json", str(request_path),
                               "--receipt-json", str(receipt_path)], env=self.env())
        seconds = time.perf_counter() - started
        receipt = json.loads(receipt_path.read_text())
        engine_log = self.artifact / "logs" / "unit-0.log"
        if engine_log.exists():
            shutil.copyfile(engine_log, self.work / f"capture-engine-{self.variant}-{self.args.policy}.log")
        if done.returncode != 0:
            raise SystemExit(f"capture ({self.key}) failed: {json.dumps(receipt.get('error'))}")
        spans = {s["name"]: s for s in receipt["timing"]["spans"]}
        self.state["captures"][self.key] = {
            "seconds": round(seconds, 2),
            "phases": {n: round(s["duration_ns"] / 1e9, 3) for n, s in spans.items()},
            "prepare": spans["capture.prepare"]["attributes"],
            "image_bytes": spans["capture.criu_dump"]["attributes"]["image_bytes"],
            "payload_bytes": sum(p.stat().st_size for p in (self.artifact / "payload").glob("*.pack")),
        }
        self.save()

    def step_restore(self) -> None:
        for _ in range(self.args.repeat):
            receipt_path = self.work / f"restore-{self.variant}-{len(self.state['runs'])}.json"
            exec_ns = time.time_ns()
            done = subprocess.run([sys.executable, "-m", "coldsnap", "restore", str(self.artifact), "--receipt-json",
                                   str(receipt_path)], env=self.env(), capture_output=True, text=True)
            exit_ns = time.time_ns()
            receipt = json.loads(receipt_path.read_text())
            try:
                if done.returncode != 0:
                    raise SystemExit(f"restore ({self.key}) failed: {receipt.get('error')}\n{done.stderr[-3000:]}")
                checked = check(self.port)
                checked["first_tokens"] = ask_canary(self.port, FIRST_PROMPT, 12).token_ids
                if not any(r.get("memory_release") for r in self.state["runs"] if r["variant"] == self.variant):
                    checked["memory_release"] = memory_release_answer(self.port)
            finally:
                pid = restored_pid(receipt)
                if pid is not None:
                    kill_tree(pid)
                time.sleep(0.5)
            phases = receipt_timeline(receipt, exec_ns, exit_ns)
            resume = next((s["attributes"] for s in receipt["timing"]["spans"] if s["name"].endswith(".resume")), {})
            graphs = {k: v for k, v in resume.items() if "graphs_recaptured" in k or "recapture_graphs" in k}
            self.record("restore", phases.pop("exec → canary matched"), checked, phases=phases, graphs=graphs)

    def step_drop(self) -> None:
        shutil.rmtree(self.artifact, ignore_errors=True)


def _label(run: dict) -> str:
    return f"{run['variant']}: {run['kind']}" + (f" ({run['policy']})" if run.get("policy") else "")


def summarize(runs: list[dict]) -> dict[str, float]:
    groups: dict[str, list[float]] = {}
    for run in runs:
        groups.setdefault(_label(run), []).append(run["seconds"])
    return {label: round(statistics.median(values), 3) for label, values in groups.items()}


def render(state: dict) -> str:
    lines = [f"SGLang {state.get('sglang', '')} speculative decoding (STANDALONE draft), {state['shape']}: median seconds"]
    for label, value in state["summary"].items():
        values = [r["seconds"] for r in state["runs"] if _label(r) == label]
        spread = f"(n={len(values)}, {min(values)}–{max(values)})" if len(values) > 1 else "(n=1)"
        lines.append(f"  {label:<40} {value:>8}  {spread}")
    for key, capture in state.get("captures", {}).items():
        lines.append(f"  capture {key}: {capture['seconds']} s; image {capture['image_bytes'] / 2**30:.2f} GiB; "
                     f"pack {capture['payload_bytes'] / 2**30:.2f} GiB")
    for variant in VARIANTS:
        cold = next((r for r in state["runs"] if r["variant"] == variant and r["kind"] == "cold start"), None)
        restores = [r for r in state["runs"] if r["variant"] == variant and r["kind"] == "restore"]
        if cold is None or not restores:
            continue
        line = f"  {variant}: every restore's greedy token ids = the cold start's: {all(r['same_tokens'] for r in restores)}"
        if "spec_accept_rate" in cold:
            line += (f"; acceptance unchanged: {all(r.get('same_acceptance') for r in restores)} (cold start: rate "
                     f"{cold['spec_accept_rate']}, length {cold['spec_accept_length']})")
        lines.append(line)
    for run in state["runs"]:
        if run.get("memory_release"):
            answer = run["memory_release"]
            lines.append(f"  {run['variant']}: /release_memory_occupation after a restore: HTTP {answer['status']}, "
                         f"{answer['answer'][:160]}…; first prompt's tokens after it unchanged: "
                         f"{answer['serves_after'] == run['first_tokens']}")
    spec = [r for r in state["runs"] if r["variant"] == "spec" and "same_tokens_as_plain_cold_start" in r]
    if spec:
        lines.append(f"  spec runs' token ids = the plain cold start's: {all(r['same_tokens_as_plain_cold_start'] for r in spec)}")
    return "\n".join(lines)


def draw(state: dict, png: Path) -> bool:
    return draw_medians(state["summary"], f"SGLang {state.get('sglang', '')} {state['shape']}: speculative (STANDALONE) "
                        "and plain, cold start vs coldsnap", png)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="8b-spec", choices=["8b-spec", "small-spec"], help="default 8b-spec")
    parser.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated, per variant in order (default {','.join(STEPS)})")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="spec, plain or both, in order (default spec,plain)")
    parser.add_argument("--policy", default="retain", choices=["retain", "recreate"], help="capture's graph policy")
    parser.add_argument("--repeat", type=int, default=3, help="restores per variant (default 3)")
    parser.add_argument("--dir", help="work directory (keeps model, artifacts, logs, state; default a temporary one)")
    parser.add_argument("--out", help="write the JSON here too")
    parser.add_argument("--png", help="draw the chart here (needs matplotlib)")
    parser.add_argument("--from-json", metavar="JSON", help="only print the table (and draw --png) of an earlier run's JSON")
    parser.add_argument("--port", type=int, default=18251)
    parser.add_argument("--sglang-arg", dest="sglang_args", action="append", default=[],
                        help="extra `sglang.launch_server` argument (repeat)")
    args = parser.parse_args()
    if args.from_json:
        state = json.loads(Path(args.from_json).read_text())
        print(render(state))
        return 0 if not args.png or draw(state, Path(args.png)) else 1
    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if [s for s in steps if s not in STEPS] or [v for v in variants if v not in VARIANTS] or args.repeat < 1:
        parser.error(f"steps are {', '.join(STEPS)}; variants are {', '.join(VARIANTS)}; --repeat is at least 1")
    args.dir = args.dir or tempfile.mkdtemp(prefix="coldsnap-sglang-spec-")
    from coldsnap_sglang.compat import sglang_version

    bench = SpeculativeBench(args)
    bench.state["sglang"] = sglang_version()
    if "model" in steps:
        bench.step_model()
    for variant in variants:
        bench.variant = variant
        for step in steps:
            if step != "model":
                print(f"sglang_speculative: {variant} {args.policy}: step {step}", file=sys.stderr, flush=True)
                getattr(bench, f"step_{step}")()
    bench.save()
    print(render(bench.state))
    if args.png:
        draw(bench.state, Path(args.png))
    return 0


if __name__ == "__main__":
    sys.exit(main())

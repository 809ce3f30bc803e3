"""SGLang startup: `sglang.launch_server` cold start vs `coldsnap restore`, side by side (GPU).

    # H200 with SGLang 0.5.17 from scripts/gpu-prepare.sh --sglang, an 8B-shaped Llama built on the spot:
    python -m benchmarks.sglang_startup --shape 8b --dir /tmp/sbench --out sglang-8b.json
    python -m benchmarks.sglang_startup --shape 8b --dir /tmp/sbench --steps restore,cold-warm

The same steps, timing and JSON as ``vllm_startup.py`` (its ``Bench``), for SGLang: a cold start is
`python -m sglang.launch_server`'s exec to its first completion (SGLang's default loader, safetensors in
the page cache, CUDA graphs on), a restore is `coldsnap restore`'s exec to its exit after the canary
matched, and every run's greedy token ids are checked against the first cold start's. Steps: model,
cold-warm (SGLang's default loader; SGLang has no compile cache by default), capture (``--load-format
coldsnap``), restore, serving (``vllm_startup.py``'s, with SGLang's own ``sglang.bench_serving`` client),
native (a start from the captured pack), dropped. SGLang runs with the Triton
attention backend and PyTorch sampling (``SGLANG_ARGS``: the slim SGLang the H200 gets has no FA3
kernels and no FlashInfer JIT cache); add flags with ``--sglang-arg``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path


from benchmarks.vllm_startup import SERVE_LOAD, SERVE_METRICS, Bench, add_variant_arguments, run_steps, serve_load

STEPS = ("model", "cold-warm", "capture", "restore", "restore-4k", "restore-1t", "restore-late", "restore-log", "serving", "equality", "equality-cold", "equality-native", "native", "dropped")
SGLANG_ARGS = ("--attention-backend", "triton", "--sampling-backend", "pytorch", "--mem-fraction-static", "0.5")
SGLANG_ENV = {"HF_HUB_OFFLINE": "1", "NCCL_NVLS_ENABLE": "0", "COLDSNAP_ALLOW_UNQUALIFIED_DRIVER": "1",
              "SGLANG_PLUGINS": "coldsnap"}
LOG_PHASES = {  # SGLang 0.5.17's own log lines → phase names
    "weights load": r"Load weight end\. elapsed=([0-9.]+) s",
    "KV cache": r"Memory pool end\. elapsed=([0-9.]+) s",
    "CUDA graphs": r"Capture cuda graph end\. Time elapsed: ([0-9.]+) s",
}
KV_LINE = r"KV Cache is allocated\. #tokens: \d+, K size: ([0-9.]+) GB"


class SglangBench(Bench):
    name = "sglang_startup"
    engine_env = SGLANG_ENV
    load_client = "sglang.bench_serving"
    equality_engine = "sglang"

    def serve_command(self, *extra: str) -> list[str]:
        return [sys.executable, "-m", "sglang.launch_server", "--model-path", str(self.model), "--port", str(self.port),
                *SGLANG_ARGS, *extra]

    def parse_log(self, log: Path) -> dict[str, float]:
        text = log.read_text(errors="replace") if log.exists() else ""
        phases = {name: float(found[-1]) for name, pattern in LOG_PHASES.items() if (found := re.findall(pattern, text))}
        kv = re.findall(KV_LINE, text)
        if kv:
            phases["kv_cache_gib"] = round(2 * float(kv[-1]), 2)  # K and V
        return phases

    def serving_load(self, label: str) -> dict[str, float]:
        """``vllm_startup.Bench.serving_load`` with SGLang's own client (``sglang.bench_serving``: random token
        ids, fixed lengths — its ``random`` dataset would download ShareGPT)."""
        if self.args.load_client_path:  # vLLM's client, from another site, through SGLang's OpenAI API
            self.load_client = "vllm bench serve (openai backend)"
            env = {**os.environ, **self.env(), "PYTHONPATH": self.args.load_client_path}
            return Bench.serving_load(self, label, backend="openai", env=env)
        result = self.work / f"serve-{label}.jsonl"
        result.unlink(missing_ok=True)
        command = [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang", "--host", "127.0.0.1",
                   "--port", str(self.port), "--model", str(self.model), "--dataset-name", "random-ids",
                   "--random-input-len", str(self.load[0]), "--random-output-len", str(self.load[1]),
                   "--random-range-ratio", "1.0", "--num-prompts", str(self.load[2]),
                   "--max-concurrency", str(self.load[3]), "--seed", "0", "--disable-tqdm",
                   "--output-file", str(result)]
        with open(self.work / f"serve-{label}.log", "wb") as log:
            subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **self.env()})
        measured = json.loads(result.read_text().strip().splitlines()[-1])
        return {key: round(float(measured[key]), 3) for key in SERVE_METRICS}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="8b", choices=["tiny", "8b"], help="the model's shape (default 8b)")
    parser.add_argument("--steps", default=",".join(s for s in STEPS if s != "native"),
                        help=f"comma-separated, in order (default all but native): {', '.join(STEPS)}")
    parser.add_argument("--repeat", type=int, default=3, help="restores and cold starts (default 3)")
    parser.add_argument("--dir", help="work directory (keeps model, artifact, logs, state; default a temporary one)")
    parser.add_argument("--out", help="write the JSON here too")
    parser.add_argument("--png", help="draw the chart here (needs matplotlib)")
    parser.add_argument("--port", type=int, default=18241)
    parser.add_argument("--restore-arg", dest="restore_args", action="append", default=[],
                        help="extra `coldsnap restore` argument for the restore steps (repeat; e.g. --restore-arg=--host-thp)")
    parser.add_argument("--serve-load", default=SERVE_LOAD, type=serve_load,
                        help=f"serving step: input tokens,output tokens,prompts,concurrency (default {SERVE_LOAD})")
    parser.add_argument("--load-client-path", metavar="PYTHONPATH",
                        help="serving step: run vLLM's `vllm bench serve` (openai backend) from this PYTHONPATH instead "
                        "of sglang.bench_serving (which imports Hugging Face `datasets` at start)")
    parser.add_argument("--sglang-arg", dest="vllm_args", action="append", default=[],
                        help="extra `sglang.launch_server` argument (repeat; e.g. --sglang-arg=--mem-fraction-static=0.3)")
    add_variant_arguments(parser)
    args = parser.parse_args()
    args.device = "cuda"
    from coldsnap_sglang.compat import sglang_version

    return run_steps(SglangBench, parser, args, STEPS, "sglang", sglang_version())


if __name__ == "__main__":
    sys.exit(main())

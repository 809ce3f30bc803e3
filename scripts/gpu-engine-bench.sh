#!/usr/bin/env bash
# On the offline GPU test host: an engine's startup benchmark (benchmarks/ENGINE_startup.py, 8B shape) in
# the few device calls a session allows. Everything the calls share lives in /tmp while the host stays warm.
#
#   bash scripts/gpu-engine-bench.sh setup               wheels, CRIU, coldsnap._C (scripts/gpu-test.sh with
#                                                        COLDSNAP_GPU_SETUP_ONLY=1), once per host; receives
#                                                        the engine parts this call carries; starts writing
#                                                        the 8B model in the background (setsid: it outlives
#                                                        the call)
#   bash scripts/gpu-engine-bench.sh receive             receive the engine parts this call carries
#   bash scripts/gpu-engine-bench.sh ENGINE STEPS [N]    install ENGINE (vllm|sglang) from its parts once, then
#                                                        benchmarks/ENGINE_startup.py --steps STEPS --repeat N
#                                                        (default 3) in /tmp/ENGINE-bench; JSON, table and logs
#                                                        into $OUT (or /tmp/coldsnap-bench-out)
#
# Both benchmarks share one model (/tmp/coldsnap-llama-8b). Carry .gpu-bundle/wheels and .gpu-bundle/criu-debs
# with the first call, the ENGINE-site.json manifests with every call, and at most one ≤ 56 MiB part per call.
# COLDSNAP_BENCH_ARGS: more benchmark arguments (e.g. --restore-arg=--host-thp, --serve-load 512,128,256,64).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
out=${OUT:-/tmp/coldsnap-bench-out}
model=/tmp/coldsnap-llama-8b
log() { printf 'gpu-engine-bench: %s\n' "$*" >&2; }
mkdir -p "$out"

receive() {
    for engine in vllm sglang; do
        if ls .gpu-bundle/$engine/$engine-site.tar.gz.part* >/dev/null 2>&1; then
            bash scripts/gpu-engine.sh "$engine" receive
        fi
    done
}

case "${1:-}" in
    setup)
        receive
        mkdir -p /tmp/coldsnap-bundle  # what gpu-test.sh installs, kept for the calls that carry none of it
        cp -r .gpu-bundle/wheels .gpu-bundle/criu-debs /tmp/coldsnap-bundle/
        [ -d .gpu-bundle/bench-wheels ] && cp -r .gpu-bundle/bench-wheels /tmp/coldsnap-bundle/
        COLDSNAP_GPU_BUNDLE=/tmp/coldsnap-bundle COLDSNAP_GPU_SETUP_ONLY=1 bash scripts/gpu-test.sh "$out/setup"
        if [ ! -f "$model/coldsnap-tiny-model.json" ]; then
            log "writing the 8B-shaped model into $model in the background"
            PYTHONPATH="$repo" setsid nohup python3 -m coldsnap.workloads.tiny_llama "$model" --shape 8b \
                >"/tmp/coldsnap-model.log" 2>&1 </dev/null &
        fi
        ;;
    receive)
        receive
        ;;
    vllm|sglang)
        engine=$1
        steps=${2:?steps}
        repeat=${3:-3}
        export COLDSNAP_CRIU=/tmp/coldsnap-criu/bin/criu PYTHONUNBUFFERED=1
        site=/tmp/coldsnap-$engine-site
        [ -d "$site" ] || bash scripts/gpu-engine.sh "$engine" install
        # as benchmarks/README.md runs each: vLLM's site after coldsnap's, SGLang's before (its pinned
        # transformers and tokenizers must win over the host's)
        if [ "$engine" = vllm ]; then
            export PYTHONPATH="/tmp/coldsnap-site:$repo:$site"
        else
            export PYTHONPATH="$site:/tmp/coldsnap-site:$repo"
        fi
        while pgrep -f "coldsnap.workloads.tiny_llama $model" >/dev/null; do sleep 2; done  # the model being written
        [ -f "$model/coldsnap-tiny-model.json" ] || { log "no model at $model: $(tail -5 /tmp/coldsnap-model.log)"; exit 1; }
        work=/tmp/$engine-bench
        mkdir -p "$work"
        ln -sfn "$model" "$work/llama-8b"
        set +e
        device=()
        [ "$engine" = vllm ] && device=(--device cuda)  # vllm_startup.py's default is vLLM's CPU build
        python3 "benchmarks/${engine}_startup.py" "${device[@]}" --shape 8b --dir "$work" --steps "$steps" --repeat "$repeat" \
            --out "$out/$engine-startup.json" ${COLDSNAP_BENCH_ARGS:-} 2>&1 | tee -a "$out/$engine-startup.log"
        status=${PIPESTATUS[0]}
        set -e
        # this engine's logs and receipts so far (no model, artifact or caches), for $OUT
        (cd "$work" && find . -maxdepth 1 -type f \( -name '*.log' -o -name '*.json' -o -name '*.jsonl' \) -print0 |
            tar -czf "$out/$engine-logs.tar.gz" --null -T -) || true
        exit "$status"
        ;;
    *)
        sed -n '2,18p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
        exit 2
        ;;
esac

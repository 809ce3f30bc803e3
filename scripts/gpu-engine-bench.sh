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
#   bash scripts/gpu-engine-bench.sh vllm-diagnosis STEPS [ARGS]
#                                                        install vLLM once, then benchmarks/vllm_equality_diagnosis.py
#                                                        --steps STEPS ARGS in /tmp/vllm-diagnosis (restored vs cold:
#                                                        answers, logprobs, GPU state digests)
#   bash scripts/gpu-engine-bench.sh capture-equality STEPS [ARGS]
#                                                        install vLLM once, then benchmarks/capture_equality.py --steps
#                                                        STEPS ARGS in /tmp/capture-equality (each capture with its
#                                                        reference check, restored, 256 prompts vs a plain start);
#                                                        COLDSNAP_BENCH_PYTHON: another interpreter (a dry run on CPU)
#   bash scripts/gpu-engine-bench.sh restore-ab ARTIFACT KEY=VALUE...
#                                                        with vLLM's site: benchmarks/restore_ab.py on an artifact an
#                                                        earlier step captured (A as it is, B with KEY=VALUE...,
#                                                        COLDSNAP_AB_RESTORES each, default 5, e.g. CRIU_KDAT_DIR=),
#                                                        then benchmarks/replica_start.py on it
#   bash scripts/gpu-engine-bench.sh sglang-speculative [ARGS]
#                                                        install SGLang once, then benchmarks/sglang_speculative.py
#                                                        ARGS (e.g. --policy recreate --steps cold,capture,restore,drop)
#                                                        in /tmp/sglang-speculative-SHAPE, on the model of
#                                                        COLDSNAP_BENCH_SHAPE (8b-spec or small-spec) and its draft
#
# The benchmarks share one model (/tmp/coldsnap-llama-SHAPE; COLDSNAP_BENCH_SHAPE, default 8b, is what setup
# writes). Carry .gpu-bundle/wheels, .gpu-bundle/criu-debs and .gpu-bundle/registry (Debian's docker-registry .deb,
# for the fresh-node step: scripts/gpu-prepare.sh) with the first call, the ENGINE-site.json
# manifests with every call, and at most one ≤ 44 MiB part per call. COLDSNAP_BENCH_ARGS: more benchmark
# arguments (e.g. --restore-arg=--host-thp, --serve-load 512,128,256,64). COLDSNAP_BENCH_TP=N (nvidia-h200-x2
# and up): the engine serves at tensor-parallel size N (vLLM --tensor-parallel-size with its all-reduce + RMSNorm
# fusion off, SGLang --tp-size), NCCL_NVLS_ENABLE=0, and the outputs are named ENGINE-startup-tpN.*.
# COLDSNAP_BENCH_VARIANT=NAME: the steps run in a work directory of their own (their own capture, e.g. with
# COLDSNAP_TRIM_LOCAL_MEMORY=0 exported) that shares the default's compile cache and its cold start's equality
# answers; outputs ENGINE-startup-NAME.*.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
out=${OUT:-/tmp/coldsnap-bench-out}
shape=${COLDSNAP_BENCH_SHAPE:-8b}
model=/tmp/coldsnap-llama-$shape
tp=${COLDSNAP_BENCH_TP:-1}
suffix=""  # of the outputs' and work directories' names at TP > 1
if [ "$tp" -gt 1 ]; then
    suffix=-tp$tp
    export NCCL_NVLS_ENABLE=0  # NVLink multicast stays off on the lent pairs (the device tool's KINDS.md)
fi
log() { printf 'gpu-engine-bench: %s\n' "$*" >&2; }
mkdir -p "$out"

engine_path() {  # install the engine from its parts once; its PYTHONPATH, as benchmarks/README.md runs it
    local engine=$1 site=/tmp/coldsnap-$1-site
    export COLDSNAP_CRIU=/tmp/coldsnap-criu/bin/criu PYTHONUNBUFFERED=1 PATH="/tmp/coldsnap-registry/usr/bin:$PATH"
    [ -d "$site" ] || bash scripts/gpu-engine.sh "$engine" install
    # vLLM's site after coldsnap's, SGLang's before (its pinned transformers and tokenizers must win over the host's)
    if [ "$engine" = vllm ]; then
        export PYTHONPATH="/tmp/coldsnap-site:$repo:$site"
    else
        export PYTHONPATH="$site:/tmp/coldsnap-site:$repo"
    fi
}

wait_for_model() {
    while pgrep -f "coldsnap.workloads.tiny_llama $model" >/dev/null; do sleep 2; done  # the model being written
    [ -f "$model/coldsnap-tiny-model.json" ] || { log "no model at $model: $(tail -5 /tmp/coldsnap-model.log)"; exit 1; }
}

tensor_parallel_args() {  # the benchmark's arguments that serve ENGINE at TP $tp (none at TP 1)
    [ "$tp" -gt 1 ] || return 0
    case "$1" in
        # vLLM's FlashInfer all-reduce + RMSNorm fusion kills its first profile run on the pair (docs/gpu-host.md)
        vllm) printf '%s\n' "--vllm-arg=--tensor-parallel-size=$tp" \
                  '--vllm-arg=--compilation-config={"pass_config": {"fuse_allreduce_rms": false}}' ;;
        sglang*) printf '%s\n' "--sglang-arg=--tp-size=$tp" ;;
    esac
}

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
        # Debian's docker-registry (a static Go binary) for the fresh-node step's registry on loopback: unpacked, not
        # installed (the host's image has no apt sources to satisfy the package's dependencies)
        if ls .gpu-bundle/registry/docker-registry_*.deb >/dev/null 2>&1 && [ ! -x /tmp/coldsnap-registry/usr/bin/docker-registry ]; then
            dpkg-deb -x .gpu-bundle/registry/docker-registry_*.deb /tmp/coldsnap-registry
        fi
        if [ ! -f "$model/coldsnap-tiny-model.json" ] && ! pgrep -f "coldsnap.workloads.tiny_llama $model" >/dev/null; then
            log "writing the $shape-shaped model into $model in the background"
            PYTHONPATH="$repo" setsid nohup python3 -m coldsnap.workloads.tiny_llama "$model" --shape "$shape" \
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
        engine_path "$engine"
        wait_for_model
        work=/tmp/$engine-bench$suffix
        name=$engine-startup$suffix
        if [ -n "${COLDSNAP_BENCH_VARIANT:-}" ]; then  # a capture of its own beside the default's, same compile cache
            mkdir -p "$work/vllm-cache" "$work-$COLDSNAP_BENCH_VARIANT"
            ln -sfn "$work/vllm-cache" "$work-$COLDSNAP_BENCH_VARIANT/vllm-cache"
            # the default's cold-start answers to the equality prompts: the same `vllm serve` command (the model is
            # served by its real path), so the variant's equality step compares against the same cold start
            if [ -f "$work/equality-cold-answers.json" ] && [ ! -f "$work-$COLDSNAP_BENCH_VARIANT/equality-cold-answers.json" ]; then
                cp "$work/equality-cold-answers.json" "$work-$COLDSNAP_BENCH_VARIANT/"
            fi
            work=$work-$COLDSNAP_BENCH_VARIANT
            name=$name-$COLDSNAP_BENCH_VARIANT
        fi
        mkdir -p "$work"
        ln -sfn "$model" "$work/llama-8b"
        set +e
        device=()
        [ "$engine" = vllm ] && device=(--device cuda)  # vllm_startup.py's default is vLLM's CPU build
        mapfile -t parallel < <(tensor_parallel_args "$engine")
        python3 -m "benchmarks.${engine}_startup" "${device[@]}" --shape 8b --dir "$work" --steps "$steps" --repeat "$repeat" \
            --out "$out/$name.json" "${parallel[@]}" ${COLDSNAP_BENCH_ARGS:-} 2>&1 | tee -a "$out/$name.log"
        status=${PIPESTATUS[0]}
        set -e
        # this engine's logs and receipts so far (no model, artifact or caches), for $OUT
        (cd "$work" && find . -maxdepth 1 -type f \( -name '*.log' -o -name '*.json' -o -name '*.jsonl' \) -print0 |
            tar -czf "$out/$name-logs.tar.gz" --null -T -) || true
        exit "$status"
        ;;
    vllm-diagnosis)
        engine_path vllm
        wait_for_model
        work=/tmp/vllm-diagnosis$suffix
        set +e
        timeout "${COLDSNAP_DIAGNOSIS_TIMEOUT_S:-3600}" python3 -m benchmarks.vllm_equality_diagnosis --dir "$work" --model "$model" --steps "${2:?steps}" "${@:3}" \
            2>&1 | tee -a "$out/vllm-diagnosis.log"
        status=${PIPESTATUS[0]}
        set -e
        cp "$work/diagnosis.json" "$out/" 2>/dev/null || true
        (cd "$work" && find . -maxdepth 1 -type f \( -name '*.log' -o -name '*receipt.json' \) -print0 |
            tar -czf "$out/vllm-diagnosis-logs.tar.gz" --null -T -) || true
        exit "$status"
        ;;
    capture-equality)
        python=${COLDSNAP_BENCH_PYTHON:-python3}
        [ -n "${COLDSNAP_BENCH_PYTHON:-}" ] || engine_path vllm  # (a dry run brings its own vLLM)
        wait_for_model
        work=/tmp/capture-equality$suffix
        mkdir -p "$work"
        ln -sfn "$model" "$work/llama-$shape"
        set +e
        "$python" -m benchmarks.capture_equality --dir "$work" --shape "$shape" --steps "${2:?steps}" --out \
            "$out/capture-equality.json" "${@:3}" 2>&1 | tee -a "$out/capture-equality.log"
        status=${PIPESTATUS[0]}
        set -e
        # receipts and the servers' logs (the artifacts, removed after each capture, keep none)
        (cd "$work" && find . -maxdepth 1 -type f \( -name '*receipt.json' -o -name '*.log' \) -print0 |
            tar -czf "$out/capture-equality-logs.tar.gz" --null -T -) || true
        exit "$status"
        ;;
    restore-ab)
        engine_path vllm
        artifact=${2:?artifact}
        shift 2
        b=()
        for assignment in "$@"; do b+=(--b "$assignment"); done
        export COLDSNAP_ALLOW_UNQUALIFIED_DRIVER=1  # (as the engine benchmarks set it: these hosts' drivers are 580)
        set +e
        python3 -m benchmarks.restore_ab --artifact "$artifact" "${b[@]}" --restores "${COLDSNAP_AB_RESTORES:-5}" \
            --out "$out/restore-ab.json" 2>&1 | tee -a "$out/restore-ab.log"
        status=${PIPESTATUS[0]}
        python3 -m benchmarks.replica_start --artifact "$artifact" --repeat 15 --out "$out/replica-start.json" 2>&1 |
            tee -a "$out/restore-ab.log"
        set -e
        exit "$status"
        ;;
    sglang-speculative)
        shift
        engine_path sglang
        pgrep -f "coldsnap.workloads.tiny_llama $model" >/dev/null && wait_for_model
        work=/tmp/sglang-speculative-$shape$suffix
        mkdir -p "$work"
        if [ -f "$model/coldsnap-tiny-model.json" ]; then  # setup wrote it; else the benchmark's model step does
            ln -sfn "$model" "$work/llama-$shape"
            ln -sfn "$model-draft" "$work/llama-$shape-draft"
        fi
        mapfile -t parallel < <(tensor_parallel_args sglang)
        name=sglang-speculative$suffix
        set +e
        python3 -m benchmarks.sglang_speculative --shape "$shape" --dir "$work" --out "$out/$name.json" "${parallel[@]}" "$@" \
            2>&1 | tee -a "$out/$name.log"
        status=${PIPESTATUS[0]}
        set -e
        (cd "$work" && find . -maxdepth 1 -type f \( -name '*.log' -o -name '*.json' \) -print0 |
            tar -czf "$out/$name-logs.tar.gz" --null -T -) || true
        exit "$status"
        ;;
    *)
        awk 'NR > 1 && !/^#/ { exit } NR > 1' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
        exit 2
        ;;
esac

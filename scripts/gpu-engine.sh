#!/usr/bin/env bash
# On the offline GPU test host: put an inference engine together from the parts
# scripts/gpu-prepare.sh --vllm|--sglang made (scripts/gpu-prepare-engine.py). ENGINE is vllm or sglang.
#
#   bash scripts/gpu-engine.sh ENGINE receive   copy the parts this call brought (carry
#                                               .gpu-bundle/ENGINE/<part>) into /tmp/coldsnap-ENGINE-parts;
#                                               one call per part, back to back
#   bash scripts/gpu-engine.sh ENGINE install   check every part arrived, verify the archive's SHA-256,
#                                               unpack it into /tmp/coldsnap-ENGINE-site, byte-compile it;
#                                               prints the PYTHONPATH to use
#   bash scripts/gpu-engine.sh ENGINE status    which parts are there
#
# A device call carries at most 64 MiB, the checkout (~12 MB) included, so an engine and the packages the host
# lacks travel as ≤ 44 MiB parts, one per call (vLLM ~190 MB in 5, SGLang ~74 MB in 2). /tmp on the host lasts only while it
# stays warm (~30 s idle): issue the receive calls back to back, then install and run. Run as
#   PYTHONPATH=/tmp/coldsnap-vllm-site:/tmp/coldsnap-site:$PWD python3 -m vllm.entrypoints.cli.main serve ...
#   PYTHONPATH=/tmp/coldsnap-sglang-site:/tmp/coldsnap-site:$PWD python3 -m sglang.launch_server ...
# (no console scripts; the site first, so its packages win over the host's where both have one).
# COLDSNAP_<ENGINE>_SITE (COLDSNAP_VLLM_SITE, COLDSNAP_SGLANG_SITE) unpacks elsewhere.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
usage() { sed -n '2,19p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 2; }
engine=${1:-}
case "$engine" in vllm|sglang) ;; *) usage ;; esac
bundle=${COLDSNAP_GPU_BUNDLE:-$repo/.gpu-bundle}
parts=/tmp/coldsnap-$engine-parts
site_var=COLDSNAP_${engine^^}_SITE
site=${!site_var:-/tmp/coldsnap-$engine-site}
manifest=$bundle/$engine/$engine-site.json
log() { printf 'gpu-%s: %s\n' "$engine" "$*" >&2; }
[ -f "$manifest" ] || { log "no $manifest: run scripts/gpu-prepare.sh --$engine on a connected machine and carry it"; exit 2; }
field() { python3 -c "import json,sys; v=json.load(open(sys.argv[1]))[sys.argv[2]]; print('\n'.join(v) if isinstance(v, list) else v)" "$manifest" "$1"; }

case "${2:-}" in
    receive)
        mkdir -p "$parts"
        got=0
        for part in "$bundle/$engine/$engine"-site.tar.gz.part*; do
            [ -f "$part" ] || continue
            cp "$part" "$parts/"
            got=$((got + 1))
            log "received $(basename "$part") ($(du -h "$part" | cut -f1))"
        done
        [ "$got" -gt 0 ] || { log "this call brought no part: carry .gpu-bundle/$engine/$engine-site.tar.gz.partNN"; exit 2; }
        ;;
    status)
        for name in $(field parts); do
            if [ -f "$parts/$name" ]; then log "$name: here"; else log "$name: missing"; fi
        done
        ;;
    install)
        missing=()
        for name in $(field parts); do [ -f "$parts/$name" ] || missing+=("$name"); done
        if [ ${#missing[@]} -gt 0 ]; then
            log "missing parts: ${missing[*]} (the host may have gone cold between calls: receive them again)"
            exit 1
        fi
        expected=$(field archive_sha256)
        whole() { for name in $(field parts); do cat "$parts/$name"; done; }
        actual=$(whole | sha256sum | cut -d' ' -f1)  # checked before anything is unpacked
        if [ "$actual" != "$expected" ]; then
            log "the parts do not add up to the archive (sha256 $actual, expected $expected): receive them again"
            exit 1
        fi
        rm -rf "$site.new" && mkdir -p "$site.new"
        whole | tar -xzf - -C "$site.new"
        rm -rf "$site" && mv "$site.new" "$site"
        # The host sets PYTHONDONTWRITEBYTECODE=1: without bytecode every engine start (the cold starts this
        # project compares against) would compile the engine from source; pip compiles on a real install.
        python3 -m compileall -q -j 0 "$site" >/dev/null 2>&1 || true
        if [ -d "$site/deep_gemm" ]; then
            # DeepGEMM builds its _C with the host's nvcc at first import (SGLang's speculative decoding imports
            # it while capturing the draft's graphs); built here once, as pip's install of a real image leaves
            # it, so that no measured start pays for the compiler
            log "building DeepGEMM's _C module"
            (cd / && PYTHONPATH="$site" python3 -c "import deep_gemm" >/tmp/coldsnap-deep-gemm-build.log 2>&1) ||
                log "DeepGEMM did not build (speculative decoding will fail to start): $(tail -3 /tmp/coldsnap-deep-gemm-build.log)"
        fi
        log "$engine $(field "$engine") in $site"
        echo "PYTHONPATH=$site"
        ;;
    *)
        usage
        ;;
esac

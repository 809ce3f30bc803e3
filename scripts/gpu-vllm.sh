#!/usr/bin/env bash
# On the offline GPU test host: put vLLM 0.26 together from the parts scripts/gpu-prepare.sh --vllm made.
#
#   bash scripts/gpu-vllm.sh receive     copy the parts this call brought (carry .gpu-bundle/vllm/<part>)
#                                        into /tmp/coldsnap-vllm-parts; one call per part, back to back
#   bash scripts/gpu-vllm.sh install     check every part arrived, verify the archive's SHA-256, unpack it
#                                        into /tmp/coldsnap-vllm-site (~10 s); prints the PYTHONPATH to use
#   bash scripts/gpu-vllm.sh status      which parts are there
#
# A device call carries at most 64 MiB, so the ~170 MB of vLLM and the packages the host lacks travel
# as ≤ 62 MiB parts, one per call. /tmp on the host lasts only while it stays warm (~30 s idle): issue
# the receive calls back to back, then install and run. Use vLLM as
#   PYTHONPATH=/tmp/coldsnap-vllm-site:/tmp/coldsnap-site:$PWD python3 -m vllm.entrypoints.cli.main serve ...
# (no console script; that site first, so its packages win over the host's where both have one).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bundle=${COLDSNAP_GPU_BUNDLE:-$repo/.gpu-bundle}
parts=/tmp/coldsnap-vllm-parts
site=${COLDSNAP_VLLM_SITE:-/tmp/coldsnap-vllm-site}
manifest=$bundle/vllm/vllm-site.json
log() { printf 'gpu-vllm: %s\n' "$*" >&2; }
[ -f "$manifest" ] || { log "no $manifest: run scripts/gpu-prepare.sh --vllm on a connected machine and carry it"; exit 2; }
listed() { python3 -c "import json,sys; print('\n'.join(json.load(open(sys.argv[1]))['parts']))" "$manifest"; }

case "${1:-}" in
    receive)
        mkdir -p "$parts"
        got=0
        for part in "$bundle"/vllm/vllm-site.tar.gz.part*; do
            [ -f "$part" ] || continue
            cp "$part" "$parts/"
            got=$((got + 1))
            log "received $(basename "$part") ($(du -h "$part" | cut -f1))"
        done
        [ "$got" -gt 0 ] || { log "this call brought no part: carry .gpu-bundle/vllm/vllm-site.tar.gz.partNN"; exit 2; }
        ;;
    status)
        for name in $(listed); do
            if [ -f "$parts/$name" ]; then log "$name: here"; else log "$name: missing"; fi
        done
        ;;
    install)
        missing=()
        for name in $(listed); do [ -f "$parts/$name" ] || missing+=("$name"); done
        if [ ${#missing[@]} -gt 0 ]; then
            log "missing parts: ${missing[*]} (the host may have gone cold between calls: receive them again)"
            exit 1
        fi
        expected=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['archive_sha256'])" "$manifest")
        whole() { for name in $(listed); do cat "$parts/$name"; done; }
        actual=$(whole | sha256sum | cut -d' ' -f1)  # checked before anything is unpacked
        if [ "$actual" != "$expected" ]; then
            log "the parts do not add up to the archive (sha256 $actual, expected $expected): receive them again"
            exit 1
        fi
        rm -rf "$site.new" && mkdir -p "$site.new"
        whole | tar -xzf - -C "$site.new"
        rm -rf "$site" && mv "$site.new" "$site"
        # The host sets PYTHONDONTWRITEBYTECODE=1: without bytecode every vLLM start (the cold starts this
        # project compares against) would compile vLLM from source; pip compiles on a real install.
        python3 -m compileall -q -j 0 "$site" >/dev/null 2>&1 || true
        log "vLLM $(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['vllm'])" "$manifest") in $site"
        echo "PYTHONPATH=$site"
        ;;
    *)
        sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'
        exit 2
        ;;
esac

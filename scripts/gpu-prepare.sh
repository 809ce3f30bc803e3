#!/usr/bin/env bash
# On a connected machine: gather what the offline GPU test host lacks into one folder.
#
#   bash scripts/gpu-prepare.sh [--vllm] [--sglang] [BUNDLE_DIR]     (default .gpu-bundle, git-ignored)
#
# BUNDLE_DIR/wheels     Python 3.12 manylinux x86_64 wheels of coldsnap's runtime dependencies that the
#                       GPU host's image does not have (pydantic and its parts, pyzmq, hyperscan for the secret scan), versions pinned to
#                       this checkout's .venv where it has them; none of a distribution the host has at an
#                       equal or newer version (scripts/gpu-bundle-wheels.py, scripts/h200-host-packages.txt);
# BUNDLE_DIR/criu-debs  the CRIU 4.2.1 .debs (about 9.3 MB) and the criu binary built from them with
#                       the patches of scripts/criu/series (1.6 MB), for `install-criu.sh --from-debs`;
# BUNDLE_DIR/bench-wheels  fastsafetensors and instanttensor, comparators of benchmarks/hydrate.py.
# BUNDLE_DIR/registry   Debian's docker-registry .deb: the fresh-node benchmark's registry on the host's loopback.
#
# --vllm, also:
# BUNDLE_DIR/vllm       vLLM 0.26.0 (the release whose torch is the host's 2.11.0+cu130) and the packages the
#                       host lacks, slimmed and split into ≤ 44 MiB parts (scripts/gpu-prepare-engine.py);
#                       bring them one per device call and put them together with scripts/gpu-engine.sh vllm.
# --sglang, also:
# BUNDLE_DIR/sglang     SGLang 0.5.17 (likewise torch 2.11.0, CUDA 13), its sglang-kernel without FA3 and
#                       sm100, and the packages its server start imports that the host lacks, in ≤ 44 MiB
#                       parts; put them together with scripts/gpu-engine.sh sglang.
#
# Carry BUNDLE_DIR to the GPU host with the checkout, then run scripts/gpu-test.sh there.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
engines=()
while [ "${1:-}" = "--vllm" ] || [ "${1:-}" = "--sglang" ]; do engines+=("${1#--}"); shift; done
bundle=${1:-.gpu-bundle}
log() { printf 'gpu-prepare: %s\n' "$*" >&2; }

packages=(pydantic pydantic_core annotated_types typing_extensions typing_inspection pyzmq hyperscan)
python=python3
[ -x .venv/bin/python ] && python=.venv/bin/python
specs=()
for name in "${packages[@]}"; do
    version=$("$python" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name" 2>/dev/null || true)
    specs+=("${name}${version:+==$version}")
done

rm -rf "$bundle/wheels" "$bundle/bench-wheels"  # one version of each: pip refuses two
mkdir -p "$bundle/wheels"
log "downloading Python 3.12 wheels: ${specs[*]}"
"$python" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d "$bundle/wheels" "${specs[@]}" 2> >(grep -v "^WARNING: Location" >&2)

# Comparators for benchmarks/hydrate.py (optional there: the benchmark reports them missing otherwise).
mkdir -p "$bundle/bench-wheels"
log "downloading benchmark comparators: fastsafetensors, instanttensor"
"$python" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    -d "$bundle/bench-wheels" fastsafetensors instanttensor typer click shellingham rich markdown-it-py mdurl \
    2> >(grep -v "^WARNING: Location" >&2) || log "comparator wheels unavailable; the benchmark will say so"

# The host's packages come after the bundle's on PYTHONPATH: an older copy here would shadow a newer one there
# (the bundle's typing_extensions 4.15 once broke every vLLM start on the host).
"$python" scripts/gpu-bundle-wheels.py prune "$bundle/wheels" "$bundle/bench-wheels"

bash scripts/install-criu.sh --download-only "$bundle/criu-debs"

# Debian's docker-registry (one static binary, ~9 MB) for the fresh-node step's registry on the host's loopback.
if ! ls "$bundle"/registry/docker-registry_*.deb >/dev/null 2>&1; then
    mkdir -p "$bundle/registry"
    log "downloading Debian's docker-registry .deb"
    (cd "$bundle/registry" && apt-get download docker-registry >&2) || log "no docker-registry .deb: the fresh-node step cannot run"
fi
for engine in "${engines[@]}"; do
    python3 scripts/gpu-prepare-engine.py "$engine" "$bundle"
done
log "bundle ready: $(du -sh "$bundle" | cut -f1) in $bundle"

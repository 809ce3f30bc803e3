#!/usr/bin/env bash
# Install SGLang 0.5.17 (the release whose torch 2.11.0 matches the H200 test host) with coldsnap into its
# own virtual environment, for the tests of coldsnap's SGLang hooks against SGLang's real modules.
#
#   bash scripts/install-sglang.sh [VENV]        (default .venv-sglang; idempotent, ~2 min, ~5 GB)
#
# SGLang has no CPU build on the package index: this is its GPU build (cp311 wheel) with torch 2.11.0 and
# torchvision 0.26.0 (SGLang imports torchvision at start; the CPU torch has no matching torchvision),
# installed without SGLang's GPU-kernel requirements (sglang-kernel, flashinfer, FA4, tilelang, ...),
# which importing its server, scheduler, loader, memory pools and Llama model does not need. On a
# machine without a GPU those modules import, arguments parse and the load format resolves; nothing
# runs a model (tests/integration/test_sglang_hooks.py says what is not run).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${1:-$repo/.venv-sglang}
version=${SGLANG_VERSION:-0.5.17}
log() { printf 'install-sglang: %s\n' "$*" >&2; }
# pip's noise (offline index locations, resolver complaints about the GPU requirements left out) is dropped.
quiet() { "$@" 2> >(grep -v -e "^WARNING: Location" -e "^ *$" -e "requires" -e "dependency resolver" \
    -e "dependency conflicts" -e "BuildBackendWarning" -e "^ *!!" -e "^ *\*\*\*" >&2); }

if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import sglang.srt.server_args, coldsnap_sglang, coldsnap._C" 2>/dev/null; then
    log "sglang and coldsnap already in $venv"
    exit 0
fi
log "creating $venv"
python3 -m venv "$venv"
py="$venv/bin/python"
quiet "$py" -m pip install --quiet --upgrade pip "setuptools>=77"
log "installing torch 2.11.0 and torchvision 0.26.0 (SGLang $version's pins)"
quiet "$py" -m pip install --quiet "torch==2.11.0" "torchvision==0.26.0"
log "installing sglang==$version without its GPU kernels"
quiet "$py" -m pip install --quiet --no-deps "sglang==$version"
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "torch==2.11.0" > "$constraints"
# What importing SGLang's server, scheduler, model runner, loader and models needs (sglang's own pins where it has them).
quiet "$py" -m pip install --quiet -c "$constraints" aiohttp anthropic "blobfile==3.0.0" build compressed-tensors dill distro \
    easydict einops fastapi gguf interegular IPython msgspec ninja numpy nvidia-ml-py "openai==2.6.1" orjson packaging \
    partial_json_parser pillow "prometheus-client>=0.20.0" psutil pybase64 pydantic python-multipart "pyzmq>=25.1.2" \
    requests scipy sentencepiece setproctitle tiktoken tqdm "transformers==5.12.1" uvicorn uvloop watchfiles \
    "xgrammar==0.2.1" xxhash zstandard
log "installing coldsnap (editable, with its test tools) into $venv"
quiet "$py" -m pip install --quiet pybind11 pytest
quiet "$py" -m pip install --quiet --no-build-isolation --no-deps -e "$repo"
"$py" -c "import sglang.srt.server_args, coldsnap_sglang; import importlib.metadata as m; print('install-sglang: sglang', m.version('sglang'), 'ready in $venv')" >&2

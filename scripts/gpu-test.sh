#!/usr/bin/env bash
# On the offline GPU test host (H200): install what was brought along, build coldsnap._C with this
# host's python3, run the GPU tests and `coldsnap doctor`.
#
#   bash scripts/gpu-test.sh [LOG_DIR] [PYTEST ARGS...]
#
# Expects BUNDLE_DIR (COLDSNAP_GPU_BUNDLE, default .gpu-bundle) made by scripts/gpu-prepare.sh on a
# connected machine. Logs (build, pytest, doctor table and JSON) go to LOG_DIR (default $OUT when set,
# else /tmp/coldsnap-gpu-test). Nothing outside /tmp is changed on the host. Exit status: pytest's.
# COLDSNAP_GPU_SETUP_ONLY=1: install and build, run no test (before a benchmark). vLLM: scripts/gpu-vllm.sh.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
bundle=${COLDSNAP_GPU_BUNDLE:-.gpu-bundle}
logs=${1:-${OUT:-/tmp/coldsnap-gpu-test}}
shift $(( $# > 0 ? 1 : 0 ))
python=${PYTHON:-python3}
log() { printf 'gpu-test: %s\n' "$*" >&2; }
mkdir -p "$logs"
[ -d "$bundle/wheels" ] && [ -d "$bundle/criu-debs" ] || { log "no bundle at $bundle: run scripts/gpu-prepare.sh on a connected machine"; exit 2; }

site=/tmp/coldsnap-site
# The site goes first on PYTHONPATH, so a wheel of a distribution this python3 already has at an equal or newer
# version would shadow it (the bundle's typing_extensions 4.15 once broke every vLLM start): only the others go
# in, into a fresh site (no earlier bundle's copy stays behind).
wheels=($(env -u PYTHONPATH "$python" scripts/gpu-bundle-wheels.py select \
    "$bundle"/wheels/*.whl $(ls "$bundle"/bench-wheels/*.whl 2>/dev/null)))
log "installing ${#wheels[@]} brought wheels into $site"
rm -rf "$site" && mkdir -p "$site"
[ ${#wheels[@]} -eq 0 ] || "$python" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target "$site" "${wheels[@]}"
export PYTHONPATH="$site:$repo${PYTHONPATH:+:$PYTHONPATH}"
# The checkout is used in place (no pip install: the host is offline and builds _C below), so record a
# `coldsnap` distribution with pyproject's entry points in the site: engines find their plugins by them.
"$python" - "$repo/pyproject.toml" "$site" <<'PY'
import sys, tomllib
from pathlib import Path
project = tomllib.loads(Path(sys.argv[1]).read_text())["project"]
info = Path(sys.argv[2]) / "coldsnap-0.0.0+checkout.dist-info"
info.mkdir(parents=True, exist_ok=True)
(info / "METADATA").write_text("Metadata-Version: 2.1\nName: coldsnap\nVersion: 0.0.0+checkout\n")
groups = {**{"console_scripts": project.get("scripts", {})}, **project.get("entry-points", {})}
(info / "entry_points.txt").write_text("".join(f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n"
                                               for g, eps in groups.items()))
(info / "RECORD").write_text("")
PY

log "installing CRIU from $bundle/criu-debs"
bash scripts/install-criu.sh --from-debs "$bundle/criu-debs" --prefix /tmp/coldsnap-criu --no-link
export COLDSNAP_CRIU=/tmp/coldsnap-criu/bin/criu

# The host sets PYTHONDONTWRITEBYTECODE=1 and the wheels went in with --no-compile: without this every
# `coldsnap restore` compiled pydantic and coldsnap from source (imports 370 ms instead of ~200 ms on the
# H200), which a user's image — pip compiles on install — never pays. Python still reads the .pyc files.
log "compiling the site and the checkout to bytecode"
"$python" -m compileall -q -j 0 "$site" "$repo/coldsnap" "$repo/coldsnap_vllm" "$repo/coldsnap_sglang" >/dev/null || true

log "building coldsnap._C with $($python --version)"
"$python" setup.py build_ext --inplace >"$logs/build.log" 2>&1 || { tail -30 "$logs/build.log" >&2; exit 1; }

log "coldsnap doctor"
"$python" -m coldsnap doctor | tee "$logs/doctor.txt"
"$python" -m coldsnap doctor --json >"$logs/doctor.json"

if [ "${COLDSNAP_GPU_SETUP_ONLY:-0}" = 1 ]; then  # install and build only (benchmarks run next)
    log "set up; no tests run (COLDSNAP_GPU_SETUP_ONLY=1). Use: PYTHONPATH=$PYTHONPATH COLDSNAP_CRIU=$COLDSNAP_CRIU"
    exit 0
fi
log "pytest -m gpu"
set +e
"$python" -m pytest -m gpu -v -p no:cacheprovider "$@" 2>&1 | tee "$logs/pytest-gpu.log"
status=${PIPESTATUS[0]}
set -e
log "done (pytest status $status); logs in $logs"
exit "$status"
